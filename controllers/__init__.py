"""The Sluice controller service: sample metadata, leases, versions and staleness control.

Layout:
  table.py      per-partition sample table (numpy columns; readiness; per-task consumption)
  placement.py  which storage unit new rows go to (balanced by bytes)
  samplers.py   fifo, grpo_group, seqlen_balanced, and the interface for custom samplers
  dispatch.py   serving get_meta: waiting without polling, staleness policy, leases
  staleness.py  admission control (AReaL's budget) and stale counters
  versions.py   the monotone weight version and its waiters
  metrics.py    status() snapshot and the Prometheus endpoint
  service.py    the service: one handler per message type
Run with `python -m controllers`; clients reach it only over the wire.
"""

from .samplers import Sampler, SampleView

__all__ = ["Sampler", "SampleView"]
