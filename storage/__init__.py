"""Sluice storage units: where tensor rows live between producers and consumers.

Layout:
  arena.py     the unit's memory: one /dev/shm file, page-granular first-fit extents, chunks
  table.py     the row index: (partition, field, global index) -> bytes in the arena; read runs
  writes.py    checking a Write against its frames; shm reservations
  space.py     backpressure: the FIFO of writes waiting for space, with timeouts
  service.py   `StorageUnit`: the ROUTER service, one handler per storage request
  __main__.py  `python -m storage`: start a unit, register it with the controller, serve
Clients and the controller reach a unit only over the wire (transfer_queue.wire.messages).
"""

from .service import StorageUnit

__all__ = ["StorageUnit"]
