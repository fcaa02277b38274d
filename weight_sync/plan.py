"""The reshard plan: which bytes a subscriber reads from which publisher rank, and where they go.

Computed from metadata alone (the publishers' manifests and the subscriber's bindings), before
any data moves. `plan_tensor` intersects the pieces the publisher ranks hold with the box a
subscriber needs and covers that box exactly once (Awex's transfer plan: intersections of index
ranges; where several ranks hold the same elements the first in a rotating order wins, so
replicated tensors spread their load over ranks). `build_plan` does that for every binding and
lays the resulting `Read`s out back to back, rank after rank, in a receive buffer: each
subscriber moves every byte it needs exactly once and nothing else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from transfer_queue import SchemaError
from transfer_queue.cuda import is_cuda

from .layout import Box, Piece, intersect, numel, subtract
from .manifest import Manifest
from .mapping import Binding

__all__ = ["Read", "Copy", "Plan", "plan_tensor", "build_plan"]


class Read(msgspec.Struct, frozen=True, array_like=True):
    """The elements one subscriber takes from one publisher rank: box [lo, hi) (in the
    coordinates of the piece) of a staged piece of shape `shape`, `itemsize`-byte elements,
    starting at byte `offset` of that rank's staging slot. On the wire a read is its box's
    bytes, row-major and contiguous."""

    offset: int
    shape: tuple[int, ...]
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return numel(self.lo, self.hi) * self.itemsize

    @property
    def end(self) -> int:
        """One past the last byte of the whole piece in the slot (what must be staged first)."""
        return self.offset + math.prod(self.shape) * self.itemsize

    @property
    def box_shape(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    def view(self, slot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The box as a (strided) view of the piece inside `slot`, a uint8 tensor."""
        piece = slot[self.offset : self.offset + math.prod(self.shape) * self.itemsize].view(dtype).view(self.shape)
        return piece[tuple(slice(l, h) for l, h in zip(self.lo, self.hi))]


def plan_tensor(sources: Sequence[Iterable[Piece]], target: Box, first: int = 0) -> list[tuple[int, Piece, Box]]:
    """Cover `target` exactly once from the pieces that publisher ranks hold.

    `sources[r]` lists the pieces rank r holds. Ranks are tried starting at `first` (rotating),
    so replicas share the load. Returns (rank, piece, box in global coordinates), boxes
    pairwise disjoint and their union exactly `target`. Raises `SchemaError` if the ranks do
    not hold all of `target`.
    """
    remaining = [target] if numel(*target) else []
    out: list[tuple[int, Piece, Box]] = []
    n = len(sources)
    for k in range(n):
        rank = (first + k) % n
        for piece in sources[rank]:
            if not remaining:
                return out
            left: list[Box] = []
            for box in remaining:
                common = intersect(box, piece.box)
                if common is None:
                    left.append(box)
                    continue
                out.append((rank, piece, common))
                left += subtract(box, piece.box)
            remaining = left
    if remaining:
        raise SchemaError(
            f"the publishers hold no data for {sum(numel(*b) for b in remaining)} needed elements, e.g. box {remaining[0]}"
        )
    return out


@dataclass(frozen=True)
class Copy:
    """Read `read` (from rank `rank`, wire dtype `dtype`) lands in `dst`, part of `binding`."""

    rank: int
    read: Read
    dtype: torch.dtype
    binding: Binding
    dst: torch.Tensor
    recv: int
    """Byte offset of the read in the receive buffer."""


@dataclass(frozen=True)
class Plan:
    """Every copy a subscriber makes, grouped by rank; `regions[r]` is (start, nbytes) of rank
    r's reads in the receive buffer."""

    copies: tuple[Copy, ...]
    regions: tuple[tuple[int, int], ...]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.regions)

    def reads(self, rank: int) -> list[Read]:
        return [c.read for c in self.copies if c.rank == rank]

    @functools.cached_property
    def device(self) -> torch.device | None:
        """The CUDA device of the first copy into GPU memory (None: every target is on the
        host), found once per plan rather than on every apply."""
        return next((c.dst.device for c in self.copies if is_cuda(c.dst)), None)


def build_plan(manifests: Sequence[Manifest], bindings: Sequence[Binding], first: int = 0) -> Plan:
    """The plan for `bindings` against publisher ranks' `manifests` (indexed by rank).

    Replicated sources rotate over ranks by binding index plus `first` (pass the subscriber's
    TP rank so that subscribers spread too). Raises `SchemaError` if a source is missing,
    has another dtype than its target, or does not cover what the target needs.
    """
    entries: dict[str, list] = {}
    for manifest in manifests:
        for entry in manifest.entries:
            entries.setdefault(entry.name, [[] for _ in manifests])[manifest.rank].append(
                (manifest.start(entry), entry)
            )
    pending: list[tuple[int, Read, torch.dtype, Binding, Box]] = []
    for i, binding in enumerate(bindings):
        held = entries.get(binding.source)
        if held is None:
            raise SchemaError(f"{binding.target}: the publishers do not stage {binding.source!r}")
        dtypes = {e.dtype for per_rank in held for _, e in per_rank}
        if dtypes != {str(binding.view.dtype).removeprefix("torch.")}:
            raise SchemaError(
                f"{binding.target}: published as {sorted(dtypes)}, held as {binding.view.dtype}; declare a cast at the publisher"
            )
        dtype = binding.view.dtype
        starts = {}
        pieces: list[list[Piece]] = []
        for per_rank in held:
            pieces.append([])
            for start, entry in per_rank:
                for piece in entry.layout.pieces():
                    pieces[-1].append(piece)
                    starts[id(piece)] = start
        for rank, piece, box in plan_tensor(pieces, binding.box, first + i):
            read = Read(
                offset=starts[id(piece)] + piece.offset * dtype.itemsize,
                shape=piece.shape,
                lo=tuple(a - b for a, b in zip(box[0], piece.lo)),
                hi=tuple(a - b for a, b in zip(box[1], piece.lo)),
                itemsize=dtype.itemsize,
            )
            pending.append((rank, read, dtype, binding, box))
    copies: list[Copy] = []
    regions = []
    recv = 0
    for rank in range(len(manifests)):
        start = recv
        mine = [p for p in pending if p[0] == rank]
        for _, read, dtype, binding, box in mine:
            lo = tuple(a - b for a, b in zip(box[0], binding.box[0]))
            hi = tuple(a - b for a, b in zip(box[1], binding.box[0]))
            dst = binding.view[tuple(slice(l, h) for l, h in zip(lo, hi))]
            copies.append(Copy(rank, read, dtype, binding, dst, recv))
            recv += _align(read.nbytes)
        regions.append((start, recv - start))
    return Plan(tuple(copies), tuple(regions))


def _align(n: int) -> int:
    return -(-n // 64) * 64
