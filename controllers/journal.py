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
from dataclasses import dataclass

import msgspec
import numpy as np

from transfer_queue.wire.errors import SchemaError

from .keys import KeyService
from .ledger import Ledger
from .puts import Puts
from .records import (
    Acked,
    Committed,
    Dropped,
    Freed,
    Header,
    Keyed,
    Placed,
    Record,
    Retired,
    Sealed,
    Table,
    Tagged,
    Unit,
    Version,
)
from .scheduling import Scheduler
from .table import Partition
from .units import UnitLinks
from .versions import VersionClock

__all__ = ["Journal", "Recorded"]

_LEN = struct.Struct("<I")
_COMPACT_BYTES = 16 << 20
_FSYNC_EVERY = 1.0
_CHECK_EVERY = 1024  # records between looks at the file's size


@dataclass
class Recorded:
    """The parts whose changes the journal records; it replays each record through the public
    methods of the part that made it, and snapshots their live state."""

    ledger: Ledger
    links: UnitLinks
    puts: Puts
    keys: KeyService
    scheduler: Scheduler
    clock: VersionClock


class Journal:
    """Appends records to `path` and replays them into the parts of a fresh controller."""

    def __init__(self, path: str | os.PathLike, cluster_id: str):
        self.path = os.fspath(path)
        self.cluster_id = cluster_id
        """The cluster's id: the recorded one once `open` replayed a journal."""
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Record)
        self._fd = -1
        self._dirty = False
        self._syncer: asyncio.TimerHandle | None = None
        self._compacted = 0
        self.replaying = False
        self.records = 0
        self._parts: Recorded | None = None

    # -- writing -------------------------------------------------------------------------

    def append(self, rec: Record) -> None:
        """Write `rec` now (before the request it records is answered). No-op while replaying."""
        if self.replaying or self._fd < 0:
            return
        body = self._encoder.encode(rec)
        os.write(self._fd, _LEN.pack(len(body)) + body)
        self.records += 1
        if self.records % _CHECK_EVERY == 0:
            self.maybe_compact()
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

    def maybe_compact(self) -> None:
        """Rewrite the journal as a snapshot of the parts once it has grown enough."""
        if self._fd < 0 or self._parts is None:
            return
        size = os.fstat(self._fd).st_size
        if size < max(_COMPACT_BYTES, 2 * self._compacted):
            return
        self._rewrite(self._parts)

    def _rewrite(self, parts: Recorded) -> None:
        tmp = self.path + ".compacting"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for rec in self._snapshot(parts):
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

    def open(self, parts: Recorded) -> int:
        """Replay the journal into `parts` (a fresh controller's), then compact it and keep
        appending. Returns the number of records replayed.

        Raises:
            SchemaError: a record in the middle of the file is corrupt."""
        n = 0
        if os.path.exists(self.path):
            self.replaying = True
            try:
                for rec in self._read():
                    self._apply(parts, rec)
                    n += 1
            finally:
                self.replaying = False
            _finish(parts.ledger)
        self._rewrite(parts)  # also creates the file, and drops a torn tail
        self._parts = parts
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

    def _apply(self, parts: Recorded, rec: Record) -> None:
        """Redo one recorded change through the public methods of the part that made it."""
        ledger = parts.ledger
        if isinstance(rec, Header):
            self.cluster_id = rec.cluster_id
            ledger.advance(rec.next_index)
        elif isinstance(rec, Unit):
            parts.links.add(rec.info)
        elif isinstance(rec, Retired):
            if rec.unit_id in ledger.units:
                parts.links.retire(rec.unit_id)
        elif isinstance(rec, Placed):
            ledger.restore_rows(rec)
        elif isinstance(rec, Committed):
            parts.puts.apply(rec.put)
        elif isinstance(rec, Freed):
            part = ledger.partitions.get(rec.partition)
            if part is not None:
                ledger.free_rows(part, part.rows_of(rec.indexes, alive=False))
                if part.wasteful():  # a long journal replays in the memory of its live rows
                    part.compact()
        elif isinstance(rec, Acked):
            part = ledger.partitions.get(rec.partition)
            if part is not None:
                parts.scheduler.ack(part, rec.task, rec.indexes)
        elif isinstance(rec, Sealed):
            ledger.partition(rec.partition).sealed = True
        elif isinstance(rec, Dropped):
            parts.scheduler.forget_partition(rec.partition)
            ledger.drop_partition(rec.partition)
        elif isinstance(rec, Keyed):
            parts.keys.restore(rec.partition, rec.keys, rec.indexes)
        elif isinstance(rec, Tagged):
            parts.keys.tag(rec.partition, rec.keys, rec.tags)
        elif isinstance(rec, Version):
            parts.clock.set(max(rec.version, parts.clock.current))
        elif isinstance(rec, Table):
            ledger.restore(_partition(rec))

    def _snapshot(self, parts: Recorded) -> Iterator[Record]:
        ledger = parts.ledger
        yield Header(self.cluster_id, ledger.next_index)
        for unit_id in sorted(ledger.units):
            yield Unit(ledger.units[unit_id])
        yield Version(parts.clock.current)
        for part in ledger.partitions.values():
            rows = np.flatnonzero(part.alive[: part.n])
            yield Table(
                name=part.name,
                sealed=part.sealed,
                schema=dict(part.schema),
                sources=list(part.sources),
                columns={name: getattr(part, name)[rows].astype(np.int64).tolist() for name in Partition._COLUMNS},
                ready={name: arr[rows].astype(np.int64).tolist() for name, arr in part.ready.items()},
                consumed={name: task.consumed[rows].astype(np.int64).tolist() for name, task in part.tasks.items()},
                field_bytes={name: arr[rows].tolist() for name, arr in part.field_bytes.items()},
            )
        for name, index in parts.keys.live().items():
            keys = index.live_keys()
            yield Keyed(name, keys, [index.index[k] for k in keys])
            tagged = [k for k in keys if index.tags[k]]
            if tagged:
                yield Tagged(name, tagged, [index.tags[k] for k in tagged])


def _finish(ledger: Ledger) -> None:
    """Rows placed but never committed belong to puts that died with the old controller: free
    them (and their bytes on the units)."""
    for part in ledger.partitions.values():
        rows = np.flatnonzero(part.alive[: part.n] & ~part.committed[: part.n])
        if len(rows):
            ledger.free_rows(part, rows)


def _partition(rec: Table) -> Partition:
    """The partition a snapshot's `Table` record holds."""
    part = Partition(rec.name, sealed=rec.sealed, sources=list(rec.sources))
    n = len(rec.columns["gidx"])
    part.add_fields(rec.schema)
    part._grow(max(part.capacity, n))
    for name, values in rec.columns.items():
        column = getattr(part, name)
        column[:n] = np.asarray(values, dtype=column.dtype)
    part.loaded(n)
    for name, values in rec.ready.items():
        part.ready[name][:n] = np.asarray(values, bool)
    for name, values in rec.field_bytes.items():
        part.field_bytes[name][:n] = values
    if not rec.field_bytes:  # written before field bytes were
        _split_row_bytes(part, n)
    for name, values in rec.consumed.items():
        task = part.task(name)
        part.consume(task, np.flatnonzero(np.asarray(values, bool)))
    return part


def _split_row_bytes(part: Partition, n: int) -> None:
    """Each row's bytes per field, for a snapshot written before they were journaled: its
    `row_bytes` split over the fields it holds (`ready`) as `ledger.field_sizes` splits an older
    client's put: each dense field its size, the ragged ones the rest, evenly, the rounding to
    the first. (Left at 0, the first write of a column again after an upgrade would count its
    bytes in full, as if the rows held none of them.) Rows are split by the fields they hold:
    numpy's unique of the ready columns, once per restore."""
    names = list(part.schema)
    if not names or not n:
        return
    patterns, group = np.unique(np.stack([part.ready[name][:n] for name in names]), axis=1, return_inverse=True)
    group = group.ravel()
    for g, pattern in enumerate(patterns.T.tolist()):
        rows = np.flatnonzero(group == g)
        held = [name for name, ready in zip(names, pattern) if ready]
        dense = [name for name in held if not part.schema[name].ragged]
        rest = part.row_bytes[rows].copy()
        for name in dense:
            part.field_bytes[name][rows] = size = np.minimum(part.schema[name].row_bytes, rest)
            rest -= size
        takers = [name for name in held if part.schema[name].ragged] or dense[:1]
        if takers:
            share = rest // len(takers)
            for name in takers:
                part.field_bytes[name][rows] += share
            part.field_bytes[takers[0]][rows] += rest - share * len(takers)
