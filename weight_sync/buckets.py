"""Packing named tensors into fixed-size buckets of a staging slot.

`layout_buckets` assigns every tensor a (bucket, offset): tensors go in order, each 64-byte
aligned; one that does not fit the rest of a bucket starts the next, one larger than a bucket
is split over consecutive buckets. `pack` then copies (and casts) the tensors into the slot
in that order and reports progress bucket by bucket, so readers stream bucket k while bucket
k+1 is still being packed. Packing is the only copy a publisher makes: the trainer may change
its weights as soon as it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from transfer_queue.cuda import copy_each

from .layout import Layout
from .manifest import Entry, Manifest, dtype_name, dtype_of

__all__ = ["ALIGN", "layout_buckets", "Destinations", "pack"]

ALIGN = 64
"""Byte alignment of every staged tensor (cache lines; any dtype may view it)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout_buckets(
    tensors: Sequence[tuple[str, torch.dtype, Layout]], bucket_bytes: int, rank: int = 0, world_size: int = 1
) -> Manifest:
    """The manifest for `tensors` (name, wire dtype, layout), in the given order."""
    if bucket_bytes <= 0 or bucket_bytes % ALIGN:
        raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGN}, got {bucket_bytes}")
    entries = []
    position = 0  # bytes from the start of the slot
    for name, dtype, layout in tensors:
        nbytes = layout.numel * dtype.itemsize
        position = _align(position)
        used = position % bucket_bytes
        if used and used + nbytes > bucket_bytes and nbytes <= bucket_bytes:
            position += bucket_bytes - used  # would straddle: start the next bucket
        entries.append(Entry(name, dtype_name(dtype), layout, position // bucket_bytes, position % bucket_bytes))
        position += nbytes
    num_buckets = -(-position // bucket_bytes)
    return Manifest(rank, world_size, bucket_bytes, num_buckets, tuple(entries))


class Destinations:
    """Where each entry of `manifest` goes in `slot` (a uint8 tensor): its typed view there,
    the byte offset one past it, the pieces it is copied in as (first element, end element, view of them, byte
    offset one past them in the slot), cut at bucket boundaries (one piece into a GPU slot,
    which is offered only once whole: fewer launches), and, for an entry copied as one piece,
    its view in the local tensor's shape (None for flat shards and split entries), which a
    tensor of that shape is copied into as it is, without a flattened view of it per version.
    Made once per manifest and slot, so a `pack` does no per-tensor arithmetic or slicing of
    the slot from version to version."""

    def __init__(self, manifest: Manifest, slot: torch.Tensor):
        self.manifest = manifest
        self.slot = slot
        self.entries: list[tuple[torch.Tensor, int, list[tuple[int, int, torch.Tensor, int]], torch.Tensor | None]] = []
        for entry in manifest.entries:
            start = manifest.start(entry)
            dst = slot[start : start + entry.nbytes].view(dtype_of(entry.dtype))
            size = dst.element_size()
            if slot.is_cuda:
                pieces = [(0, dst.numel(), dst, start + entry.nbytes)]
            else:
                chunks = _bucket_chunks(start, dst.numel(), size, manifest.bucket_bytes)
                pieces = [(lo, hi, dst[lo:hi], start + hi * size) for lo, hi in chunks]
            whole = len(pieces) == 1 and entry.layout.flat_stop < 0
            self.entries.append(
                (dst, start + entry.nbytes, pieces, dst.view(entry.layout.local_shape) if whole else None)
            )


def pack(
    manifest: Manifest,
    tensors: Sequence[torch.Tensor],
    slot: torch.Tensor,
    progress: Callable[[int], None],
    destinations: Destinations | None = None,
) -> None:
    """Copy `tensors` (in manifest order) into `slot`, casting to each entry's wire dtype,
    through `destinations` (made for this manifest and slot, or here when not given).

    `progress(nbytes)` is called whenever bytes [0, nbytes) are staged and at least one more
    bucket boundary has been passed; large tensors are copied bucket by bucket for that, except
    into a GPU slot (offered only once whole: one copy per tensor, fewer launches).
    Copies between devices are issued `non_blocking`: a caller packing CUDA tensors into host
    memory must wait for them (`progress` then marks where they were issued, not done; the
    publisher waits on an event per mark). The copies up to each reported boundary are issued
    together (`copy_each`: one call, not one Python step per tensor).
    """
    bucket = manifest.bucket_bytes
    reported = 0
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []

    def staged(end: int) -> None:
        """The copies listed so far end at byte `end`: issue them at each bucket boundary passed."""
        nonlocal reported
        if end // bucket > reported // bucket:
            copy_each(dsts, srcs, non_blocking=True)
            dsts.clear()
            srcs.clear()
            progress(end)
            reported = end

    if destinations is None:
        destinations = Destinations(manifest, slot)
    on_gpu, device = slot.is_cuda, slot.device
    with torch.no_grad():  # a trainer's parameters require grad: no graph for their copies
        for (dst, end, pieces, shaped), tensor in zip(destinations.entries, tensors, strict=True):
            if tensor.is_cuda is not on_gpu or (on_gpu and tensor.device != device):
                # cast where the tensor lives: a copy between devices is then one plain transfer,
                # asynchronous into registered host memory (torch casts across devices via a
                # temporary on the host, which waits)
                tensor = tensor.to(dst.dtype)
            if shaped is not None and tensor.shape == shaped.shape:
                dsts.append(shaped)
                srcs.append(tensor)
                staged(end)
            elif tensor.is_contiguous():
                src = tensor.view(-1)
                for lo, hi, piece, upto in pieces:
                    dsts.append(piece)
                    srcs.append(src if len(pieces) == 1 else src[lo:hi])
                    staged(upto)
            else:
                dsts.append(dst.view(tensor.shape))  # strided source: one copy
                srcs.append(tensor)
                staged(end)
        copy_each(dsts, srcs, non_blocking=True)
    progress(manifest.nbytes)


def _bucket_chunks(start: int, numel: int, itemsize: int, bucket: int) -> list[tuple[int, int]]:
    """Element ranges of a tensor at byte `start` that end at bucket boundaries (or its end)."""
    out = []
    lo = 0
    while lo < numel:
        room = (bucket - (start + lo * itemsize) % bucket) // itemsize
        hi = min(lo + max(room, 1), numel)
        out.append((lo, hi))
        lo = hi
    return out
