"""Sluice storage units: where tensor rows live between producers and consumers.

Run with `python -m storage`; clients and the controller reach a unit only over the wire
(`transfer_queue.wire.messages`). `service.StorageUnit` handles the requests over the unit's
memory (`arena`, one /dev/shm file), its row index (`table`), write checks (`writes`),
backpressure (`space`) and staged frames (`staging`). One line per module: docs/architecture.md,
"The module map".
"""

from .service import StorageUnit

__all__ = ["StorageUnit"]
