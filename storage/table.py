"""The row index of a unit: where each (partition, field, global index) lives in the arena.

Per partition and field, a dict maps each global index to a row tuple
`(offset, nbytes, length, chunk)`: the row's bytes in the arena, its length along the ragged
dimension (0 for dense fields) and the chunk that holds it. Each insert also keeps its segment
(its indexes in write order, and how many of them still live in its chunk): a Read of exactly
one write's rows, the common case (a batch read as it was put), is that chunk as one run, found
with one list comparison. Any other Read costs a dict look-up per row and field and one pass
merging rows whose bytes are adjacent in the arena into runs, never any per-byte Python work.
Inserting new rows and freeing rows take no Python step per row either (bulk dict and set
operations), so a unit's cost per message stays small beside the round trip that carries it.

A field's `FieldSpec` is fixed while the partition holds rows of it: a reader gets only bytes
and lengths, so rows of one field written with two different dtypes or shapes could not be told
apart. The spec is forgotten when the field's last row is freed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat
from operator import itemgetter
from typing import cast

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.meta import FieldSpec

from .arena import Arena, Chunk

__all__ = ["Row", "Column", "Partition", "ReadPlan", "Table"]

Row = tuple[int, int, int, Chunk]
"""(arena offset, nbytes, ragged length or 0, chunk holding the bytes)."""

_LISTED = 10  # how many missing indexes an error message names


class Segment:
    """The rows one `insert` laid out in a chunk: their indexes in write order, how many of them
    still live there (not freed, not replaced) and their ragged lengths. A read of exactly those
    indexes, all live, is that chunk's bytes as one run, found without a step per row."""

    __slots__ = ("indexes", "live", "lengths")

    def __init__(self, indexes: list[int], lengths: list[int]):
        self.indexes = indexes
        self.live = len(indexes)
        self.lengths = lengths


class Column:
    """The rows of one field of one partition, and the segments holding them."""

    __slots__ = ("spec", "rows", "segments")

    def __init__(self, spec: FieldSpec):
        self.spec = spec
        self.rows: dict[int, Row] = {}
        self.segments: dict[Chunk, Segment] = {}

    def gone(self, chunk: Chunk, rows: int) -> None:
        """`rows` rows of `chunk` left this column (freed or replaced)."""
        seg = self.segments.get(chunk)
        if seg is not None:
            seg.live -= rows
            if seg.live <= 0:
                del self.segments[chunk]


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
        row_bytes = spec.row_bytes
        n = len(indexes)
        lens: Sequence[int]
        if lengths is None:
            sizes: Sequence[int] = [row_bytes] * n
            offsets: Iterable[int] = (
                range(chunk.offset, chunk.offset + n * row_bytes, row_bytes) if row_bytes else repeat(chunk.offset, n)
            )
            lens = [0] * n
        else:
            sizes = [k * row_bytes for k in lengths]
            offsets = accumulate(sizes[:-1], initial=chunk.offset)
            lens = list(lengths)
        chunk.refs += n
        entries = zip(indexes, zip(offsets, sizes, lens, repeat(chunk)))
        if rows.keys().isdisjoint(indexes):  # new rows of this field: no per-row Python work
            rows.update(entries)
        else:  # a retried put replaces rows: their old bytes are released
            unref = self.arena.unref
            for index, row in entries:
                old = rows.get(index)
                rows[index] = row
                if old is not None:
                    col.gone(old[3], 1)
                    unref(old[3])
        col.segments[chunk] = Segment(list(indexes), lens)
        part.held.update(indexes)

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
            run = _segment_run(col, indexes)
            if run is not None:
                seg, chunk, nbytes = run
                if col.spec.ragged:
                    plan.lengths[name] = seg.lengths
                plan.runs[name] = [(chunk.offset, nbytes)] if nbytes else []
                if nbytes:
                    plan.chunks.append([chunk])
                continue
            try:
                entries = list(map(rows.__getitem__, indexes))
            except KeyError:
                missing = [i for i in indexes if i not in rows]
                listed = ", ".join(map(str, missing[:_LISTED])) + (" ..." if len(missing) > _LISTED else "")
                raise SchemaError(
                    f"storage unit {self.unit_id} holds no row(s) [{listed}] ({len(missing)} of "
                    f"{len(indexes)} requested) of field {name!r} in partition {partition!r}"
                ) from None
            if col.spec.ragged:
                plan.lengths[name] = [e[2] for e in entries]
            plan.runs[name] = _merge_runs(entries, plan.chunks)
        return plan

    # -- freeing -------------------------------------------------------------------------

    def remove(self, partition: str, indexes: Iterable[int] | None = None) -> int:
        """Drop rows (all rows of the partition when `indexes` is None); returns rows dropped.

        Unknown partitions and indexes are ignored: freeing is idempotent.
        """
        part = self.partitions.get(partition)
        if part is None:
            return 0
        unref = self.arena.unref
        if indexes is None:
            for col in part.columns.values():
                for row in col.rows.values():
                    unref(row[3])
            del self.partitions[partition]
            return len(part.held)
        held = part.held
        present = held.intersection(indexes)
        if not present:
            return 0
        held.difference_update(present)
        for col in part.columns.values():
            pop = col.rows.pop
            popped = list(map(pop, present, repeat(None)))
            if None in popped:  # a field some of the rows lack
                popped = [row for row in popped if row is not None]
            chunks: Counter[Chunk] = Counter(map(itemgetter(3), cast("list[Row]", popped)))
            for chunk, refs in chunks.items():  # one call per chunk: a write's rows share one
                col.gone(chunk, refs)
                unref(chunk, refs)
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


def _segment_run(col: Column, indexes: Sequence[int]) -> tuple[Segment, Chunk, int] | None:
    """The segment whose live rows are exactly `indexes` in write order, with its chunk and the
    bytes of those rows, or None: a read of one write's rows (the common case) is one run."""
    if not indexes:
        return None
    row = col.rows.get(indexes[0])
    if row is None:
        return None
    chunk = row[3]
    seg = col.segments.get(chunk)
    if seg is None or seg.live != len(seg.indexes) or seg.indexes != indexes:
        return None
    last = col.rows[indexes[-1]]
    return seg, chunk, last[0] + last[1] - chunk.offset


def _merge_runs(entries: list[Row], chunks: list[list[Chunk]]) -> list[tuple[int, int]]:
    """Runs of (offset, nbytes) covering `entries` in order; empty rows contribute nothing.

    Appends, per run, the chunks it touches to `chunks` (a run crosses a chunk boundary only
    when two chunks happen to be adjacent in the arena and the first fills its aligned extent).
    """
    starts: list[int] = []
    ends: list[int] = []
    end = -1
    for offset, nbytes, _, chunk in entries:
        if nbytes == 0:
            continue
        if offset == end:
            end = ends[-1] = offset + nbytes
            run_chunks = chunks[-1]
            if run_chunks[-1] is not chunk:
                run_chunks.append(chunk)
        else:
            end = offset + nbytes
            starts.append(offset)
            ends.append(end)
            chunks.append([chunk])
    return [(s, e - s) for s, e in zip(starts, ends)]
