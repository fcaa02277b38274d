"""The controller service: its parts, wired together, and the requests no part answers itself.

It builds the parts and wires them together, each given only what it uses: the `ledger` of rows
(partitions, units and their bytes, the next index), the version clock, admission control and the
scheduler, and the parts that answer their own requests over the same ledger: `puts` (placement,
commit, abort, expiry), `units` (registration, liveness, frees) and `keys` (TransferQueue keys).
The `journal` records their changes and replays them through the same parts. It never touches
tensor bytes: producers and consumers move those straight to and from the storage units; the
controller only tells units which rows to free.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from transfer_queue.host import give_back_freed_memory, host_id
from transfer_queue.wire.errors import (
    LeaseExpiredError,
    SchemaError,
    SealedError,
)
from transfer_queue.wire.messages import (
    FEATURES,
    LANE,
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
    Registered,
    RegisterUnit,
    Release,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    VersionReply,
    WaitVersion,
)
from transfer_queue.wire.rpc import MAX_BATCH, Codec, Credentials, Service

from .admission import Admission
from .intake import Intake
from .journal import Journal, Recorded
from .keys import KeyService
from .ledger import KEEP_FREED, Ledger
from .puts import Puts
from .records import Acked, Dropped, Record, Sealed, Version
from .samplers import SamplerRegistry
from .scheduling import Scheduler
from .status import ClusterStatus, Counters, RetiredUnitStatus, UnitStatus
from .table import Partition
from .units import UnitLinks
from .versions import VersionClock

__all__ = ["Controller"]

log = logging.getLogger("sluice.controller")

_MAX_ANNOUNCE_BYTES = 1 << 20
_CROWD = 64
"""Peers at the busiest moment below which their leaving does not return heap (too little to matter)."""


def _unrecorded(rec: Record) -> None:
    """No journal: changes are not recorded."""


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
        # with credentials every client proves it holds the cluster's keys, which the lane (same
        # user only) could not ask: a cluster bound beyond loopback serves no lane
        super().__init__(Codec(ControllerRequest), bind, credentials=credentials, local=credentials is None)
        self.credentials = credentials
        self.config = config
        self.cluster_id = cluster_id or uuid.uuid4().hex[:12]
        self.started = time.time()
        self.journal = Journal(config.journal, self.cluster_id) if config.journal else None
        self.record = self.journal.append if self.journal is not None else _unrecorded
        """Journals a change that was just applied (before its request is answered)."""
        self.ledger = Ledger(self.record)
        self.clock = VersionClock()
        self.admission = Admission(
            config.admission_staleness,
            config.consumer_batch_size,
            config.grant_timeout,
            lambda: self.clock.current,
            config.follow_consumers,
            lambda: self.scheduler.producers_stalled(),  # the scheduler needs admission: built next
        )
        samplers = SamplerRegistry()
        for path in config.samplers:
            samplers.load(path)
        self.scheduler = Scheduler(
            config, self.ledger.partitions, self.clock, self.admission, samplers, self.ledger.free_rows
        )
        self.intake = Intake()
        self.links = UnitLinks(
            self.ledger,
            secret or secrets.token_hex(16),
            credentials,
            self.intake,
            self.record,
            lambda unit_id, why: self.puts.end_on(unit_id, why),  # puts need the links: built next
            self.scheduler.lose,
        )
        self.ledger.freed = self.links.freed  # frees go out over the links, which needed the ledger first
        self.puts = Puts(
            self.ledger,
            self.links,
            self.intake,
            self.admission,
            self.scheduler.wake,
            self.scheduler.granted_commit,
            self.record,
            config.storage_capacity,
        )
        self.on_peer_gone = self._peer_left
        self._peers_peak = 0
        self.keys = KeyService(self.ledger, self.scheduler.wake, self.record)
        self.announced: dict[str, bytes] = {}
        self._announce_waiters: dict[str, set[asyncio.Future]] = {}
        """Lookups parked until their key is announced, each removed when it ends (answered, timed out, cancelled)."""
        handlers: dict[type, Callable[..., Any]] = {
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
            **self.links.handlers(),
            **self.puts.handlers(),
            **self.keys.handlers(),
            RegisterUnit: self.on_register_unit,
        }
        for msg_type, handler in handlers.items():
            self.route(msg_type, handler)
        if self.journal is not None:  # replay what a previous controller recorded, then record from here on
            replayed = self.journal.open(
                Recorded(self.ledger, self.links, self.puts, self.keys, self.scheduler, self.clock)
            )
            self.cluster_id = self.journal.cluster_id
            log.info("controller journal %s: %d records replayed", config.journal, replayed)

    # -- cluster ---------------------------------------------------------------------

    def on_register_unit(self, msg: RegisterUnit, data) -> Registered | Ok:
        """`links.on_register_unit`, answered with where a unit on this host reaches the lane
        when the unit has a lane of its own (one before the lane knows only `Ok`)."""
        self.links.on_register_unit(msg, data)
        # A unit that names its own lane is of a release that decodes `Registered`; one before
        # the lane names none (its `UnitInfo` has no `local`), so no feature needs asking here.
        return Registered(host_id(), self.local_endpoint) if msg.unit.local else Ok()

    def on_hello(self, msg: Hello, data) -> HelloReply:
        """The cluster's configuration, units and version, and the features the client asked for
        that this controller supports (`FEATURES`): with `LANE`, its host and lane. Nothing
        unasked is sent: a client before a feature refuses its fields."""
        units = [self.ledger.units[k] for k in sorted(self.ledger.units)]
        granted = sorted(FEATURES.intersection(msg.features))
        host, local = (host_id(), self.local_endpoint) if LANE in granted else ("", "")
        return HelloReply(self.cluster_id, self.config, units, self.clock.current, host, local, granted)

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
        part = self.ledger.partitions.get(msg.partition)
        unknown = [] if part is None else [f for f in msg.fields if f not in part.schema]
        if part is not None and unknown and part.sealed and not part.alive[: part.n].any():
            raise SchemaError(
                f"get_meta(task={msg.task!r}) asks for field(s) {unknown} that partition {msg.partition!r} never had "
                f"(it has {sorted(part.schema)}), and it is sealed with no samples left, so no put can bring them: "
                "check the names"
            )
        return MetaReply(await self.scheduler.get_meta(msg))

    def on_ack(self, msg: Ack, data) -> Ok:
        """Ack what the lease allows (`Scheduler.ack`), journal it, then raise
        `LeaseExpiredError` for the samples another consumer of the task holds or acked now.

        Raises:
            SchemaError: no task is named (see `_consumer`)."""
        part = self._consumer(msg)
        taken, refused = self.scheduler.ack(part, msg.task, msg.indexes, msg.lease_id)
        if taken:
            self.record(Acked(part.name, msg.task, taken))
        if refused:
            raise LeaseExpiredError(
                f"ack(task={msg.task!r}, partition={part.name!r}) came after its lease expired (or was nacked): "
                f"{refused} of its {len(msg.indexes)} samples were leased again to another consumer of task "
                f"{msg.task!r} meanwhile and were left to it, so both processed them ({len(taken)} acked). Raise "
                f"lease_timeout above the time a batch takes: get_meta(lease_timeout=...), or the cluster's (now "
                f"{self.config.lease_timeout:g}s: tq.init(lease_timeout=...), sluice serve --lease-timeout)"
            )
        return Ok()

    def on_nack(self, msg: Nack, data) -> Ok:
        """Give samples back to the task's ready pool (`Scheduler.nack`).

        Raises:
            SchemaError: no task is named (see `_consumer`)."""
        part = self._consumer(msg)
        self.scheduler.nack(part, msg.task, msg.indexes, msg.lease_id)
        return Ok()

    def _consumer(self, msg: Ack | Nack) -> Partition:
        """The partition an ack or nack is for, once it names a task: a meta from a put or a
        hand-built one names none, and would make a task named "" consume the samples.

        Raises:
            SchemaError: no task, or no such partition."""
        kind = "ack" if isinstance(msg, Ack) else "nack"
        if not msg.task:
            raise SchemaError(
                f"{kind} needs the task the samples were handed to: pass a meta from get_meta (a put's meta names "
                "no task), or set meta.task"
            )
        return self.ledger.existing(msg.partition)

    def on_clear(self, msg: Clear, data) -> Ok:
        part = self.ledger.existing(msg.partition)
        self.ledger.free_rows(part, part.rows_of(msg.indexes, alive=False))
        if part.sealed:  # fewer samples left may drain it; unsealed, no parked request gains from a clear
            self.scheduler.wake(part.name)
        else:
            self.scheduler.ready_fell(part.name)
        return Ok()

    def on_clear_partition(self, msg: ClearPartition, data) -> Ok:
        self.scheduler.forget_partition(msg.partition)
        self.ledger.drop_partition(msg.partition)  # first: the puts ended below then have no rows left to free
        self.puts.end_in(
            msg.partition, SchemaError(f"partition {msg.partition!r} was cleared while this put was in flight")
        )
        self.record(Dropped(msg.partition))
        return Ok()

    def on_seal(self, msg: Seal, data) -> Ok:
        """Seal: puts still in flight are refused (`SealedError` at their commit), so the samples
        a stream sees are exactly those committed before the seal."""
        self.ledger.partition(msg.partition).sealed = True
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
        for fut in self._announce_waiters.pop(msg.key, set()):
            if not fut.done():
                fut.set_result(msg.value)
        return Ok()

    async def on_lookup(self, msg: Lookup, data) -> LookupReply:
        value = self.announced.get(msg.key)
        if value is not None or msg.timeout <= 0:
            return LookupReply(value)
        fut = asyncio.get_running_loop().create_future()
        waiters = self._announce_waiters.setdefault(msg.key, set())
        waiters.add(fut)
        try:
            return LookupReply(await asyncio.wait_for(fut, msg.timeout))
        except asyncio.TimeoutError:
            return LookupReply(None)
        finally:  # a lookup that gave up must not stay parked: a client polling for a key would pile them up
            waiters.discard(fut)
            if not waiters and self._announce_waiters.get(msg.key) is waiters:
                del self._announce_waiters[msg.key]

    # -- checkpoints -------------------------------------------------------------------

    def on_export(self, msg: Export, data) -> ExportReply:
        """What a checkpoint needs of a partition (see `ExportReply`)."""
        return self.ledger.existing(msg.partition).export()

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
            partitions={name: part.status() for name, part in self.ledger.partitions.items()},
            units={
                str(k): UnitStatus(
                    u.address, u.capacity, self.ledger.unit_bytes.get(k, 0), self.intake.in_flight.get(k, 0)
                )
                for k, u in sorted(self.ledger.units.items())
            },
            retired_units={str(k): RetiredUnitStatus(u.address) for k, u in sorted(self.links.retired.items())},
            bytes=sum(self.ledger.unit_bytes.values()),
            staleness=self.scheduler.stale.status(),
            admission=self.admission.status(),
            counters=Counters(
                samples_put=self.puts.samples,
                samples_served=scheduler.served,
                samples_acked=scheduler.acked,
                samples_ack_refused=scheduler.ack_refused,
                open_leases=scheduler.open_leases,
                parked_get_meta=scheduler.parked,
                open_puts=len(self.puts.open),
                puts_waiting_for_room=len(self.intake),
                puts_expired=self.puts.expired,
                samples_lost=self.links.samples_lost,
                registrations_refused=self.links.registrations_refused,
                reports_refused=self.puts.reports_refused,
                auth_refused=self.auth_refused,
                requests_served=self.served,
                requests_rejected=self.rejected,
                puts_abandoned=self.puts.abandoned,
            ),
            handling_us=self.handling_us(),
        )

    def _peer_left(self, peer: bytes) -> None:
        """A connection closed: its open puts end at once. Once half the peers of the busiest
        moment since the last time have left (a crowd leaving), freed heap goes back to the system."""
        self.puts.peer_gone(peer)
        watched = self.connections
        self._peers_peak = max(self._peers_peak, watched + 1)
        if self._peers_peak >= _CROWD and watched <= self._peers_peak // 2:
            self._peers_peak = watched
            give_back_freed_memory(KEEP_FREED)

    def handling_us(self) -> dict[str, float]:
        """p50, p99 and max of the controller's own time per request (`rpc.Service.handling`)."""
        times = sorted(self.handling)
        if not times:
            return {}
        at = [times[min(len(times) - 1, int(q * len(times)))] / 1000 for q in (0.5, 0.99, 1.0)]
        return {"p50": round(at[0], 1), "p99": round(at[1], 1), "max": round(at[2], 1)}

    def on_status(self, msg: Status, data) -> StatusReply:
        return StatusReply(msgspec.to_builtins(self.status()))
