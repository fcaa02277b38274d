"""Boxes and layouts: which elements of a global tensor a local tensor holds.

Every tensor has one *global* shape. A local tensor (a trainer's shard, or the slice an
inference rank needs) is described by a `Layout`: an optional slice along one dim (tensor
parallelism, FSDP2's dim-0 shards; a fused tensor's TP shard is one dim-0 slice per part, since
its global tensor is its parts concatenated, [q; k; v], and TP splits each part) followed by an
optional flat range of those slices (FSDP1's flat shards). A layout decomposes into `Piece`s: boxes in global coordinates whose elements are
one contiguous row-major run of the local tensor. `intersect` and `subtract` are the box
arithmetic the reshard planner (`plan.py`) is built from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

from transfer_queue import SchemaError

__all__ = ["Box", "Layout", "Piece", "intersect", "subtract", "flat_boxes", "numel"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(lo, hi): the elements with lo[d] <= index[d] < hi[d] in every dim d."""


def numel(lo: Sequence[int], hi: Sequence[int]) -> int:
    return math.prod(h - l for l, h in zip(lo, hi))


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of `a` and `b`, or None when they do not overlap."""
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    return None if any(l >= h for l, h in zip(lo, hi)) else (lo, hi)


def subtract(a: Box, b: Box) -> list[Box]:
    """`a` minus `b` as at most 2·ndim disjoint boxes."""
    if intersect(a, b) is None:
        return [a]
    out: list[Box] = []
    lo, hi = list(a[0]), list(a[1])
    for d in range(len(lo)):
        if lo[d] < b[0][d]:
            out.append((tuple(lo[:d]) + (lo[d],) + tuple(lo[d + 1 :]), tuple(hi[:d]) + (b[0][d],) + tuple(hi[d + 1 :])))
        if b[1][d] < hi[d]:
            out.append((tuple(lo[:d]) + (b[1][d],) + tuple(lo[d + 1 :]), tuple(hi[:d]) + (hi[d],) + tuple(hi[d + 1 :])))
        lo[d], hi[d] = max(lo[d], b[0][d]), min(hi[d], b[1][d])
    return out


def flat_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering the row-major flat range [start, stop) of `shape`, in order.

    Each box is itself a contiguous run of the flat order, so consecutive boxes tile the range.
    At most 2·ndim - 1 boxes.
    """
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)

    def row(r: int, a: int, b: int) -> list[Box]:
        return [((r, *lo), (r + 1, *hi)) for lo, hi in flat_boxes(shape[1:], a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out: list[Box] = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * (len(shape) - 1)), (r1, *shape[1:])))
    if c1:
        out += row(r1, 0, c1)
    return out


class Piece(msgspec.Struct, frozen=True, array_like=True):
    """A box of the global tensor stored as one contiguous row-major run of a local tensor,
    starting at element `offset` of that local tensor."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    offset: int

    @property
    def box(self) -> Box:
        return (self.lo, self.hi)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(h - l for l, h in zip(self.lo, self.hi))

    @property
    def numel(self) -> int:
        return numel(self.lo, self.hi)


class Layout(msgspec.Struct, frozen=True, array_like=True):
    """Which elements of a global tensor of `shape` a local tensor holds, in its own order.

    `dim >= 0`: the local tensor is the slices `spans` ([start, stop), then `more`) of
    dimension `dim`, concatenated along it: one slice for a tensor-parallel shard, one per part
    for the TP shard of a fused tensor (dim 0 only). `flat_stop >= 0`: of that, the local
    tensor holds only the flat row-major range [flat_start, flat_stop) as a 1-D run (FSDP1's
    flat shards). `parts`: the dim-0 sizes of the tensors a fused tensor concatenates (q, k,
    v), () for any other. `parts` and `more` come last, so that peers of a release before them
    decode a layout without them (msgspec ignores trailing array items).
    """

    shape: tuple[int, ...]
    dim: int = -1
    start: int = 0
    stop: int = 0
    flat_start: int = 0
    flat_stop: int = -1
    parts: tuple[int, ...] = ()
    more: tuple[tuple[int, int], ...] = ()
    """The slices after [start, stop) (a fused tensor's TP shard: one per further part)."""

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The slices of dimension `dim`, in local order (none when `dim` < 0)."""
        return ((self.start, self.stop), *self.more) if self.dim >= 0 else ()

    @classmethod
    def full(cls, shape: Sequence[int], parts: Sequence[int] = ()) -> Layout:
        """The whole tensor (a replica); `parts` as for `tp`."""
        return cls(tuple(shape), parts=tuple(parts))

    @classmethod
    def tp(cls, shape: Sequence[int], dim: int, rank: int, size: int, parts: Sequence[int] = ()) -> Layout:
        """Rank `rank` of `size` along `dim`, split like `torch.chunk` (the last chunk may be
        short); 1-D and 0-D tensors are not split by a `dim` they lack (they stay replicated).

        A fused tensor (`parts`: the dim-0 sizes of what it concatenates) split along dim 0 is
        split part by part, as vLLM's `QKVParallelLinear` and Megatron do: the rank holds its
        chunk of each part, concatenated. Raises `SchemaError` if `parts` do not add up to
        dim 0 of `shape`.
        """
        shape, parts = tuple(shape), tuple(parts)
        if parts and (not shape or sum(parts) != shape[0]):
            raise SchemaError(f"parts {parts} do not add up to dim 0 of shape {shape}")
        if size == 1 or dim >= len(shape):
            return cls(shape, parts=parts)
        blocks = parts if parts and dim == 0 else (shape[dim],)
        spans = []
        origin = 0
        for n in blocks:
            chunk = -(-n // size)
            start = min(rank * chunk, n)
            spans.append((origin + start, origin + min(start + chunk, n)))
            origin += n
        (start, stop), *more = spans
        return cls(shape, dim, start, stop, parts=parts, more=tuple(more))

    def flat_shard(self, rank: int, size: int) -> Layout:
        """Rank `rank` of `size` equal flat shards of this layout (FSDP1: padded, so the last
        ranks may hold fewer elements or none)."""
        total = self.box_numel
        chunk = -(-total // size)
        start = min(rank * chunk, total)
        return msgspec.structs.replace(self, flat_start=start, flat_stop=min(start + chunk, total))

    @property
    def boxes(self) -> list[Box]:
        """The boxes of the dim slices, before any flat range, in local order."""
        if self.dim < 0:
            return [((0,) * len(self.shape), self.shape)]
        out = []
        for start, stop in self.spans:
            lo, hi = [0] * len(self.shape), list(self.shape)
            lo[self.dim], hi[self.dim] = start, stop
            out.append((tuple(lo), tuple(hi)))
        return out

    @property
    def box(self) -> Box:
        """The box of the dim slice of a layout with one (not a fused tensor's TP shard)."""
        boxes = self.boxes
        if len(boxes) != 1:
            raise ValueError(f"layout {self} holds {len(boxes)} boxes, not one")
        return boxes[0]

    @property
    def box_numel(self) -> int:
        """Elements of the dim slices, before any flat range."""
        return sum(numel(*b) for b in self.boxes)

    @property
    def numel(self) -> int:
        """Elements the local tensor holds."""
        if self.flat_stop >= 0:
            return self.flat_stop - self.flat_start
        return self.box_numel

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the local tensor: the dim slices concatenated, or 1-D for a flat shard."""
        if self.flat_stop >= 0:
            return (self.numel,)
        if self.dim < 0:
            return self.shape
        return tuple(sum(b - a for a, b in self.spans) if d == self.dim else n for d, n in enumerate(self.shape))

    def check(self) -> None:
        """Raise `SchemaError` unless the slices and flat range lie inside the tensor, slices
        of a dim other than 0 are one, and `parts` add up to dim 0."""
        ndim = len(self.shape)
        if self.dim >= ndim or (
            self.dim >= 0
            and (
                not self.spans
                or (len(self.spans) > 1 and self.dim != 0)
                or not all(0 <= a <= b <= self.shape[self.dim] for a, b in self.spans)
            )
        ):
            raise SchemaError(f"layout {self} slices outside the tensor, or several slices of a dim other than 0")
        if self.parts and (not ndim or sum(self.parts) != self.shape[0]):
            raise SchemaError(f"layout {self} has parts that do not add up to dim 0")
        if self.flat_stop >= 0 and not 0 <= self.flat_start <= self.flat_stop <= self.box_numel:
            raise SchemaError(f"layout {self} has a flat range outside its slice")

    def pieces(self) -> list[Piece]:
        """The local tensor as contiguous boxes in global coordinates, in local order."""
        out = []
        offset = 0  # of the next piece in the local tensor
        base = 0  # of the current box in the dim slices, before any flat range
        for lo, hi in self.boxes:
            n = numel(lo, hi)
            if self.flat_stop < 0:
                runs = [((0,) * len(lo), tuple(h - l for l, h in zip(lo, hi)))] if n else []
            else:
                start, stop = max(self.flat_start - base, 0), min(self.flat_stop - base, n)
                runs = flat_boxes([h - l for l, h in zip(lo, hi)], start, stop)
            for blo, bhi in runs:
                glo = tuple(a + b for a, b in zip(blo, lo))
                ghi = tuple(a + b for a, b in zip(bhi, lo))
                out.append(Piece(glo, ghi, offset))
                offset += numel(glo, ghi)
            base += n
        return out
