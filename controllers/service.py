"""The controller service: one handler per request type over the sample tables.

It owns the partitions (`table.Partition`), the units' byte counts, the version clock, admission
control and the scheduler; components add their own handlers over the same tables: `puts`
(placement, commit, abort, expiry), `units` (registration, liveness, frees) and `keys`
(TransferQueue keys). It never touches tensor bytes: producers and consumers move those straight
to and from the storage units; the controller only tells units which rows to free.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

import msgspec
import numpy as np

from transfer_queue.wire.errors import (
    SchemaError,
    SealedError,
)
from transfer_queue.wire.messages import (
    Ack,
    Acquire,
    Announce,
    Clear,
    ClearPartition,
    ClusterConfig,
    ControllerRequest,
    Export,
    ExportReply,
    GetMeta,
    GrantReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    MetaReply,
    Nack,
    Ok,
    Release,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    UnitInfo,
    VersionReply,
    WaitVersion,
)
from transfer_queue.wire.rpc import MAX_BATCH, Codec, Credentials, Service

from .admission import Admission
from .journal import Acked, Dropped, Freed, Journal, Placed, Record, Sealed, Version
from .keys import KeyService
from .puts import Puts
from .samplers import SamplerRegistry
from .scheduling import Scheduler
from .status import ClusterStatus, Counters, RetiredUnitStatus, UnitStatus
from .table import Partition
from .units import UnitLinks
from .versions import VersionClock

__all__ = ["Controller"]

log = logging.getLogger("sluice.controller")

_MAX_ANNOUNCE_BYTES = 1 << 20


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
        self.started = time.time()
        self.partitions: dict[str, Partition] = {}
        self.units: dict[int, UnitInfo] = {}
        self.unit_bytes: dict[int, int] = {}
        self._next_index = 0
        self.clock = VersionClock()
        self.admission = Admission(
            config.admission_staleness, config.consumer_batch_size, config.grant_timeout, lambda: self.clock.current
        )
        samplers = SamplerRegistry()
        for path in config.samplers:
            samplers.load(path)
        self.scheduler = Scheduler(config, self.partitions, self.clock, self.admission, samplers, self.free_rows)
        self.announced: dict[str, bytes] = {}
        self._announce_waiters: dict[str, list[asyncio.Future]] = {}
        for msg_type, handler in {
            Hello: self.on_hello,
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
        self.links = UnitLinks(self, secret or secrets.token_hex(16), credentials)
        self.puts = Puts(self)
        self.keys = KeyService(self)
        self.journal: Journal | None = None
        if config.journal:  # replay what a previous controller recorded, then record from here on
            self.journal = Journal(config.journal)
            replayed = self.journal.open(self)
            log.info("controller journal %s: %d records replayed", config.journal, replayed)

    def record(self, rec: Record) -> None:
        """Journal a change that was just applied (before its request is answered)."""
        if self.journal is not None:
            self.journal.append(rec)

    # -- rows ------------------------------------------------------------------------------

    def on_hello(self, msg: Hello, data) -> HelloReply:
        units = [self.units[k] for k in sorted(self.units)]
        return HelloReply(self.cluster_id, self.config, units, self.clock.current)

    def free_rows(self, part: Partition, rows: np.ndarray) -> None:
        """Free `rows` (those still alive): uncount their bytes, tell their units, journal it."""
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
        self.links.tell_free(part.name, by_unit)
        self.record(Freed(part.name, part.gidx[rows].tolist()))
        self.puts.intake.wake()

    def partition(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            if not name:
                raise SchemaError("a partition needs a non-empty name (e.g. 'train')")
            part = self.partitions[name] = Partition(name)
        return part

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
        self.record(Placed(part.name, first, units.tolist(), row_bytes, fields, committed))
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

    def shares(self, units: np.ndarray, row_bytes: int) -> dict[int, int]:
        """Bytes per live unit of rows placed on `units`, `row_bytes` each."""
        ids, counts = np.unique(units, return_counts=True)
        return {int(u): int(c) * row_bytes for u, c in zip(ids, counts) if int(u) in self.unit_bytes}

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
        part = self.existing(msg.partition)
        self.scheduler.ack(part, msg.task, msg.indexes)
        self.record(Acked(part.name, msg.task, msg.indexes))
        return Ok()

    def on_nack(self, msg: Nack, data) -> Ok:
        part = self.existing(msg.partition)
        self.scheduler.nack(part, msg.task, msg.indexes)
        return Ok()

    def existing(self, name: str) -> Partition:
        part = self.partitions.get(name)
        if part is None:
            raise SchemaError(f"no partition named {name!r}")
        return part

    def on_clear(self, msg: Clear, data) -> Ok:
        part = self.existing(msg.partition)
        self.free_rows(part, part.rows_of(msg.indexes, alive=False))
        self.scheduler.wake(part.name)
        return Ok()

    def on_clear_partition(self, msg: ClearPartition, data) -> Ok:
        self._drop_partition(msg.partition)  # first: the puts ended below then have no rows left to free
        self.puts.end_in(
            msg.partition, SchemaError(f"partition {msg.partition!r} was cleared while this put was in flight")
        )
        self.record(Dropped(msg.partition))
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
            self.links.tell_free(name, None)
            self.puts.intake.wake()

    def on_seal(self, msg: Seal, data) -> Ok:
        """Seal: puts still in flight are refused (`SealedError` at their commit), so the samples
        a stream sees are exactly those committed before the seal."""
        self.partition(msg.partition).sealed = True
        self.record(Sealed(msg.partition))
        self.puts.end_in(
            msg.partition,
            SealedError(
                f"partition {msg.partition!r} was sealed while this put was in flight; none of its samples were stored"
            ),
        )
        self.scheduler.wake(msg.partition)
        return Ok()

    # -- versions and admission --------------------------------------------------------

    def on_set_version(self, msg: SetVersion, data) -> VersionReply:
        if self.clock.set(msg.version):
            self.record(Version(msg.version))
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
        return self.existing(msg.partition).export()

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
            retired_units={str(k): RetiredUnitStatus(u.address) for k, u in sorted(self.links.retired.items())},
            bytes=sum(self.unit_bytes.values()),
            staleness=self.scheduler.stale.status(),
            admission=self.admission.status(),
            counters=Counters(
                samples_put=self.puts.samples,
                samples_served=scheduler.served,
                samples_acked=scheduler.acked,
                open_leases=scheduler.open_leases,
                parked_get_meta=scheduler.parked,
                open_puts=len(self.puts.open),
                puts_waiting_for_room=len(self.puts.intake),
                puts_expired=self.puts.expired,
                samples_lost=self.links.samples_lost,
                registrations_refused=self.links.registrations_refused,
                reports_refused=self.puts.reports_refused,
                auth_refused=self.auth_refused,
                requests_served=self.served,
                requests_rejected=self.rejected,
            ),
        )

    def on_status(self, msg: Status, data) -> StatusReply:
        return StatusReply(msgspec.to_builtins(self.status()))
