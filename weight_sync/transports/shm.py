"""`shm`: same host, shared memory. Subscribers copy straight out of the publisher's slots.

The publisher's slots are already shared segments (memfds), so there is nothing to send and
nothing to serve: a subscriber maps the slot it was granted once per slot generation, keeps
it mapped, and at apply time copies its reads from it into its own tensors (one memcpy,
no socket, no intermediate buffer). In a process that uses CUDA the mapping is registered with
CUDA, so copies into GPU tensors run at pinned speed; it is unregistered before it is unmapped. Double buffering comes from the slot table: the publisher
stages version v+1 into the other slot while v is read, and never reuses a slot under a lease.
"""

from __future__ import annotations

import mmap

import torch

from transfer_queue import WeightSyncError
from transfer_queue.cuda import HostRegistry, in_use, tensor_ptr
from transfer_queue.host import unmap

from ..protocol import SlotInfo
from ..staging import map_segment
from .base import MapTransport, register

__all__ = ["ShmTransport"]


@register
class ShmTransport(MapTransport):
    """Maps publisher slots read-only; one mapping per (rank, slot), kept until it changes."""

    name = "shm"

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap, torch.Tensor]] = {}
        self._pinned = HostRegistry()

    def serve(self, source) -> str:  # noqa: ANN001 - nothing to serve: slots are shared
        return "memfd"

    def open(self, rank: int, slot: SlotInfo) -> torch.Tensor:
        """Rank `rank`'s `slot`, mapped (and registered) once per slot generation."""
        key = (rank, slot.index)
        held = self._maps.get(key)
        if held is not None and held[0] == slot.generation:
            return held[2]
        self._unmap(key)
        if not slot.path:
            raise WeightSyncError(f"rank {rank} does not share its staging memory")
        try:
            mm, view = map_segment(slot.path, slot.size)
        except OSError as exc:
            raise WeightSyncError(
                f"cannot map rank {rank}'s slot {slot.path}: {exc} (not on the same host, or the publisher is gone)"
            ) from exc
        self._maps[key] = (slot.generation, mm, view)
        if in_use():
            self._pinned.register(tensor_ptr(view), slot.size, read_only=True)
        return view

    def _unmap(self, key: tuple[int, int]) -> None:
        held = self._maps.pop(key, None)
        if held is not None:
            _, mm, view = held
            self._pinned.unregister(tensor_ptr(view))
            del view, held
            unmap(mm)  # a view may still be alive somewhere; the mapping then goes with it

    def close(self) -> None:
        for key in list(self._maps):
            self._unmap(key)
