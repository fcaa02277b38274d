"""The controller's per-partition sample table: numpy columns over samples, no object per sample.

Rows are appended in arrival order (global indexes grow monotonically, so a binary search maps
an index to its row). Each consumer task keeps a `consumed` flag and a lease id per row, plus a
cursor below which every row is consumed or gone, so the scan for ready samples only looks at
the live window, not at the partition's whole history.

Freed rows stay in the columns until they make up half of them (and at least `_INITIAL_ROWS`);
then `compact` drops them and shrinks the columns, so the table's memory follows the live
samples, not every sample ever put. Global indexes are never reused (keys and journals name
them); only row numbers change, so nobody keeps a row number past the call that looked it up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import ExportReply, ExportRows
from transfer_queue.wire.meta import BatchMeta, FieldSpec

from .status import FieldStatus, PartitionStatus, TaskStatus

__all__ = ["Partition", "TaskState"]

_INITIAL_ROWS = 1024


@dataclass
class TaskState:
    """One consumer task's view of a partition."""

    consumed: np.ndarray
    lease: np.ndarray
    """Per row: the id of the lease holding it (> 0), 0 when none, and once consumed minus the
    id of the lease it was consumed under (0: none or unknown); see `Scheduler.ack`."""
    cursor: int = 0

    def grow(self, capacity: int) -> None:
        self.consumed = _grown(self.consumed, capacity)
        self.lease = _grown(self.lease, capacity)


def _grown(arr: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros(capacity, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out


@dataclass
class Partition:
    """Every sample of one partition: location, versions, readiness and per-task consumption."""

    name: str
    sealed: bool = False
    schema: dict[str, FieldSpec] = field(default_factory=dict)
    n: int = 0
    capacity: int = _INITIAL_ROWS
    tasks: dict[str, TaskState] = field(default_factory=dict)
    ready: dict[str, np.ndarray] = field(default_factory=dict)
    field_bytes: dict[str, np.ndarray] = field(default_factory=dict)
    """Per field, the bytes each row holds of it (0: none yet), which its `row_bytes` sums: a
    rewrite of a field replaces its bytes (`hold`), it adds none."""
    sources: list[tuple[str, str]] = field(default_factory=lambda: [("", "")])
    live: int = 0
    """Rows alive among the first `n`."""
    high: int = 0
    """One past the highest global index this partition was given: lower ones it no longer
    holds were freed and compacted away (or belong to another partition)."""

    def __post_init__(self) -> None:
        c = self.capacity
        self.gidx = np.zeros(c, np.int64)
        self.alive = np.zeros(c, bool)
        self.committed = np.zeros(c, bool)
        self.unit = np.zeros(c, np.int32)
        self.row_bytes = np.zeros(c, np.int64)
        self.v_first = np.zeros(c, np.int64)
        self.v_last = np.zeros(c, np.int64)
        self.group = np.zeros(c, np.int64)
        self.seqlen = np.zeros(c, np.int64)
        self.source = np.zeros(c, np.int32)  # index into `sources`; 0 = none
        self.source_index = np.full(c, -1, np.int64)
        self.stale_seen = np.zeros(c, bool)
        self.granted = np.zeros(c, bool)  # put under an admission grant (counted as accepted)
        self.versioned = np.zeros(c, bool)  # has a policy version; the others (prompts) are never stale

    _COLUMNS = (
        "gidx",
        "alive",
        "committed",
        "unit",
        "row_bytes",
        "v_first",
        "v_last",
        "group",
        "seqlen",
        "source",
        "source_index",
        "stale_seen",
        "granted",
        "versioned",
    )

    # -- rows --------------------------------------------------------------------------

    def append(self, first_gidx: int, n: int, units: np.ndarray, row_bytes: int) -> np.ndarray:
        """Register `n` new, not yet committed rows; returns their row numbers."""
        if self.n + n > self.capacity:
            self._grow(max(self.capacity * 2, self.n + n))
        rows = np.arange(self.n, self.n + n)
        self.gidx[rows] = np.arange(first_gidx, first_gidx + n)
        self.alive[rows] = True
        self.unit[rows] = units
        self.row_bytes[rows] = row_bytes
        self.n += n
        self.live += n
        self.high = max(self.high, first_gidx + n)
        return rows

    def loaded(self, n: int) -> None:
        """The first `n` rows were filled in directly (a checkpoint's table): count them."""
        self.n = n
        self.live = int(np.count_nonzero(self.alive[:n]))
        self.high = int(self.gidx[n - 1]) + 1 if n else 0

    def _grow(self, capacity: int) -> None:
        for name in self._COLUMNS:
            setattr(self, name, _grown(getattr(self, name), capacity))
        self.source_index[self.capacity :] = -1
        for columns in (self.ready, self.field_bytes):
            for name, arr in columns.items():
                columns[name] = _grown(arr, capacity)
        for task in self.tasks.values():
            task.grow(capacity)
        self.capacity = capacity

    def wasteful(self) -> bool:
        """Whether freed rows make up half the table (and at least `_INITIAL_ROWS`): time to `compact`."""
        return self.n - self.live >= max(_INITIAL_ROWS, self.live)

    def compact(self) -> None:
        """Drop the freed rows and shrink the columns to twice the live ones (at least
        `_INITIAL_ROWS`). Live rows keep their order and global indexes; their row numbers change,
        and each task's cursor moves with them."""
        keep = np.flatnonzero(self.alive[: self.n])
        capacity = max(_INITIAL_ROWS, 2 * len(keep))
        for name in self._COLUMNS:
            setattr(self, name, _kept(getattr(self, name), keep, capacity))
        self.source_index[len(keep) :] = -1
        for columns in (self.ready, self.field_bytes):
            for name, arr in columns.items():
                columns[name] = _kept(arr, keep, capacity)
        for task in self.tasks.values():
            task.consumed = _kept(task.consumed, keep, capacity)
            task.lease = _kept(task.lease, keep, capacity)
            task.cursor = int(np.searchsorted(keep, task.cursor))  # kept rows below the old cursor
        self.n = self.live = len(keep)
        self.capacity = capacity

    def locate(self, indexes: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row numbers of global `indexes`, and which of them this partition has (the others'
        row numbers mean nothing)."""
        idx = np.asarray(indexes, dtype=np.int64)
        rows = np.minimum(np.searchsorted(self.gidx[: self.n], idx), max(self.n - 1, 0))
        return rows, (self.n > 0) & (self.gidx[rows] == idx)

    def given(self, indexes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Row numbers of global `indexes`, each one the partition was given, and which of them
        it still has (`known`): those freed and compacted away are not, and their row numbers
        mean nothing. The two stay aligned with `indexes`.

        Raises:
            SchemaError: names up to five indexes the partition was never given (at or past
                `high`, or negative)."""
        idx = np.asarray(indexes, dtype=np.int64)
        rows, known = self.locate(idx)
        bad = ~known & ((idx >= self.high) | (idx < 0))
        if np.any(bad):
            raise SchemaError(f"partition {self.name!r} has no (live) samples with indexes {idx[bad][:5].tolist()}")
        return rows, known

    def rows_of(self, indexes: Sequence[int] | np.ndarray, *, alive: bool = True) -> np.ndarray:
        """Row numbers of global `indexes`, which must all be live samples of this partition.
        With `alive=False` they may be gone too: those freed and compacted away are left out, and
        only indexes the partition was never given are refused (see `given`).

        Raises:
            SchemaError: names up to five indexes the partition lacks."""
        if not alive:
            rows, known = self.given(indexes)
            return rows[known]
        idx = np.asarray(indexes, dtype=np.int64)
        rows, known = self.locate(idx)
        bad = ~known | ~self.alive[rows]
        if np.any(bad):
            raise SchemaError(f"partition {self.name!r} has no (live) samples with indexes {idx[bad][:5].tolist()}")
        return rows

    def run(self, first: int, n: int) -> slice | None:
        """The row numbers of global indexes `first` .. `first + n - 1` as a slice when they are
        `n` consecutive live rows (a put's rows, as placed), else None. Numpy steps through a
        slice without an index array."""
        r = int(np.searchsorted(self.gidx[: self.n], first))
        end = r + n
        if n <= 0 or end > self.n or self.gidx[r] != first or self.gidx[end - 1] != first + n - 1:
            return None  # gidx is sorted and unique: equal ends mean every index in between
        return slice(r, end) if self.alive[r:end].all() else None

    def holds(self, indexes: list[int] | np.ndarray) -> np.ndarray:
        """Mask over `indexes`: which are live samples of this partition."""
        rows, known = self.locate(indexes)
        return known & self.alive[rows]

    def kill(self, rows: np.ndarray) -> None:
        self.live -= int(np.count_nonzero(self.alive[np.unique(rows)]))
        self.alive[rows] = False
        for task in self.tasks.values():
            # a dead row is under no lease, but keeps its consumed-under mark (< 0): a late ack
            # of another lease still learns the sample went to someone else, until compaction
            task.lease[rows] = np.minimum(task.lease[rows], 0)
            self._advance(task)

    # -- fields ------------------------------------------------------------------------

    def check_schema(self, fields: dict[str, FieldSpec]) -> None:
        """Refuse fields whose dtype or per-sample shape contradicts what the partition holds."""
        for name, spec in fields.items():
            known = self.schema.get(name)
            if known is not None and known != spec:
                raise SchemaError(
                    f"field {name!r} of partition {self.name!r} is {_show(known)}, got {_show(spec)}; "
                    "every put of a field must keep its dtype and per-sample shape "
                    "(use a nested jagged tensor for variable lengths)"
                )

    def add_fields(self, fields: dict[str, FieldSpec]) -> None:
        for name, spec in fields.items():
            if name not in self.schema:
                self.schema[name] = spec
                self.ready[name] = np.zeros(self.capacity, bool)
                self.field_bytes[name] = np.zeros(self.capacity, np.int64)

    def hold(self, rows: np.ndarray | slice, sizes: dict[str, int]) -> np.ndarray:
        """`rows` now hold each field of `sizes` at that many bytes per row (a field they held
        before is replaced): update their `field_bytes` and `row_bytes`; returns how much each
        row grew (below 0 where a replaced ragged field shrank)."""
        grown = np.zeros(len(self.gidx[rows]), np.int64)
        for name, size in sizes.items():
            held = self.field_bytes[name]
            grown += size - held[rows]
            held[rows] = size
        self.row_bytes[rows] += grown
        return grown

    def mark_ready(self, rows: np.ndarray | slice, fields: list[str]) -> None:
        for name in fields:
            self.ready[name][rows] = True

    # -- status ------------------------------------------------------------------------

    def status(self) -> PartitionStatus:
        """Counts over the live samples: committed, ready per field, bytes, per-task progress."""
        n = self.n
        alive = self.alive[:n]
        committed = alive & self.committed[:n]
        tasks = {}
        for name, task in self.tasks.items():
            consumed = task.consumed[:n] & alive
            leased = (task.lease[:n] != 0) & alive & ~consumed
            tasks[name] = TaskStatus(
                consumed=int(np.count_nonzero(consumed)),
                leased=int(np.count_nonzero(leased)),
                pending=int(np.count_nonzero(committed & ~consumed & ~leased)),
            )
        return PartitionStatus(
            samples=int(np.count_nonzero(alive)),
            committed=int(np.count_nonzero(committed)),
            sealed=self.sealed,
            fields={f: FieldStatus(s.dtype, list(s.shape)) for f, s in self.schema.items()},
            ready={f: int(np.count_nonzero(r[:n] & alive)) for f, r in self.ready.items()},
            bytes=int(self.row_bytes[:n][alive].sum()),
            tasks=tasks,
        )

    # -- tasks -------------------------------------------------------------------------

    def export(self) -> ExportReply:
        """What a checkpoint needs of this partition: its committed samples grouped by the fields
        they have ready, their facts, each task's consumed ones (see `ExportReply`)."""
        rows = np.flatnonzero(self.alive[: self.n] & self.committed[: self.n])
        names = list(self.schema)
        key = np.zeros(len(rows), np.int64)
        for bit, name in enumerate(names):
            key |= self.ready[name][rows].astype(np.int64) << bit
        batches, details = [], []
        for value in np.unique(key).tolist():
            picked = rows[key == value]
            fields = {name: self.schema[name] for bit, name in enumerate(names) if value >> bit & 1}
            batches.append(
                BatchMeta(
                    partition=self.name,
                    indexes=self.gidx[picked].tolist(),
                    policy_versions=self.v_first[picked].tolist(),
                    version_last=self.v_last[picked].tolist(),
                    groups=self.group[picked].tolist(),
                    units=self.unit[picked].tolist(),
                    fields=fields,
                )
            )
            details.append(
                ExportRows(
                    self.versioned[picked].tolist(),
                    (self.source[picked].astype(np.int64) - 1).tolist(),
                    self.source_index[picked].tolist(),
                )
            )
        consumed = {name: self.gidx[rows[task.consumed[rows]]].tolist() for name, task in self.tasks.items()}
        return ExportReply(batches, consumed, self.sealed, details, list(self.sources[1:]))

    def task(self, name: str) -> TaskState:
        state = self.tasks.get(name)
        if state is None:
            state = self.tasks[name] = TaskState(np.zeros(self.capacity, bool), np.zeros(self.capacity, np.int64))
        return state

    def window(self, task: TaskState) -> slice:
        return slice(task.cursor, self.n)

    def available(self, task: TaskState, fields: list[str]) -> np.ndarray | None:
        """Mask over the task's window: live, committed rows with `fields` ready, not consumed or
        leased by the task. None if a field is unknown to the partition (nothing can be ready)."""
        w = self.window(task)
        mask = self.alive[w] & self.committed[w] & ~task.consumed[w] & (task.lease[w] == 0)
        for name in fields:
            ready = self.ready.get(name)
            if ready is None:
                return None
            mask &= ready[w]
        return mask

    def outstanding(self, task: TaskState) -> int:
        """Live rows the task has not consumed yet (ready, leased or still being written)."""
        w = self.window(task)
        return int(np.count_nonzero(self.alive[w] & ~task.consumed[w]))

    def leased(self, rows: np.ndarray) -> np.ndarray:
        """Mask over `rows`: which some task holds under a lease now."""
        mask = np.zeros(len(rows), bool)
        for task in self.tasks.values():
            mask |= task.lease[rows] > 0
        return mask

    def consume(self, task: TaskState, rows: np.ndarray) -> None:
        task.consumed[rows] = True
        task.lease[rows] = 0
        self._advance(task)

    def _advance(self, task: TaskState) -> None:
        w = self.window(task)
        done = task.consumed[w] | ~self.alive[w]
        pending = np.flatnonzero(~done)
        task.cursor += int(pending[0]) if len(pending) else int(done.size)


def _kept(arr: np.ndarray, keep: np.ndarray, capacity: int) -> np.ndarray:
    out = np.zeros(capacity, dtype=arr.dtype)
    out[: len(keep)] = arr[keep]
    return out


def _show(spec: FieldSpec) -> str:
    dims = ",".join("*" if d < 0 else str(d) for d in spec.shape)
    return f"{spec.dtype}[{dims}]"
