"""The controller's journal: an append-only file of what changed, so a restarted controller
loses no acked put.

Each change to the sample tables is appended as one msgpack record (a tagged msgspec struct,
never pickle) behind a 4-byte little-endian length, written with `os.write` *before* the request
is answered: a controller process that dies (SIGKILL, OOM) after acking a put finds it in the
file. The file is `fsync`ed by a loop timer at most once a second when something was written,
so a machine crash loses at most the last second; a process crash loses nothing acked.

On start the controller replays the file (`replay`): storage units (which keep serving while
the controller is down, and are pinged and retired as usual if they died too), placed and
committed rows, readiness of every field, per-task consumption, seals, cleared partitions, the
keys and tags of the TransferQueue face, the version and the next sample index. A torn last
record (the process died mid-write) is cut off. Not journaled, like a checkpoint: leases (leased
samples are delivered again), admission grants (producers acquire again), parked requests and
stale-requeue marks.

Growth is bounded: when the file exceeds twice its size after the last compaction (and at least
`_COMPACT_BYTES`), it is rewritten as one snapshot of the live state (`Table` records) into a
temporary file that is fsynced and renamed over the journal.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Union

import msgspec
import numpy as np

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import CommitPut, UnitInfo
from transfer_queue.wire.meta import FieldSpec

from .table import Partition

if TYPE_CHECKING:
    from .service import Controller

__all__ = ["Journal"]

_LEN = struct.Struct("<I")
_COMPACT_BYTES = 16 << 20
_FSYNC_EVERY = 1.0
_CHECK_EVERY = 1024  # records between looks at the file's size


class _Rec(msgspec.Struct, frozen=True, tag_field="rec"):
    pass


class Header(_Rec, tag="header"):
    cluster_id: str
    next_index: int = 0


class Unit(_Rec, tag="unit"):
    info: UnitInfo


class Retired(_Rec, tag="retired"):
    unit_id: int


class Placed(_Rec, tag="placed"):
    """New rows first..first+n-1 on `units`: a BeginPut's (committed later) or keys' (committed)."""

    partition: str
    first: int
    units: list[int]
    row_bytes: int
    fields: dict[str, FieldSpec]
    committed: bool = False


class Committed(_Rec, tag="committed"):
    put: CommitPut


class Freed(_Rec, tag="freed"):
    partition: str
    indexes: list[int]


class Acked(_Rec, tag="acked"):
    partition: str
    task: str
    indexes: list[int]


class Sealed(_Rec, tag="sealed"):
    partition: str


class Dropped(_Rec, tag="dropped"):
    partition: str


class Keyed(_Rec, tag="keyed"):
    """TransferQueue keys given to the rows at global `indexes` (their rows are `Placed`)."""

    partition: str
    keys: list[str]
    indexes: list[int]


class Tagged(_Rec, tag="tagged"):
    """Tags merged into `keys`' tags (dict update), one per key."""

    partition: str
    keys: list[str]
    tags: list[dict[str, Any]]


class Version(_Rec, tag="version"):
    version: int


class Table(_Rec, tag="table"):
    """One partition's live rows, as a compaction writes them."""

    name: str
    sealed: bool
    schema: dict[str, FieldSpec]
    sources: list[tuple[str, str]]
    columns: dict[str, list[int]]
    """Partition column name -> its values over the live rows (booleans as 0/1)."""
    ready: dict[str, list[int]]
    """Field -> 0/1 per live row."""
    consumed: dict[str, list[int]]
    """Task -> 0/1 per live row."""


Record = Union[Header, Unit, Retired, Placed, Committed, Freed, Acked, Sealed, Dropped, Keyed, Tagged, Version, Table]


class Journal:
    """Appends records to `path` and replays them into a controller."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Record)
        self._fd = -1
        self._dirty = False
        self._syncer: asyncio.TimerHandle | None = None
        self._compacted = 0
        self.replaying = False
        self.records = 0
        self._ctl: Controller | None = None

    # -- writing -------------------------------------------------------------------------

    def append(self, rec: Record) -> None:
        """Write `rec` now (before the request it records is answered). No-op while replaying."""
        if self.replaying or self._fd < 0:
            return
        body = self._encoder.encode(rec)
        os.write(self._fd, _LEN.pack(len(body)) + body)
        self.records += 1
        if self.records % _CHECK_EVERY == 0 and self._ctl is not None:
            self.maybe_compact(self._ctl)
        if not self._dirty:
            self._dirty = True
            self._syncer = asyncio.get_running_loop().call_later(_FSYNC_EVERY, self._sync)

    def _sync(self) -> None:
        self._syncer = None
        if self._fd >= 0 and self._dirty:
            os.fsync(self._fd)
        self._dirty = False

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.cancel()
        if self._fd >= 0:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1

    def maybe_compact(self, ctl: Controller) -> None:
        """Rewrite the journal as a snapshot of `ctl` once it has grown enough."""
        if self._fd < 0:
            return
        size = os.fstat(self._fd).st_size
        if size < max(_COMPACT_BYTES, 2 * self._compacted):
            return
        self._rewrite(ctl)

    def _rewrite(self, ctl: Controller) -> None:
        tmp = self.path + ".compacting"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for rec in _snapshot(ctl):
                body = self._encoder.encode(rec)
                os.write(fd, _LEN.pack(len(body)) + body)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = fd
        os.lseek(fd, 0, os.SEEK_END)
        self._compacted = os.fstat(fd).st_size
        self._dirty = False

    # -- replay --------------------------------------------------------------------------

    def open(self, ctl: Controller) -> int:
        """Replay the journal into `ctl` (a fresh controller), then compact it and keep
        appending. Returns the number of records replayed."""
        n = 0
        if os.path.exists(self.path):
            self.replaying = True
            try:
                for rec in self._read():
                    _apply(ctl, rec)
                    n += 1
            finally:
                self.replaying = False
            _finish(ctl)
        self._rewrite(ctl)  # also creates the file, and drops a torn tail
        self._ctl = ctl
        return n

    def _read(self) -> Iterator[Record]:
        with open(self.path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _LEN.size <= len(data):
            (size,) = _LEN.unpack_from(data, pos)
            end = pos + _LEN.size + size
            if end > len(data):
                return  # torn last record: the process died mid-write, before answering
            try:
                yield self._decoder.decode(data[pos + _LEN.size : end])
            except msgspec.DecodeError as exc:
                raise SchemaError(f"controller journal {self.path} is corrupt at byte {pos}: {exc}") from None
            pos = end


def _apply(ctl: Controller, rec: Record) -> None:
    """Redo one recorded change through the controller's own code paths."""
    if isinstance(rec, Header):
        ctl.cluster_id = rec.cluster_id
        ctl._next_index = max(ctl._next_index, rec.next_index)
    elif isinstance(rec, Unit):
        ctl.links.add(rec.info)
    elif isinstance(rec, Retired):
        if rec.unit_id in ctl.units:
            ctl.links.retire(rec.unit_id)
    elif isinstance(rec, Placed):
        part = ctl.partition(rec.partition)
        units = np.asarray(rec.units, np.int64)
        ctl._append_rows(
            part, rec.first, units, rec.row_bytes, rec.fields, ctl.shares(units, rec.row_bytes), rec.committed
        )
        ctl._next_index = max(ctl._next_index, rec.first + len(rec.units))
    elif isinstance(rec, Committed):
        ctl.puts.apply(rec.put)
    elif isinstance(rec, Freed):
        part = ctl.partitions.get(rec.partition)
        if part is not None:
            ctl.free_rows(part, part.rows_of(rec.indexes, alive=False))
    elif isinstance(rec, Acked):
        part = ctl.partitions.get(rec.partition)
        if part is not None:
            ctl.scheduler.ack(part, rec.task, rec.indexes)
    elif isinstance(rec, Sealed):
        ctl.partition(rec.partition).sealed = True
    elif isinstance(rec, Dropped):
        ctl._drop_partition(rec.partition)
    elif isinstance(rec, Keyed):
        ctl.keys.restore(rec.partition, rec.keys, rec.indexes)
    elif isinstance(rec, Tagged):
        ctl.keys.tag(rec.partition, rec.keys, rec.tags)
    elif isinstance(rec, Version):
        ctl.clock.set(max(rec.version, ctl.clock.current))
    elif isinstance(rec, Table):
        _restore_table(ctl, rec)


def _finish(ctl: Controller) -> None:
    """Rows placed but never committed belong to puts that died with the old controller: free
    them (and their bytes on the units)."""
    for part in ctl.partitions.values():
        rows = np.flatnonzero(part.alive[: part.n] & ~part.committed[: part.n])
        if len(rows):
            ctl.free_rows(part, rows)


def _snapshot(ctl: Controller) -> Iterator[Record]:
    yield Header(ctl.cluster_id, ctl._next_index)
    for unit_id in sorted(ctl.units):
        yield Unit(ctl.units[unit_id])
    yield Version(ctl.clock.current)
    for part in ctl.partitions.values():
        rows = np.flatnonzero(part.alive[: part.n])
        yield Table(
            name=part.name,
            sealed=part.sealed,
            schema=dict(part.schema),
            sources=list(part.sources),
            columns={name: getattr(part, name)[rows].astype(np.int64).tolist() for name in Partition._COLUMNS},
            ready={name: arr[rows].astype(np.int64).tolist() for name, arr in part.ready.items()},
            consumed={name: task.consumed[rows].astype(np.int64).tolist() for name, task in part.tasks.items()},
        )
    for name, index in ctl.keys.live().items():
        keys = index.live_keys()
        yield Keyed(name, keys, [index.index[k] for k in keys])
        tagged = [k for k in keys if index.tags[k]]
        if tagged:
            yield Tagged(name, tagged, [index.tags[k] for k in tagged])


def _restore_table(ctl: Controller, rec: Table) -> None:
    part = ctl.partitions[rec.name] = Partition(rec.name, sealed=rec.sealed, sources=[tuple(s) for s in rec.sources])
    n = len(rec.columns["gidx"])
    part.add_fields(rec.schema)
    part._grow(max(part.capacity, n))
    part.n = n
    for name, values in rec.columns.items():
        column = getattr(part, name)
        column[:n] = np.asarray(values, dtype=column.dtype)
    for name, values in rec.ready.items():
        part.ready[name][:n] = np.asarray(values, bool)
    for name, values in rec.consumed.items():
        task = part.task(name)
        part.consume(task, np.flatnonzero(np.asarray(values, bool)))
    live = part.alive[:n]
    for unit_id in np.unique(part.unit[:n][live]).tolist():
        if unit_id in ctl.unit_bytes:
            ctl.unit_bytes[unit_id] += int(part.row_bytes[:n][live & (part.unit[:n] == unit_id)].sum())
    if n:
        ctl._next_index = max(ctl._next_index, int(part.gidx[n - 1]) + 1)
