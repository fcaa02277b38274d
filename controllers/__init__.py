"""The Sluice controller service: sample metadata, leases, versions and staleness control.

Layout:
  table.py      per-partition sample table (numpy columns; readiness; per-task consumption)
  placement.py  which storage unit new rows go to (balanced by bytes)
  samplers.py   fifo, grpo_group, seqlen_balanced, and the interface for custom samplers
  scheduling.py serving get_meta: waiting without polling, staleness policy, leases, acks
  admission.py  admission control for producers (AReaL's budget)
  versions.py   the monotone weight version and its waiters
  status.py     what status() reports, as typed statistics objects each part fills
  metrics.py    the Prometheus endpoint over the same objects
  service.py    the service: one handler per message type
Run with `python -m controllers`; clients reach it only over the wire.
"""

from .samplers import Sampler, SampleView

__all__ = ["Sampler", "SampleView"]
