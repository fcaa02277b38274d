"""Packing named tensors into fixed-size buckets of a staging slot.

`layout_buckets` assigns every tensor a (bucket, offset): tensors go in order, each 64-byte
aligned; one that does not fit the rest of a bucket starts the next, one larger than a bucket
is split over consecutive buckets. `Packer` then copies (and casts) the tensors into the slot
in that order and reports progress bucket by bucket, so readers stream bucket k while bucket
k+1 is still being packed. Packing is the only copy a publisher makes: the trainer may change
its weights as soon as it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .layout import Layout
from .manifest import Entry, Manifest, dtype_name, dtype_of

__all__ = ["ALIGN", "layout_buckets", "pack"]

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


def pack(
    manifest: Manifest, tensors: Sequence[torch.Tensor], slot: torch.Tensor, progress: Callable[[int], None]
) -> None:
    """Copy `tensors` (in manifest order) into `slot`, casting to each entry's wire dtype.

    `progress(nbytes)` is called whenever bytes [0, nbytes) are staged and at least one more
    bucket boundary has been passed; large tensors are copied bucket by bucket for that, except
    into a GPU slot (offered only once whole: one copy per tensor, fewer launches).
    Copies between devices are issued `non_blocking`: a caller packing CUDA tensors into host
    memory must wait for them (`progress` then marks where they were issued, not done; the
    publisher waits on an event per mark).
    """
    bucket = manifest.bucket_bytes
    reported = 0

    def staged(end: int) -> None:
        nonlocal reported
        if end // bucket > reported // bucket:
            progress(end)
            reported = end

    for entry, tensor in zip(manifest.entries, tensors, strict=True):
        start = manifest.start(entry)
        dst = slot[start : start + entry.nbytes].view(dtype_of(entry.dtype))
        tensor = tensor.detach()
        if tensor.device != slot.device:
            # cast where the tensor lives: a copy between devices is then one plain transfer,
            # asynchronous into registered host memory (torch casts across devices via a
            # temporary on the host, which waits)
            tensor = tensor.to(dst.dtype)
        if slot.is_cuda and tensor.is_contiguous():
            dst.copy_(tensor.view(-1), non_blocking=True)  # GPU staging is offered whole: one copy
            staged(start + entry.nbytes)
        elif tensor.is_contiguous():
            src = tensor.view(-1)
            for lo, hi in _bucket_chunks(start, dst.numel(), dst.element_size(), bucket):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                staged(start + hi * dst.element_size())
        else:
            dst.view(tensor.shape).copy_(tensor, non_blocking=True)  # strided source: one copy
            staged(start + entry.nbytes)
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
