"""The Sluice controller service: sample metadata, leases, versions and staleness control.

Run with `python -m controllers`; clients and storage units reach it only over the wire
(`transfer_queue.wire`). `service` builds the parts and wires each to what it uses: the ledger
of rows (`ledger`) over the sample tables (`table`), consumers (`scheduling`, `samplers`),
producers (`admission`, `intake`, `placement`, `puts`), versions, TransferQueue's keys (`keys`),
the storage units (`units`), the journal (`journal`, `records`), and what `status()` and the
metrics report. One line per module: docs/architecture.md, "The module map".
"""

from .samplers import Sampler, SampleView

__all__ = ["Sampler", "SampleView"]
