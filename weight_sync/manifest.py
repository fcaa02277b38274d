"""What a publisher rank stages: one `Entry` per tensor, in bucket order.

A manifest is metadata only (name, wire dtype, layout of the global tensor, bucket, offset), so
subscribers plan their reads from it before a byte moves. It describes the layout of a slot,
not one version: consecutive versions of the same model share a manifest, identified by `id`,
so subscribers cache their plans and publishers send the manifest only when it changes.
"""

from __future__ import annotations

import msgspec
import torch
import xxhash

from .layout import Layout

__all__ = ["Entry", "Manifest", "dtype_name", "dtype_of"]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """ "bfloat16" -> `torch.bfloat16`."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One staged tensor: its local bytes start at byte `offset` of bucket `bucket` and run on
    contiguously (a tensor larger than a bucket continues into the following buckets)."""

    name: str
    dtype: str
    """Dtype on the wire, after the publisher's declared cast."""
    layout: Layout
    """Which part of the global tensor this rank holds (`layout.shape` is the global shape)."""
    bucket: int
    offset: int

    @property
    def itemsize(self) -> int:
        return dtype_of(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.layout.numel * self.itemsize


class Manifest(msgspec.Struct, frozen=True):
    """The staging layout of one publisher rank."""

    rank: int
    world_size: int
    bucket_bytes: int
    num_buckets: int
    entries: tuple[Entry, ...]

    @property
    def id(self) -> int:
        """A 64-bit digest of the whole layout: equal ids mean equal manifests."""
        return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(self))

    @property
    def nbytes(self) -> int:
        """Bytes of staging the layout needs (whole buckets)."""
        return self.num_buckets * self.bucket_bytes

    def start(self, entry: Entry) -> int:
        """Byte offset of `entry` from the start of the slot."""
        return entry.bucket * self.bucket_bytes + entry.offset
