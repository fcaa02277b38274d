"""The ledger of rows: every partition's rows, the live storage units, the bytes each unit holds
and the next global sample index.

The parts that create or free rows (`puts`, `keys`, the scheduler's stale drops, the service's
clears) all go through one `Ledger`, so the units' byte counts that placement and intake read
always match the live rows, a new row never reuses an index, and each change is journaled once.
Freed rows are compacted out of a partition's table once they make up half of it (`table`),
at a turn of the event loop when no handler holds row numbers. The ledger keeps the tables; telling the units which rows to free (and the puts waiting for
room that there is some) belongs to its `freed` hook, which the service sets to `UnitLinks.freed`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from transfer_queue.host import give_back_freed_memory
from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import UnitInfo
from transfer_queue.wire.meta import FieldSpec
from transfer_queue.wire.sizes import arena_bytes

from .records import Freed, Placed, Record
from .table import Partition

__all__ = ["Ledger", "OnFreed", "KEEP_FREED", "all_equal", "field_sizes"]

KEEP_FREED = 8 << 20
"""Freed heap the controller keeps for its next allocations; beyond it, compaction returns it."""

OnFreed = Callable[[str, "dict[int, list[int]] | None"], None]
"""Called after rows were freed: partition name and unit id -> global indexes to free there
(None: every row of the partition, on every unit)."""


def _nobody(partition: str, rows_by_unit: dict[int, list[int]] | None) -> None:
    """Nobody to tell of freed rows (no unit links yet)."""


def field_sizes(fields: dict[str, FieldSpec], n: int, row_bytes: int, given: dict[str, int]) -> dict[str, int]:
    """Bytes per row of each of a put's `fields`, which add up to its `row_bytes` (over `n`
    rows): those its client counted (`given`, `BeginPut.field_bytes`), or for a client before
    those, `row_bytes` split by the specs: a dense field its arena share (`arena_bytes`), the
    ragged ones what is left, shared evenly; the rounding goes to the first.

    Raises:
        SchemaError: `given` does not name exactly `fields`, holds a size below 0, or does not
            add up to `row_bytes`."""
    if given:
        if given.keys() != fields.keys() or min(given.values()) < 0 or sum(given.values()) != row_bytes:
            raise SchemaError(
                f"field_bytes {given} must give each of the fields {sorted(fields)} >= 0 bytes, "
                f"{row_bytes} (row_bytes) in all"
            )
        return given
    sizes = {name: arena_bytes(spec.row_bytes * n) // n for name, spec in fields.items() if not spec.ragged}
    ragged = [name for name, spec in fields.items() if spec.ragged]
    rest = row_bytes - sum(sizes.values())
    if ragged:
        share = rest // len(ragged)
        sizes.update(dict.fromkeys(ragged, share))
        sizes[ragged[0]] += rest - share * len(ragged)
    elif sizes:
        sizes[next(iter(sizes))] += rest
    return sizes


def all_equal(values: np.ndarray | list[int]) -> bool:
    """Whether `values` (at least one) holds one value throughout: a put's rows on one unit, a
    batch's versions. The fast paths that check it skip numpy's unique and per-value masks."""
    if isinstance(values, list):
        return values.count(values[0]) == len(values)
    return bool(values[0] == values[-1] and (values == values[0]).all())


class Ledger:
    """Rows, units and their bytes; `record` journals a change."""

    def __init__(self, record: Callable[[Record], None]):
        self.partitions: dict[str, Partition] = {}
        self.units: dict[int, UnitInfo] = {}
        """Live storage units by id (retired ones are gone from here and from `unit_bytes`)."""
        self.unit_bytes: dict[int, int] = {}
        """Live unit id -> bytes of the live rows placed on it."""
        self.next_index = 0
        """The global index of the next new row: indexes are never reused, across restarts too."""
        self._record = record
        self.freed: OnFreed = _nobody
        self._compacting: set[str] = set()
        """Passes frees on to the units: set once they have links (which need the ledger first)."""

    # -- partitions ----------------------------------------------------------------------

    def partition(self, name: str) -> Partition:
        """The partition `name`, created empty if it does not exist.

        Raises:
            SchemaError: `name` is empty."""
        part = self.partitions.get(name)
        if part is None:
            if not name:
                raise SchemaError("a partition needs a non-empty name (e.g. 'train')")
            part = self.partitions[name] = Partition(name)
        return part

    def existing(self, name: str) -> Partition:
        """The partition `name`.

        Raises:
            SchemaError: there is none."""
        part = self.partitions.get(name)
        if part is None:
            raise SchemaError(f"no partition named {name!r}")
        return part

    def drop_partition(self, name: str) -> None:
        """Forget partition `name` and all its rows (the caller journals it)."""
        part = self.partitions.pop(name, None)
        if part is None:
            return
        live = np.flatnonzero(part.alive[: part.n])
        for unit_id in np.unique(part.unit[live]).tolist():
            self._uncount(unit_id, int(part.row_bytes[live][part.unit[live] == unit_id].sum()))
        self.freed(name, None)

    def restore(self, part: Partition) -> None:
        """Take in a whole partition from a journal snapshot: count its live rows' bytes on the
        units and never hand out its indexes again."""
        self.partitions[part.name] = part
        n = part.n
        live = part.alive[:n]
        for unit_id in np.unique(part.unit[:n][live]).tolist():
            if unit_id in self.unit_bytes:
                self.unit_bytes[unit_id] += int(part.row_bytes[:n][live & (part.unit[:n] == unit_id)].sum())
        if n:
            self.advance(int(part.gidx[n - 1]) + 1)

    # -- units ---------------------------------------------------------------------------

    def add_unit(self, unit: UnitInfo) -> None:
        """Place rows on `unit` from now on (a unit that registers again keeps its count)."""
        self.units[unit.unit_id] = unit
        self.unit_bytes.setdefault(unit.unit_id, 0)

    def retire_unit(self, unit_id: int) -> UnitInfo:
        """Stop placing rows on a unit that died and stop counting its bytes; returns it."""
        self.unit_bytes.pop(unit_id, None)
        return self.units.pop(unit_id)

    def room(self) -> dict[int, int]:
        """Free bytes per live unit."""
        return {u: self.units[u].capacity - used for u, used in self.unit_bytes.items()}

    # -- rows ----------------------------------------------------------------------------

    def shares(self, units: np.ndarray, row_bytes: int) -> dict[int, int]:
        """Bytes per live unit of rows placed on `units`, `row_bytes` each."""
        if len(units) and all_equal(units):  # one unit: the common case
            only = int(units[0])
            return {only: len(units) * row_bytes} if only in self.unit_bytes else {}
        ids, counts = np.unique(units, return_counts=True)
        return {int(u): int(c) * row_bytes for u, c in zip(ids, counts) if int(u) in self.unit_bytes}

    def new_rows(
        self,
        part: Partition,
        units: np.ndarray,
        sizes: dict[str, int],
        fields: dict,
        shares: dict[int, int],
        committed: bool = False,
    ) -> int:
        """New rows of `fields` on `units` (uncommitted: a put's, until its commit; committed:
        keys'), `sizes` bytes of each field per row (`field_sizes`), under fresh global indexes,
        journaled; returns the first index."""
        first = self.next_index
        self.next_index += len(units)
        self._append(part, first, units, sizes, fields, shares, committed)
        row_bytes = sum(sizes.values())
        self._record(Placed(part.name, first, units.tolist(), row_bytes, fields, committed, sizes))
        return first

    def restore_rows(self, rec: Placed) -> None:
        """Redo recorded new rows (journal replay): the same indexes, counted, not journaled."""
        units = np.asarray(rec.units, np.int64)
        part = self.partition(rec.partition)
        sizes = field_sizes(rec.fields, len(units), rec.row_bytes, rec.field_bytes)
        self._append(part, rec.first, units, sizes, rec.fields, self.shares(units, rec.row_bytes), rec.committed)
        self.advance(rec.first + len(units))

    def _append(
        self,
        part: Partition,
        first: int,
        units: np.ndarray,
        sizes: dict[str, int],
        fields: dict,
        shares: dict[int, int],
        committed: bool,
    ) -> None:
        """Register rows first.. on `units` (`shares`: their bytes per unit) and count their bytes."""
        part.add_fields(fields)
        rows = part.append(first, len(units), units, 0)
        part.hold(rows, sizes)
        part.committed[rows] = committed
        for unit_id, nbytes in shares.items():
            self.unit_bytes[unit_id] += nbytes

    def write_fields(
        self, part: Partition, rows: np.ndarray, fields: dict[str, FieldSpec], sizes: dict[str, int]
    ) -> None:
        """Existing `rows` were written `fields`, `sizes` bytes of each per row (a put with
        `meta=`, `field_sizes`): count on the rows and units what they did not hold before. A
        field a row held already (a consumer that wrote it again after its lease expired) was
        replaced on its unit: only the difference in size counts."""
        part.add_fields(fields)
        grown = part.hold(rows, sizes)
        units = part.unit[rows]
        for unit_id in np.unique(units).tolist():
            if unit_id in self.unit_bytes:  # not a retired unit
                self.unit_bytes[unit_id] = max(0, self.unit_bytes[unit_id] + int(grown[units == unit_id].sum()))

    def advance(self, next_index: int) -> None:
        """Never hand out an index below `next_index` (a replayed journal's)."""
        self.next_index = max(self.next_index, next_index)

    def free_rows(self, part: Partition, rows: np.ndarray) -> None:
        """Free `rows` (those still alive): uncount their bytes, journal it, pass it on to `freed`."""
        rows = rows[part.alive[rows]]
        if not len(rows):
            return
        part.kill(rows)
        units = part.unit[rows]
        indexes = part.gidx[rows]
        by_unit: dict[int, list[int]] = {}
        listed = indexes.tolist()
        row_bytes = part.row_bytes[rows]
        if all_equal(units):  # one unit: the common case
            by_unit[int(units[0])] = listed
            self._uncount(int(units[0]), int(row_bytes.sum()))
        else:
            for unit_id in np.unique(units).tolist():
                picked = units == unit_id
                by_unit[unit_id] = indexes[picked].tolist()
                self._uncount(unit_id, int(row_bytes[picked].sum()))
        self._record(Freed(part.name, listed))
        self.freed(part.name, by_unit)
        if part.wasteful() and part.name not in self._compacting:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a ledger on its own): the next free in one compacts
                return
            # not here: the caller may still hold row numbers; the loop runs it when no handler does
            self._compacting.add(part.name)
            loop.call_soon(self._compact, part.name)

    def _compact(self, name: str) -> None:
        """Drop a partition's freed rows and return the memory they held to the system."""
        self._compacting.discard(name)
        part = self.partitions.get(name)
        if part is not None and part.wasteful():
            part.compact()
            give_back_freed_memory(KEEP_FREED)

    def _uncount(self, unit_id: int, nbytes: int) -> None:
        if unit_id in self.unit_bytes:  # not a retired unit
            self.unit_bytes[unit_id] = max(0, self.unit_bytes[unit_id] - nbytes)
