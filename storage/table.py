"""The row index of a unit: where each (partition, field, global index) lives in the arena.

Per partition and field, a dict maps each global index to the `Segment` holding the row: the
rows one write laid out back to back in one chunk (their indexes in write order, their ragged
lengths, how many of them still live there). A row's bytes follow from its place in its segment
(its index less the segment's first when the write's indexes are consecutive, as a put's are),
so registering a write's rows is one bulk dict update per field and freeing them one bulk pop
and count, with no Python step and no object per row. A Read of exactly one write's rows, the
common case (a batch read as it was put), is that chunk as one run, found with one list
comparison. Any other Read costs a dict look-up per row and field, then a step per row when
most rows come from another write than the row before (a random sampler's), else a step per
stretch of rows that follow each other in one write's order (a batch spanning two puts); rows
adjacent in the arena merge into runs, never any per-byte Python work.

A field's `FieldSpec` is fixed while the partition holds rows of it: a reader gets only bytes
and lengths, so rows of one field written with two different dtypes or shapes could not be told
apart. The spec is forgotten when the field's last row is freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate, compress, islice, repeat
from operator import is_not, mul
from typing import cast

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.meta import FieldSpec

from .arena import Arena, Chunk

__all__ = ["Segment", "Column", "Partition", "ReadPlan", "Table"]

_LISTED = 10  # how many missing indexes an error message names


class Segment:
    """The rows one `insert` laid out back to back in a chunk: their indexes in write order, the
    bytes of each (`row_bytes` per row or per ragged element), a ragged field's lengths with the
    arena offset of each row and of their end (`ragged`: None for a dense field), and how many of
    them still live there (not freed, not replaced). Each live row holds one reference on the
    chunk.

    A put's rows on a unit are most often consecutive global indexes in order: a row's place in
    write order is then `index - first`, with no per-row state; only the rows of other writes (new
    fields of sampled rows, keyed rows, rows spread over units) get a dict of places, made here so
    that no read pays for a whole segment's dict."""

    __slots__ = ("chunk", "indexes", "ragged", "row_bytes", "nbytes", "live", "first", "places")

    def __init__(self, chunk: Chunk, indexes: list[int], lengths: list[int] | None, row_bytes: int):
        n = len(indexes)
        self.chunk = chunk
        self.indexes = indexes
        self.ragged: tuple[list[int], list[int]] | None = None
        if lengths is None:
            self.nbytes = row_bytes * n
        else:
            bounds = list(accumulate(map(mul, lengths, repeat(row_bytes)), initial=chunk.offset))
            self.ragged = (lengths, bounds)
            self.nbytes = bounds[-1] - chunk.offset
        self.row_bytes = row_bytes
        self.live = n
        self.first = indexes[0] if n else 0
        # distinct indexes (a Write's are checked) from first to first + n - 1 in order are consecutive
        consecutive = not n or (indexes[-1] - self.first == n - 1 and indexes == sorted(indexes))
        self.places: dict[int, int] | None = None if consecutive else dict(zip(indexes, range(n)))

    def place(self, index: int) -> int:
        """Where row `index` is in write order."""
        return index - self.first if self.places is None else self.places[index]


class Column:
    """The rows of one field of one partition, each by the segment holding it."""

    __slots__ = ("spec", "rows")

    def __init__(self, spec: FieldSpec):
        self.spec = spec
        self.rows: dict[int, Segment] = {}


class Partition:
    """The columns of one partition, and the indexes at least one of them holds (for row counts)."""

    __slots__ = ("columns", "held")

    def __init__(self) -> None:
        self.columns: dict[str, Column] = {}
        self.held: set[int] = set()


class ReadPlan:
    """What a Read returns: per-field ragged lengths and arena runs, plus the chunks per run.

    `chunks[i]` lists the chunks the i-th run (counting across fields in request order)
    touches, so a zero-copy reply can hold them until ZeroMQ has sent the bytes.
    """

    __slots__ = ("lengths", "runs", "chunks")

    def __init__(self) -> None:
        self.lengths: dict[str, list[int]] = {}
        self.runs: dict[str, list[tuple[int, int]]] = {}
        self.chunks: list[list[Chunk]] = []


class Table:
    """All rows a unit holds, by partition and field; owns their references on arena chunks."""

    def __init__(self, arena: Arena, unit_id: int = 0):
        self.arena = arena
        self.unit_id = unit_id
        self.partitions: dict[str, Partition] = {}

    # -- writing -------------------------------------------------------------------------

    def check_specs(self, partition: str, fields: dict[str, FieldSpec]) -> None:
        """Raise `SchemaError` if a field already holds rows of another dtype or shape."""
        part = self.partitions.get(partition)
        if part is None:
            return
        for name, spec in fields.items():
            col = part.columns.get(name)
            if col is not None and col.spec != spec:
                raise SchemaError(
                    f"field {name!r} of partition {partition!r} holds rows of dtype {col.spec.dtype} "
                    f"and shape {list(col.spec.shape)} on storage unit {self.unit_id}; this write has "
                    f"dtype {spec.dtype} and shape {list(spec.shape)}. Write matching tensors, or free "
                    "the field's rows first"
                )

    def insert(
        self,
        partition: str,
        name: str,
        spec: FieldSpec,
        indexes: Sequence[int],
        chunk: Chunk,
        lengths: Sequence[int] | None = None,
    ) -> None:
        """Register rows `indexes` of field `name`, laid out back to back in `chunk`.

        Dense rows take `spec.row_bytes` each; ragged rows `lengths[i] * spec.row_bytes`.
        A row that already exists is replaced and its old bytes released (producers retry).
        The caller has validated sizes and specs (`check_specs`) and keeps its own chunk reference.
        """
        part = self.partitions.get(partition)
        if part is None:
            part = self.partitions[partition] = Partition()
        col = part.columns.get(name)
        if col is None:
            col = part.columns[name] = Column(spec)
        rows = col.rows
        seg = Segment(chunk, list(indexes), None if lengths is None else list(lengths), spec.row_bytes)
        chunk.refs += len(seg.indexes)
        if rows.keys().isdisjoint(seg.indexes):  # new rows of this field: no per-row Python work
            rows.update(dict.fromkeys(seg.indexes, seg))
        else:  # a retried put replaces rows: their old bytes are released
            unref = self.arena.unref
            for index in seg.indexes:
                old = rows.get(index)
                rows[index] = seg
                if old is not None:
                    old.live -= 1
                    unref(old.chunk)
        part.held.update(seg.indexes)

    # -- reading -------------------------------------------------------------------------

    def read(self, partition: str, indexes: Sequence[int], fields: Sequence[str]) -> ReadPlan:
        """Lengths and runs of `fields` for `indexes` (rows in the given order).

        Raises `SchemaError` naming the unknown partition, field or indexes.
        """
        part = self.partitions.get(partition)
        if part is None:
            raise SchemaError(f"storage unit {self.unit_id} holds no rows of partition {partition!r}")
        plan = ReadPlan()
        for name in fields:
            col = part.columns.get(name)
            if col is None:
                held = sorted(part.columns)
                raise SchemaError(
                    f"partition {partition!r} on storage unit {self.unit_id} has no field {name!r} "
                    f"(it holds {held[:20]}{' ...' if len(held) > 20 else ''})"
                )
            rows = col.rows
            seg = _whole_segment(rows, indexes)
            if seg is not None:
                if seg.ragged is not None:
                    plan.lengths[name] = seg.ragged[0]
                plan.runs[name] = [(seg.chunk.offset, seg.nbytes)] if seg.nbytes else []
                if seg.nbytes:
                    plan.chunks.append([seg.chunk])
                continue
            try:
                segs = list(map(rows.__getitem__, indexes))
            except KeyError:
                missing = [i for i in indexes if i not in rows]
                listed = ", ".join(map(str, missing[:_LISTED])) + (" ..." if len(missing) > _LISTED else "")
                raise SchemaError(
                    f"storage unit {self.unit_id} holds no row(s) [{listed}] ({len(missing)} of "
                    f"{len(indexes)} requested) of field {name!r} in partition {partition!r}"
                ) from None
            lengths: list[int] = []
            plan.runs[name] = _runs(segs, indexes, plan.chunks, lengths)
            assert len(lengths) == (len(indexes) if col.spec.ragged else 0), (
                "a field's rows are all ragged or all dense"
            )
            if col.spec.ragged:
                plan.lengths[name] = lengths
        return plan

    # -- freeing -------------------------------------------------------------------------

    def remove(self, partition: str, indexes: Iterable[int] | None = None, fields: Iterable[str] | None = None) -> int:
        """Drop rows (all rows of the partition when `indexes` is None); with `fields`, only those
        fields of the `indexes` (a column put the controller refused: its bytes and its spec,
        forgotten with the field's last row). Returns the rows (with `fields`: field rows) dropped.

        Unknown partitions, fields and indexes are ignored: freeing is idempotent.
        """
        part = self.partitions.get(partition)
        if part is None:
            return 0
        unref = self.arena.unref
        if fields is not None and indexes is not None:
            present = part.held.intersection(indexes)
            dropped = 0
            for name in fields:
                col = part.columns.get(name)
                if col is None:
                    continue
                for seg, refs in Counter(s for s in map(col.rows.pop, present, repeat(None)) if s is not None).items():
                    seg.live -= refs
                    unref(seg.chunk, refs)
                    dropped += refs
                if not col.rows:
                    del part.columns[name]
            part.held.difference_update(i for i in present if not any(i in c.rows for c in part.columns.values()))
            if not part.columns:
                del self.partitions[partition]
            return dropped
        if indexes is None:
            for col in part.columns.values():
                for seg, refs in Counter(col.rows.values()).items():
                    unref(seg.chunk, refs)
            del self.partitions[partition]
            return len(part.held)
        held = part.held
        present = held.intersection(indexes)
        if not present:
            return 0
        held.difference_update(present)
        for col in part.columns.values():
            rows = col.rows
            before = len(rows)
            found: list[Segment | None] = list(map(rows.pop, present, repeat(None)))
            if before - len(rows) == len(found):  # the field held every one of the rows
                segs = cast("list[Segment]", found)
            else:  # a field some of the rows lack leaves gaps
                segs = [seg for seg in found if seg is not None]
            counts: Iterable[tuple[Segment, int]]
            if segs and segs.count(segs[0]) == len(segs):  # the rows of one write, the common case
                counts = ((segs[0], len(segs)),)
            else:
                counts = Counter(segs).items()
            for seg, refs in counts:  # one call per segment: a write's rows share one
                seg.live -= refs
                unref(seg.chunk, refs)
        for name in [n for n, c in part.columns.items() if not c.rows]:
            del part.columns[name]
        if not part.columns:
            del self.partitions[partition]
        return len(present)

    # -- status --------------------------------------------------------------------------

    def holds(self, partition: str, indexes: Iterable[int]) -> bool:
        """Whether every one of `indexes` has at least one field here."""
        part = self.partitions.get(partition)
        return part is not None and part.held.issuperset(indexes)

    def row_counts(self) -> dict[str, int]:
        """Rows (indexes holding at least one field) per partition."""
        return {name: len(part.held) for name, part in self.partitions.items()}

    def fields(self, partition: str) -> dict[str, FieldSpec]:
        part = self.partitions.get(partition)
        return {} if part is None else {n: c.spec for n, c in part.columns.items()}


def _whole_segment(rows: dict[int, Segment], indexes: Sequence[int]) -> Segment | None:
    """The segment whose live rows are exactly `indexes` in write order, or None: a read of one
    write's rows (the common case) is its chunk as one run."""
    if not indexes:
        return None
    seg = rows.get(indexes[0])
    if seg is None or seg.live != len(seg.indexes) or seg.indexes != indexes:
        return None
    return seg


def _stretches(segs: list[Segment], indexes: Sequence[int]) -> Iterator[tuple[int, Segment, int]]:
    """(first row's index, segment, row count) of each stretch of rows `indexes` (held by `segs`)
    that follow each other in one write's order, found with one list comparison per segment
    change. Rows mostly each from another segment than the row before (a random sampler's, or
    its batch sorted) are taken one by one with no step of their own here."""
    n = len(segs)
    if not n:
        return iter(())
    changes = list(compress(range(1, n), map(is_not, islice(segs, 1, None), segs)))  # where the segment changes
    if 2 * len(changes) >= n:  # most rows from another segment than the row before: stretches save little
        return zip(indexes, segs, repeat(1))
    return _grouped(segs, indexes, changes)


def _grouped(segs: list[Segment], indexes: Sequence[int], changes: list[int]) -> Iterator[tuple[int, Segment, int]]:
    """`_stretches` of rows where some neighbours share a segment (`changes`: where it changes)."""
    for a, b in zip([0, *changes], [*changes, len(segs)]):
        seg = segs[a]
        index = indexes[a]
        lo = seg.place(index)
        if b - a == 1 or seg.indexes[lo : lo + b - a] == indexes[a:b]:
            yield index, seg, b - a
        else:  # rows of one write out of its order
            yield from zip(indexes[a:b], repeat(seg), repeat(1))


def _runs(
    segs: list[Segment], indexes: Sequence[int], chunks: list[list[Chunk]], lengths: list[int]
) -> list[tuple[int, int]]:
    """Runs of (offset, nbytes) covering rows `indexes` (held by `segs`) in order; empty rows
    contribute nothing. Stretches of rows adjacent in the arena merge into one run. Appends, per
    run, the chunks it touches to `chunks` (a run crosses a chunk boundary only when two chunks
    happen to be adjacent in the arena and the first fills its aligned extent), and each ragged
    row's length to `lengths`."""
    starts: list[int] = []
    ends: list[int] = []
    end = -1
    for index, seg, k in _stretches(segs, indexes):
        places = seg.places
        lo = index - seg.first if places is None else places[index]  # seg.place(index), without a call a row
        ragged = seg.ragged
        if ragged is None:
            start = seg.chunk.offset + lo * seg.row_bytes
            stop = start + k * seg.row_bytes
        else:
            row_lengths, bounds = ragged
            start, stop = bounds[lo], bounds[lo + k]
            if k == 1:
                lengths.append(row_lengths[lo])
            else:
                lengths += row_lengths[lo : lo + k]
        if stop == start:
            continue
        if start == end:
            end = ends[-1] = stop
            run_chunks = chunks[-1]
            if run_chunks[-1] is not seg.chunk:
                run_chunks.append(seg.chunk)
        else:
            end = stop
            starts.append(start)
            ends.append(end)
            chunks.append([seg.chunk])
    return [(s, e - s) for s, e in zip(starts, ends)]
