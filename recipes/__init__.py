"""What users run on top of Sluice's public API (`import transfer_queue as tq`).

`demo`: the streaming demo behind `make demo` — two producer processes, two consumer tasks
(`compute_ref`, `actor_update`) over one embedded cluster, with a throughput summary.
"""
