"""`cuda_ipc`: same host, GPU memory. Subscribers copy device to device straight out of the
publisher's GPU staging slots.

A publisher serving `cuda_ipc` stages every version into GPU slots (`staging = "cuda"`: a
device-to-device snapshot of its tensors, synchronised before the version is offered); served
beside host transports, those GPU slots sit beside host staging (`weight_sync.gpu_mirror`).
Each slot's CUDA IPC handle (`transfer_queue.cuda.ipc_share`: the device, the memory handle,
offsets and an event) travels as plain fields of an `IpcSlot` msgspec struct in the
subscriber's grant (`SlotInfo.handle`), never pickled. A subscriber opens each slot once per
slot generation, keeps it open, and at apply time copies its planned reads from it into its
tensors (device to device, or to the host for CPU tensors), with the same resharding reads as
`shm` and one wait for the copies before the lease is released. Slots, leases and versions are
the slot table's, as for `shm`: the GPU memory held is `slots` × the model's bytes (`slots=1`
halves it, and `publish` then waits for the previous version's readers). The leases alone say
when a slot's memory may go: no PyTorch cross-process count travels with a handle, so a slot
the table frees (a publisher closing, GPU staging stopping) is back in PyTorch's allocator
at once, however many processes opened it (a reader in the publisher's own process holds a
view of it until it maps the slot's next generation or closes). That is why a closing
publisher waits for its readers (`WeightPublisher.close`).

CUDA refuses to open an IPC handle in the process that made it, so a subscriber in the
publisher's own process (a colocated trainer and rollout engine) reads the slot tensor itself:
a publisher lists the slots it has shared in `_OWN_SLOTS`, keyed by their handle.
"""

from __future__ import annotations

import weakref

import msgspec
import torch

from transfer_queue import WeightSyncError
from transfer_queue.cuda import ipc_open, ipc_share

from ..protocol import SlotInfo
from .base import MapTransport, register

__all__ = ["CudaIpcTransport", "IpcSlot", "encode_slot", "decode_slot"]


class IpcSlot(msgspec.Struct, frozen=True, array_like=True):
    """A GPU staging slot's CUDA IPC handle, field by field (`ipc_share`'s tuple)."""

    device: int
    handle: bytes
    size: int
    offset: int
    event: bytes
    event_sync_required: bool

    def fields(self) -> tuple:
        """`ipc_open`'s argument."""
        return (
            self.device,
            self.handle,
            self.size,
            self.offset,
            self.event,
            self.event_sync_required,
        )


_OWN_SLOTS: weakref.WeakValueDictionary[tuple[bytes, int], torch.Tensor] = weakref.WeakValueDictionary()
"""This process's shared GPU slots, by (memory handle, offset): what a subscriber in the same
process reads instead of opening the handle. Weak, and nothing else removes an entry: a slot's
entry goes with its tensor, and memory freed and reused by a new slot comes back under the
same key for the new slot's tensor alone."""

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IpcSlot)


def encode_slot(fields: tuple) -> bytes:
    """`ipc_share`'s fields as the bytes of a grant's `SlotInfo.handle`."""
    device, handle, size, offset, event, sync = fields
    return _ENCODER.encode(
        IpcSlot(
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(event or b""),
            bool(sync),
        )
    )


def decode_slot(raw: bytes) -> IpcSlot:
    """The `IpcSlot` in a grant; raises `WeightSyncError` for anything else."""
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WeightSyncError(f"a cuda_ipc grant without a valid slot handle: {exc}") from None


@register
class CudaIpcTransport(MapTransport):
    """Opens publisher GPU slots through CUDA IPC; one opening per (rank, slot), kept until the
    slot's generation changes."""

    name = "cuda_ipc"
    staging = "cuda"

    def __init__(self) -> None:
        self._shared: dict[int, tuple[int, bytes]] = {}  # slot index -> (generation, encoded handle)
        self._opened: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def serve(self, source) -> str:  # noqa: ANN001 - nothing to serve: slots are opened by handle
        return "cuda"

    def describe(self, slot) -> bytes:  # noqa: ANN001 - a staging.Slot
        """The slot's IPC handle (shared once per generation)."""
        held = self._shared.get(slot.index)
        if held is None or held[0] != slot.generation:
            tensor = slot.mapped.tensor
            if not tensor.is_cuda:
                raise WeightSyncError("cuda_ipc serves GPU staging slots only")
            fields = ipc_share(tensor)
            _OWN_SLOTS[bytes(fields[1]), int(fields[3])] = tensor
            held = self._shared[slot.index] = (slot.generation, encode_slot(fields))
        return held[1]

    def open(self, rank: int, slot: SlotInfo) -> torch.Tensor:
        """A view of rank `rank`'s GPU `slot`, opened once per slot generation."""
        key = (rank, slot.index)
        held = self._opened.get(key)
        if held is not None and held[0] == slot.generation:
            return held[1]
        self._opened.pop(key, None)
        where = decode_slot(slot.handle)
        own = _OWN_SLOTS.get((where.handle, where.offset))
        try:
            view = own[: slot.size] if own is not None else ipc_open(where.fields(), slot.size)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"cannot open rank {rank}'s GPU slot {slot.index}: {exc} (not on the same host, or the publisher is gone)"
            ) from exc
        self._opened[key] = (slot.generation, view)
        return view

    def close(self) -> None:
        self._opened.clear()
        self._shared.clear()
