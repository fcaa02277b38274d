"""The controller service: one handler per request type over the sample tables.

It owns the partitions (`table.Partition`), the version clock, admission control and the
scheduler. It never touches tensor bytes: producers and consumers move those straight to and
from the storage units; the controller only tells units which rows to free.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass

import msgspec
import numpy as np

from transfer_queue._errors import (
    CapacityError,
    ProtocolError,
    SchemaError,
    SealedError,
    ServiceError,
    SluiceError,
    TimeoutError,
)
from transfer_queue._messages import (
    AbortPut,
    Ack,
    Acquire,
    Announce,
    BeginPut,
    Clear,
    ClearPartition,
    ClusterConfig,
    CommitPut,
    ControllerRequest,
    Export,
    ExportReply,
    ExportRows,
    Free,
    GetMeta,
    GrantReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    MetaReply,
    Nack,
    Ok,
    Ping,
    PutPlan,
    RegisterUnit,
    Release,
    Reply,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    UnitInfo,
    VersionReply,
    WaitVersion,
)
from transfer_queue._meta import BatchMeta
from transfer_queue.rpc import MAX_BATCH, AsyncChannel, Codec, Credentials, Service

from .admission import Admission
from .intake import Intake
from .journal import Acked, Committed, Dropped, Freed, Journal, Placed, Record, Retired, Sealed, Unit, Version
from .keys import KeyService
from .placement import place_rows
from .samplers import SamplerRegistry
from .scheduling import Scheduler
from .status import ClusterStatus, Counters, RetiredUnitStatus, UnitStatus
from .table import Partition
from .versions import VersionClock

__all__ = ["Controller"]

log = logging.getLogger("sluice.controller")

_MAX_ANNOUNCE_BYTES = 1 << 20
_UNIT_PING = 1.0
"""Seconds between the controller's liveness pings to each storage unit."""
_UNIT_DEAD_AFTER = 5.0
"""Seconds of silence after which a storage unit is retired and its samples counted lost."""
_PUT_GRACE = 5.0
"""Seconds an open put may outlive 2 x its timeout (one wait for space, one shm reservation)."""
_ENDED_KEPT = 4096  # ended puts remembered, so a late CommitPut learns why its rows are gone


@dataclass
class _OpenPut:
    """New rows placed by `BeginPut` and not yet committed (or aborted)."""

    partition: str
    first: int
    n: int
    deadline: float
    timer: asyncio.TimerHandle
    framed: dict[int, int]
    """Unit id -> bytes this put sends that unit as data frames (its share of the frame window)."""


class Controller(Service):
    """Metadata, versions and scheduling for one Sluice cluster."""

    def __init__(
        self,
        config: ClusterConfig,
        bind: str,
        cluster_id: str | None = None,
        secret: str | None = None,
        credentials: Credentials | None = None,
    ):
        super().__init__(Codec(ControllerRequest), bind, credentials=credentials)
        self.credentials = credentials
        self.config = config
        self.cluster_id = cluster_id or uuid.uuid4().hex[:12]
        self._secret = secret or secrets.token_hex(16)
        self.registrations_refused = 0
        self.started = time.time()
        self.partitions: dict[str, Partition] = {}
        self.units: dict[int, UnitInfo] = {}
        self.unit_bytes: dict[int, int] = {}
        self.unit_heard: dict[int, float] = {}  # unit id -> monotonic time of its last message
        self.retired: dict[int, UnitInfo] = {}  # units that stopped answering, until they register again
        self.samples_lost = 0
        self._pinger: asyncio.TimerHandle | None = None
        self._last_ping = 0.0
        self._unit_channels: dict[int, AsyncChannel] = {}
        self._unit_codec = Codec(Reply)
        self._next_index = 0
        self.clock = VersionClock()
        self.admission = Admission(
            config.admission_staleness, config.consumer_batch_size, config.grant_timeout, lambda: self.clock.current
        )
        samplers = SamplerRegistry()
        for path in config.samplers:
            samplers.load(path)
        self.scheduler = Scheduler(config, self.partitions, self.clock, self.admission, samplers, self._free_rows)
        self.announced: dict[str, bytes] = {}
        self._announce_waiters: dict[str, list[asyncio.Future]] = {}
        self.puts = 0
        self.open_puts: dict[int, _OpenPut] = {}
        self.intake = Intake()
        self.puts_expired = 0
        self._ended_puts: OrderedDict[int, SluiceError] = OrderedDict()
        for msg_type, handler in {
            Hello: self.on_hello,
            RegisterUnit: self.on_register_unit,
            BeginPut: self.on_begin_put,
            CommitPut: self.on_commit_put,
            AbortPut: self.on_abort_put,
            GetMeta: self.on_get_meta,
            Ack: self.on_ack,
            Nack: self.on_nack,
            Clear: self.on_clear,
            ClearPartition: self.on_clear_partition,
            Seal: self.on_seal,
            SetVersion: self.on_set_version,
            WaitVersion: self.on_wait_version,
            Acquire: self.on_acquire,
            Release: self.on_release,
            Status: self.on_status,
            Announce: self.on_announce,
            Lookup: self.on_lookup,
            Export: self.on_export,
        }.items():
            self.route(msg_type, handler)
        self.keys = KeyService(self)
        self.journal: Journal | None = None
        if config.journal:  # replay what a previous controller recorded, then record from here on
            self.journal = Journal(config.journal)
            replayed = self.journal.open(self)
            log.info("controller journal %s: %d records replayed", config.journal, replayed)

    def _record(self, rec: Record) -> None:
        """Journal a change that was just applied (before its request is answered)."""
        if self.journal is not None:
            self.journal.append(rec)

    # -- membership --------------------------------------------------------------------

    def on_hello(self, msg: Hello, data) -> HelloReply:
        units = [self.units[k] for k in sorted(self.units)]
        return HelloReply(self.cluster_id, self.config, units, self.clock.current)

    def on_register_unit(self, msg: RegisterUnit, data) -> Ok:
        """Add a unit, or take back one that restarted (a fresh, empty arena) after it was retired.

        Raises `ProtocolError` (counted) without the cluster secret: nobody else may add a unit
        or replace a live one, and with it redirect clients' data."""
        if not hmac.compare_digest(msg.secret.encode(), self._secret.encode()):
            self.registrations_refused += 1
            raise ProtocolError(
                f"RegisterUnit of unit {msg.unit.unit_id} refused: it does not carry this cluster's secret "
                "(start units with SLUICE_SECRET set to it)"
            )
        self.add_unit(msg.unit)
        return Ok()

    def add_unit(self, unit: UnitInfo) -> None:
        """Serve `unit`: place rows on it, ping it, send it frees."""
        self.units[unit.unit_id] = unit
        self.retired.pop(unit.unit_id, None)
        self.unit_bytes.setdefault(unit.unit_id, 0)
        self.unit_heard[unit.unit_id] = time.monotonic()
        if self._pinger is None:
            self._last_ping = time.monotonic()
            self._pinger = asyncio.get_running_loop().call_later(_UNIT_PING, self._ping_units)
        old = self._unit_channels.pop(unit.unit_id, None)
        if old is not None:
            old.close()
        self._unit_channels[unit.unit_id] = AsyncChannel(
            unit.address,
            self._unit_codec,
            name=f"storage unit {unit.unit_id} at {unit.address}",
            credentials=self.credentials,
            on_reply=lambda reply, uid=unit.unit_id: self._unit_replied(uid, reply),
        )
        self.intake.wake()
        self._record(Unit(unit))

    def _ping_units(self) -> None:
        """Loop timer: ping every unit; retire those silent for `_UNIT_DEAD_AFTER` seconds.

        A tick that comes late means this controller was stalled (CPU starved, suspended) and
        could hear nobody meanwhile: every unit then gets a fresh window instead of being retired
        for the controller's own silence."""
        now = time.monotonic()
        if now - self._last_ping > 2 * _UNIT_PING:
            for unit_id in self.unit_heard:
                self.unit_heard[unit_id] = max(self.unit_heard[unit_id], now - _UNIT_PING)
        self._last_ping = now
        for unit_id in list(self.units):
            if now - self.unit_heard.get(unit_id, now) > _UNIT_DEAD_AFTER:
                self._retire_unit(unit_id)
                continue
            self._unit_channels[unit_id].post(Ping())
        self._pinger = asyncio.get_running_loop().call_later(_UNIT_PING, self._ping_units)

    def _retire_unit(self, unit_id: int) -> None:
        """A unit died: never place or serve its rows again. Puts in flight on it fail; its
        samples are counted lost, and the prompts of those that have a source are requeued."""
        unit = self.retired[unit_id] = self.units.pop(unit_id)
        self.unit_bytes.pop(unit_id, None)
        self.unit_heard.pop(unit_id, None)
        channel = self._unit_channels.pop(unit_id, None)
        if channel is not None:
            channel.close()
        why = ServiceError(
            f"storage unit {unit_id} at {unit.address} died while this put was in flight; "
            "none of its samples were stored: put again"
        )
        for first, put in list(self.open_puts.items()):
            part = self.partitions.get(put.partition)
            if part is not None and np.any(
                part.unit[part.rows_of(range(first, first + put.n), alive=False)] == unit_id
            ):
                self._end_put(first, why)
        lost = 0
        for part in self.partitions.values():
            rows = np.flatnonzero(part.alive[: part.n] & (part.unit[: part.n] == unit_id))
            if len(rows):
                lost += len(rows)
                self.scheduler.lose(part, rows)
        self.samples_lost += lost
        self.intake.forget(unit_id)
        self._record(Retired(unit_id))
        log.warning("storage unit %d at %s stopped answering: retired, %d samples lost", unit_id, unit.address, lost)

    def _unit_replied(self, unit_id: int, reply: object) -> None:
        """A unit answered a ping or a `Free`: it is alive (a refused free is logged)."""
        self.unit_heard[unit_id] = time.monotonic()
        if not isinstance(reply, Ok):
            log.warning("unit %d refused a free: %s", unit_id, reply)

    def _tell_units(self, partition: str, rows_by_unit: dict[int, list[int]] | None) -> None:
        targets = self._unit_channels if rows_by_unit is None else rows_by_unit
        for unit_id in targets:
            channel = self._unit_channels.get(unit_id)
            if channel is not None:
                channel.post(Free(partition, None if rows_by_unit is None else rows_by_unit[unit_id]))

    def _free_rows(self, part: Partition, rows: np.ndarray) -> None:
        rows = rows[part.alive[rows]]
        if not len(rows):
            return
        part.kill(rows)
        by_unit: dict[int, list[int]] = {}
        for unit_id in np.unique(part.unit[rows]).tolist():
            picked = rows[part.unit[rows] == unit_id]
            by_unit[unit_id] = part.gidx[picked].tolist()
            if unit_id in self.unit_bytes:  # not a retired unit
                self.unit_bytes[unit_id] = max(0, self.unit_bytes[unit_id] - int(part.row_bytes[picked].sum()))
        self._tell_units(part.name, by_unit)
        self._record(Freed(part.name, part.gidx[rows].tolist()))
        self.intake.wake()

    # -- puts --------------------------------------------------------------------------

    def _partition(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            if not name:
                raise SchemaError("a partition needs a non-empty name (e.g. 'train')")
            part = self.partitions[name] = Partition(name)
        return part

    def on_begin_put(self, msg: BeginPut, data) -> PutPlan | Awaitable[PutPlan]:
        """Place a put's rows now, or once its units have room (see `intake`); `CapacityError`
        if none comes within the put's timeout."""
        if msg.n <= 0:
            raise SchemaError(f"a put needs at least one sample, got batch_size {msg.n}")
        if msg.n > MAX_BATCH:
            raise SchemaError(f"a put may hold at most {MAX_BATCH} samples, got {msg.n}; split it")
        if msg.row_bytes < 0 or not math.isfinite(msg.timeout) or msg.timeout < 0:
            raise SchemaError(f"bad put: row_bytes {msg.row_bytes} and timeout {msg.timeout} must be >= 0")
        if msg.n * msg.row_bytes > self.config.storage_capacity:
            raise CapacityError(
                f"a put of {msg.n} samples x {msg.row_bytes} bytes exceeds the whole capacity of the "
                f"cluster's storage, {self.config.storage_capacity} bytes; put smaller batches or raise storage_capacity"
            )
        if not msg.fields:
            raise SchemaError("a put needs at least one field")
        return self.intake.admit(lambda: self._place(msg), msg.timeout, lambda: self._full(msg))

    def _place(self, msg: BeginPut) -> PutPlan | None:
        """Place the put's rows now, or None while one of its units has no room."""
        part = self._partition(msg.partition)
        part.check_schema(msg.fields)
        if part.sealed:
            raise SealedError(f"partition {msg.partition!r} is sealed; no new samples may be put into it")
        if not self.units:
            raise SchemaError("the cluster has no storage units registered yet")
        units = place_rows(self.unit_bytes, msg.n, msg.row_bytes)
        shares = self._shares(units, msg.row_bytes)
        framed = {u: nbytes for u, nbytes in shares.items() if u not in msg.mapped}
        if not self.intake.fits(shares, framed, self.unit_bytes, self.units):
            return None
        first = self.new_rows(part, units, msg.row_bytes, msg.fields, shares)
        self.intake.opened(framed)
        lifetime = 2 * msg.timeout + _PUT_GRACE
        timer = asyncio.get_running_loop().call_later(lifetime, self._expire_put, first)
        self.open_puts[first] = _OpenPut(msg.partition, first, msg.n, lifetime, timer, framed)
        return PutPlan(list(range(first, first + msg.n)), units.tolist())

    def new_rows(
        self,
        part: Partition,
        units: np.ndarray,
        row_bytes: int,
        fields: dict,
        shares: dict[int, int],
        committed: bool = False,
    ) -> int:
        """New rows on `units` (uncommitted: a put's, until its commit; committed: keys'), under
        fresh global indexes, journaled; returns the first index."""
        first = self._next_index
        self._next_index += len(units)
        self._append_rows(part, first, units, row_bytes, fields, shares, committed)
        self._record(Placed(part.name, first, units.tolist(), row_bytes, fields, committed))
        return first

    def _append_rows(
        self,
        part: Partition,
        first: int,
        units: np.ndarray,
        row_bytes: int,
        fields: dict,
        shares: dict[int, int],
        committed: bool,
    ) -> None:
        """Register rows first.. on `units` (`shares`: their bytes per unit) and count their bytes."""
        part.add_fields(fields)
        rows = part.append(first, len(units), units, row_bytes)
        part.committed[rows] = committed
        for unit_id, nbytes in shares.items():
            self.unit_bytes[unit_id] += nbytes

    def _widen(self, part: Partition, rows: np.ndarray, row_bytes: int, fields: dict) -> None:
        """Add columns of `row_bytes` per row to existing rows and count their bytes."""
        part.add_fields(fields)
        part.row_bytes[rows] += row_bytes
        for unit_id, nbytes in self._shares(part.unit[rows], row_bytes).items():
            self.unit_bytes[unit_id] += nbytes

    def _shares(self, units: np.ndarray, row_bytes: int) -> dict[int, int]:
        """Bytes per live unit of rows placed on `units`, `row_bytes` each."""
        ids, counts = np.unique(units, return_counts=True)
        return {int(u): int(c) * row_bytes for u, c in zip(ids, counts) if int(u) in self.unit_bytes}

    def _full(self, msg: BeginPut) -> str:
        held = ", ".join(f"unit {u}: {self.unit_bytes[u]} of {self.units[u].capacity}" for u in sorted(self.unit_bytes))
        return (
            f"storage stayed full for {msg.timeout:g} s: a put of {msg.n} samples x {msg.row_bytes} bytes found no "
            f"room (bytes in use: {held}; {len(self.intake)} puts waiting); clear consumed samples or raise storage_capacity"
        )

    def on_commit_put(self, msg: CommitPut, data) -> Ok:
        if msg.rows is not None:
            self._close_put(msg)
        self._commit(msg)
        self._record(Committed(msg))
        return Ok()

    def _commit(self, msg: CommitPut) -> None:
        """Mark `msg.fields` ready, with new rows' facts, or new columns of existing rows checked
        and accounted for; wake the consumers. (The journal replays it through here.)"""
        info = msg.rows
        if info is None:
            part, rows = self._new_columns(msg)
        else:
            part = self._partition(msg.partition)
            rows = part.rows_of(msg.indexes)
            n = len(rows)
            for name, values in (
                ("versions_first", info.versions_first),
                ("versions_last", info.versions_last),
                ("groups", info.groups),
                ("seqlens", info.seqlens),
            ):
                if len(values) != n:
                    raise SchemaError(f"{name} has {len(values)} entries for {n} samples")
            part.v_first[rows] = info.versions_first
            part.v_last[rows] = info.versions_last
            part.group[rows] = info.groups
            part.seqlen[rows] = info.seqlens
            if info.source_partition:
                if len(info.source_indexes) != n:
                    raise SchemaError(f"source_indexes has {len(info.source_indexes)} entries for {n} samples")
                ref = (info.source_partition, info.source_task)
                if ref not in part.sources:
                    part.sources.append(ref)
                part.source[rows] = part.sources.index(ref)
                part.source_index[rows] = info.source_indexes
            part.committed[rows] = True
            part.granted[rows] = bool(info.grant_id)
            part.versioned[rows] = info.versioned
            if info.grant_id:
                self.admission.used(info.grant_id, n)
            self.puts += n
        part.mark_ready(rows, list(msg.fields))
        self.scheduler.wake(part.name)

    def _new_columns(self, msg: CommitPut) -> tuple[Partition, np.ndarray]:
        """Check and account for new columns of existing rows (a put with `meta=`)."""
        if not msg.fields:
            raise SchemaError("a put needs at least one field")
        if not msg.indexes or len(msg.indexes) > MAX_BATCH or msg.row_bytes < 0:
            raise SchemaError(f"a put of new columns needs 1..{MAX_BATCH} indexes and row_bytes >= 0")
        part = self._existing(msg.partition)
        rows = part.rows_of(msg.indexes)
        part.check_schema(msg.fields)
        self._widen(part, rows, msg.row_bytes, msg.fields)
        return part, rows

    def _close_put(self, msg: CommitPut) -> None:
        """Take the open put that `msg` commits off the clock; raise why it ended if it did."""
        first = msg.indexes[0] if msg.indexes else -1
        put = self.open_puts.get(first)
        if (
            put is None
            or put.partition != msg.partition
            or put.n != len(msg.indexes)
            or msg.indexes[-1] != first + put.n - 1
        ):
            ended = self._ended_puts.get(first)
            if ended is not None:
                raise type(ended)(str(ended))
            raise SchemaError(
                f"no open put of partition {msg.partition!r} starts at index {first} with {len(msg.indexes)} samples"
            )
        put.timer.cancel()
        del self.open_puts[first]
        self.intake.closed(put.framed)

    def _end_put(self, first: int, why: SluiceError) -> None:
        """Drop an open put: free its rows (never committed ones only) and remember why."""
        put = self.open_puts.pop(first, None)
        if put is None:
            return
        put.timer.cancel()
        self.intake.closed(put.framed)
        self._ended_puts[first] = why
        while len(self._ended_puts) > _ENDED_KEPT:
            self._ended_puts.popitem(last=False)
        part = self.partitions.get(put.partition)
        if part is not None:
            rows = part.rows_of(range(first, first + put.n), alive=False)
            self._free_rows(part, rows[~part.committed[rows]])
            self.scheduler.wake(part.name)

    def _expire_put(self, first: int) -> None:
        put = self.open_puts.get(first)
        if put is None:
            return
        self.puts_expired += 1
        self._end_put(
            first,
            TimeoutError(
                f"the put of {put.n} samples into partition {put.partition!r} was not committed within "
                f"{put.deadline:g} s (its producer stalled or died); its rows were freed: put again"
            ),
        )

    def on_abort_put(self, msg: AbortPut, data) -> Ok:
        """Free rows of a put that failed; committed rows are never touched (clear them instead)."""
        part = self.partitions.get(msg.partition)
        if part is None or not msg.indexes:
            return Ok()
        first = msg.indexes[0]
        if first in self.open_puts:
            self._end_put(first, SchemaError(f"the put starting at index {first} was aborted by its producer"))
        else:
            rows = part.rows_of(msg.indexes, alive=False)
            self._free_rows(part, rows[~part.committed[rows]])
        return Ok()

    # -- consumers ---------------------------------------------------------------------

    async def on_get_meta(self, msg: GetMeta, data) -> MetaReply:
        if not 0 < msg.batch_size <= MAX_BATCH:
            raise SchemaError(f"batch_size must be in 1..{MAX_BATCH}, got {msg.batch_size}")
        if not msg.timeout >= 0 or (msg.lease_timeout is not None and not msg.lease_timeout > 0):
            raise SchemaError(
                f"get_meta needs timeout >= 0 and lease_timeout > 0 (or None for the cluster's), got "
                f"{msg.timeout} and {msg.lease_timeout}"
            )
        if not msg.fields or not msg.partition or not msg.task:
            raise SchemaError(
                f"get_meta needs fields, a partition and a task, got {msg.fields}, {msg.partition!r}, {msg.task!r}"
            )
        part = self.partitions.get(msg.partition)
        unknown = [] if part is None else [f for f in msg.fields if f not in part.schema]
        if unknown and part.sealed and not part.alive[: part.n].any():
            raise SchemaError(
                f"get_meta(task={msg.task!r}) asks for field(s) {unknown} that partition {msg.partition!r} never had "
                f"(it has {sorted(part.schema)}), and it is sealed with no samples left, so no put can bring them: "
                "check the names"
            )
        return MetaReply(await self.scheduler.get_meta(msg))

    def on_ack(self, msg: Ack, data) -> Ok:
        part = self._existing(msg.partition)
        self.scheduler.ack(part, msg.task, msg.indexes)
        self._record(Acked(part.name, msg.task, msg.indexes))
        return Ok()

    def on_nack(self, msg: Nack, data) -> Ok:
        part = self._existing(msg.partition)
        self.scheduler.nack(part, msg.task, msg.indexes)
        return Ok()

    def _existing(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            raise SchemaError(f"no partition named {name!r}")
        return part

    def on_clear(self, msg: Clear, data) -> Ok:
        part = self._existing(msg.partition)
        self._free_rows(part, part.rows_of(msg.indexes, alive=False))
        self.scheduler.wake(part.name)
        return Ok()

    def on_clear_partition(self, msg: ClearPartition, data) -> Ok:
        self._drop_partition(msg.partition)  # first: the puts ended below then have no rows left to free
        for first in [k for k, put in self.open_puts.items() if put.partition == msg.partition]:
            self._end_put(first, SchemaError(f"partition {msg.partition!r} was cleared while this put was in flight"))
        self._record(Dropped(msg.partition))
        return Ok()

    def _drop_partition(self, name: str) -> None:
        part = self.partitions.pop(name, None)
        if part is not None:
            live = np.flatnonzero(part.alive[: part.n])
            for unit_id in np.unique(part.unit[live]).tolist():
                used = int(part.row_bytes[live][part.unit[live] == unit_id].sum())
                if unit_id in self.unit_bytes:
                    self.unit_bytes[unit_id] = max(0, self.unit_bytes[unit_id] - used)
            self.scheduler.forget_partition(name)
            self._tell_units(name, None)
            self.intake.wake()

    def on_seal(self, msg: Seal, data) -> Ok:
        """Seal: puts still in flight are refused (`SealedError` at their commit), so the samples
        a stream sees are exactly those committed before the seal."""
        self._partition(msg.partition).sealed = True
        self._record(Sealed(msg.partition))
        for first in [k for k, put in self.open_puts.items() if put.partition == msg.partition]:
            self._end_put(
                first,
                SealedError(
                    f"partition {msg.partition!r} was sealed while this put was in flight; none of its samples were stored"
                ),
            )
        self.scheduler.wake(msg.partition)
        return Ok()

    # -- versions and admission --------------------------------------------------------

    def on_set_version(self, msg: SetVersion, data) -> VersionReply:
        if self.clock.set(msg.version):
            self._record(Version(msg.version))
            self.admission.pump()
            self.scheduler.wake_all()
        return VersionReply(self.clock.current)

    async def on_wait_version(self, msg: WaitVersion, data) -> VersionReply:
        history = await self.clock.wait(msg.after, msg.timeout)
        return VersionReply(self.clock.current, history)

    async def on_acquire(self, msg: Acquire, data) -> GrantReply:
        if msg.n > MAX_BATCH:
            raise SchemaError(f"acquire may ask for at most {MAX_BATCH} slots at once, got {msg.n}")
        grant_id, version = await self.admission.acquire(msg.n, msg.timeout)
        return GrantReply(grant_id, msg.n, version)

    def on_release(self, msg: Release, data) -> Ok:
        self.admission.release(msg.grant_id, msg.n)
        return Ok()

    # -- small shared values -----------------------------------------------------------

    def on_announce(self, msg: Announce, data) -> Ok:
        if len(msg.value) > _MAX_ANNOUNCE_BYTES:
            raise SchemaError(f"announced values are limited to {_MAX_ANNOUNCE_BYTES} bytes")
        self.announced[msg.key] = msg.value
        for fut in self._announce_waiters.pop(msg.key, []):
            if not fut.done():
                fut.set_result(msg.value)
        return Ok()

    async def on_lookup(self, msg: Lookup, data) -> LookupReply:
        value = self.announced.get(msg.key)
        if value is not None or msg.timeout <= 0:
            return LookupReply(value)
        fut = asyncio.get_running_loop().create_future()
        self._announce_waiters.setdefault(msg.key, []).append(fut)
        try:
            return LookupReply(await asyncio.wait_for(fut, msg.timeout))
        except asyncio.TimeoutError:
            return LookupReply(None)

    # -- checkpoints -------------------------------------------------------------------

    def on_export(self, msg: Export, data) -> ExportReply:
        """What a checkpoint needs of a partition (see `ExportReply`)."""
        part = self._existing(msg.partition)
        rows = np.flatnonzero(part.alive[: part.n] & part.committed[: part.n])
        names = list(part.schema)
        key = np.zeros(len(rows), np.int64)
        for bit, name in enumerate(names):
            key |= part.ready[name][rows].astype(np.int64) << bit
        batches, details = [], []
        for value in np.unique(key).tolist():
            picked = rows[key == value]
            fields = {name: part.schema[name] for bit, name in enumerate(names) if value >> bit & 1}
            batches.append(
                BatchMeta(
                    partition=part.name,
                    indexes=part.gidx[picked].tolist(),
                    policy_versions=part.v_first[picked].tolist(),
                    version_last=part.v_last[picked].tolist(),
                    groups=part.group[picked].tolist(),
                    units=part.unit[picked].tolist(),
                    fields=fields,
                )
            )
            details.append(
                ExportRows(
                    part.versioned[picked].tolist(),
                    (part.source[picked].astype(np.int64) - 1).tolist(),
                    part.source_index[picked].tolist(),
                )
            )
        consumed = {name: part.gidx[rows[task.consumed[rows]]].tolist() for name, task in part.tasks.items()}
        return ExportReply(batches, consumed, part.sealed, details, list(part.sources[1:]))

    # -- status ------------------------------------------------------------------------

    def status(self) -> ClusterStatus:
        """The cluster as `status()` reports it; each part reports its own share."""
        scheduler = self.scheduler.status()
        return ClusterStatus(
            cluster_id=self.cluster_id,
            uptime_s=round(time.time() - self.started, 3),
            version=self.clock.current,
            max_staleness=self.config.max_staleness,
            stale_policy=self.config.stale_policy,
            partitions={name: part.status() for name, part in self.partitions.items()},
            units={
                str(k): UnitStatus(u.address, u.capacity, self.unit_bytes.get(k, 0))
                for k, u in sorted(self.units.items())
            },
            retired_units={str(k): RetiredUnitStatus(u.address) for k, u in sorted(self.retired.items())},
            bytes=sum(self.unit_bytes.values()),
            staleness=self.scheduler.stale.status(),
            admission=self.admission.status(),
            counters=Counters(
                samples_put=self.puts,
                samples_served=scheduler.served,
                samples_acked=scheduler.acked,
                open_leases=scheduler.open_leases,
                parked_get_meta=scheduler.parked,
                open_puts=len(self.open_puts),
                puts_waiting_for_room=len(self.intake),
                puts_expired=self.puts_expired,
                samples_lost=self.samples_lost,
                registrations_refused=self.registrations_refused,
                auth_refused=self.auth_refused,
                requests_served=self.served,
                requests_rejected=self.rejected,
            ),
        )

    def on_status(self, msg: Status, data) -> StatusReply:
        return StatusReply(msgspec.to_builtins(self.status()))
