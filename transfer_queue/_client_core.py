"""The data-plane flows, written once for `Client` and `AsyncClient` (see `_control` for what a
flow is and how it is driven): puts across units, the shared-memory fast path, reads and batch
assembly, acquire/release of generation slots, consumption and checkpoints.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

from ._checkpoint import (
    Manifest,
    PartitionState,
    read_batch,
    read_manifest,
    restore_order,
    restore_puts,
    write_batch,
    write_manifest,
)
from ._control import INT64, ControlCore, as_int, count
from ._flows import CONTROLLER, Call, Finish, Flow, Give, Launch, Plan, Run, Withdraw
from ._tensors import Assembler, BufferPool, Columns
from .cuda import HostRegistry, copies, pinned_empty, target_device, tensor_ptr
from .host import FreeLog, host_id, keep_freed_memory, map_file, open_arena, unmap
from .wire.errors import CapacityError, ProtocolError, SchemaError, ServiceError, SluiceError, TimeoutError
from .wire.messages import (
    FEATURES,
    FIELD_BYTES,
    AbortPut,
    Ack,
    Acquire,
    BeginPut,
    Clear,
    ClearPartition,
    ClusterConfig,
    CommitPut,
    CommitWrite,
    Export,
    ExportReply,
    ExportRows,
    GetMeta,
    GrantReply,
    Hello,
    HelloReply,
    MetaReply,
    Nack,
    Ok,
    PutPlan,
    Read,
    ReadReply,
    Release,
    RowInfo,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    UnitInfo,
    VersionReply,
    Via,
    Write,
    WriteReply,
)
from .wire.meta import BatchMeta
from .wire.rpc import GRACE, Credentials, check

__all__ = ["ClientCore", "Grant"]

_CHECKPOINT_ROWS = 1024
"""Samples per checkpoint batch file (what one get_data reads on save and one put writes on restore)."""


@dataclass
class Grant:
    """Generation slots granted by `acquire`: `n` samples under policy `version`.

    A put by the same client without `grant=` draws on the oldest of its open grants with slots
    left for the whole batch (none fits: `SchemaError`; it holds none: the put is under no
    grant); a put spends the slots once it is committed, so a failed one leaves them here (for a
    retry, or `release`), except one that failed after its commit was sent and before the answer
    came (cancelled, timed out): it may have been committed, so only `release` offers its slots
    back. As a context manager it returns the slots it did not use when the block ends.
    """

    grant_id: int
    n: int
    version: int
    remaining: int
    _client: Any = field(repr=False, default=None)
    _puts: int = field(repr=False, default=0)  # puts in flight holding some of its slots
    _unsure: int = field(repr=False, default=0)  # slots of failed puts that may have been committed (`_put_rows`)

    def __enter__(self) -> Grant:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    async def __aenter__(self) -> Grant:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.release()

    def release(self):
        """Give the unused slots back (returns an awaitable on an `AsyncClient`)."""
        return self._client.release(self)


@dataclass
class _Commit:
    """An open put's `CommitPut` call, sent by `_write` along with the put's writes. `unsure`
    while it is out and unanswered: a put that fails then (cancelled, a driver timeout, the
    controller gone) cannot tell whether the controller applied it (`AbortPut` leaves committed
    rows alone, and its answer does not say)."""

    call: Call
    unsure: bool = False

    def sent(self) -> Call:
        """The call, about to be sent: unsure until its answer comes."""
        self.unsure = True
        return self.call


class ClientCore(ControlCore):
    """State and flows shared by both clients: cluster info, mapped arenas, grants."""

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        super().__init__(address, credentials)
        self.use_shm = use_shm
        self.config: ClusterConfig | None = None
        self.cluster_id = ""
        self._arenas: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self._pinned = HostRegistry()  # arenas registered with CUDA, once this client copies to or from a GPU
        self._frees: dict[int, FreeLog | None] = {}  # per mapped unit, once read: `_free_log`
        self._pool = BufferPool()  # get_data's output memory, reused once the caller drops it
        self.grants: list[Grant] = []
        self._stay = -1  # the unit of this producer's previous put (`BeginPut.stay`)
        self._ahead = -1  # the mapped unit that took the whole of this producer's previous put

    # -- cluster -----------------------------------------------------------------------

    def hello(self) -> Flow:
        """Fetch the cluster's configuration and storage units (done on connect), and ask for
        every feature this release knows (`features`: those the controller grants; a controller
        before features refuses to be asked, and is asked again without: it grants none)."""
        try:
            reply = yield from self.one(CONTROLLER, Hello(sorted(FEATURES)), HelloReply)
        except ProtocolError:
            reply = yield from self.one(CONTROLLER, Hello(), HelloReply)
        self.features = frozenset(reply.features)
        self.config, self.cluster_id = reply.config, reply.cluster_id
        units = {u.unit_id: u for u in reply.units}
        for unit_id, unit in self.units.items():
            if units.get(unit_id) != unit:  # restarted (a new address, a new arena) or retired
                self._unmap(unit_id)
        self.units = units
        self._map_arenas()
        self._find_lanes(reply)
        return reply

    def _find_lanes(self, reply: HelloReply) -> None:
        """Note the local lanes (`lanes`) of the controller, when it is on this host, and of the
        units whose arenas this client maps: their messages carry no data. A unit reached with
        data frames (`use_shm=False`, or an arena not mapped) stays on ZeroMQ, whose I/O threads
        receive a large frame while the service goes on, where over the lane its loop would."""
        me = host_id()
        mapped = self.use_shm is not False
        self.lanes = {
            u.address: u.local
            for u in reply.units
            if u.local and u.host_id == me and mapped and u.unit_id in self._arenas
        }
        if reply.local and reply.host_id == me:
            self.lanes[self.address] = reply.local

    def _map_arenas(self) -> None:
        if self.use_shm is False:
            return
        me = host_id()
        for unit in self.units.values():
            if unit.unit_id in self._arenas or unit.host_id != me or not unit.shm_path:
                continue
            fd = open_arena(self.cluster_id, unit.unit_id, unit.shm_path, unit.capacity)
            if fd is None:  # not this cluster's arena file: reach the unit over TCP instead
                continue
            try:
                mm = map_file(fd, unit.capacity)
            finally:
                os.close(fd)
            self._arenas[unit.unit_id] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def _pin_arenas(self) -> None:
        """Register the mapped arenas with CUDA (each once), so that copies between them and the
        GPU run at pinned speed and asynchronously; called on this client's first CUDA copy."""
        for _, view in self._arenas.values():
            self._pinned.register(tensor_ptr(view), view.numel())

    def _unmap(self, unit_id: int) -> None:
        """Drop the mapping of a unit's arena, if this client maps it (a tensor may still view
        it; the mapping then goes with that tensor)."""
        if unit_id not in self._arenas:
            return
        mm, view = self._arenas.pop(unit_id)
        self._pinned.unregister(tensor_ptr(view))  # before the mapping goes
        del view
        unmap(mm)
        log = self._frees.pop(unit_id, None)  # it is the unmapped file's: a unit back anew has its own
        if log is not None:
            log.close()

    def _restarted(self, units: Sequence[int], known: dict[int, UnitInfo]) -> Flow:
        """After a call to a storage unit failed (`ServiceError`): whether one of `units` came
        back since the call's flow began (`known`: `units` then), registered again at a new
        address; the cluster's units are learned anew (`hello`, which maps the new arenas).
        False where none did (down, retired) or the controller cannot be asked either."""
        try:
            yield from self.hello()
        except SluiceError:
            return False
        now = self.units
        return any(u in known and u in now and now[u].address != known[u].address for u in set(units))

    def close_arenas(self) -> None:
        for unit_id in list(self._arenas):
            self._unmap(unit_id)
        self._pool.clear()

    # -- producers ---------------------------------------------------------------------

    def put(
        self,
        data: TensorDict | Mapping[str, torch.Tensor],
        partition: str = "train",
        *,
        meta: BatchMeta | None = None,
        policy_version: int | tuple[int, int] | Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
        grant: Grant | None = None,
        source: BatchMeta | None = None,
        timeout: float = 30.0,
    ) -> Flow:
        """The flow of `Client.put`. New rows: `BeginPut`, then the units' writes together with
        `CommitPut`, which the controller applies once the units report the writes stored (a
        write through a mapped arena first reserves its space, along with the `BeginPut` where
        the producer's previous put went whole to that unit: `_begin`); a failed put is aborted.
        New columns of `meta`'s rows: the writes, then `CommitPut`."""
        cols = Columns(data)
        if meta is not None:
            if len(meta) != cols.n:
                raise SchemaError(f"the data has {cols.n} samples, meta has {len(meta)}")
            partition = meta.partition
            # new columns of rows already placed: written straight to their units, checked at commit
            yield from self._write(partition, cols, list(meta.indexes), meta.units, timeout)
            commit = CommitPut(partition, list(meta.indexes), cols.specs, None, *self._accounted(cols))
            yield from self.one(CONTROLLER, commit, Ok)
            return msgspec.structs.replace(meta, fields={**meta.fields, **cols.specs})
        grant = grant or self._draw(cols.n)
        rows = self._row_info(cols, policy_version, groups, grant, source)  # validates first
        return (yield from self._put_rows(partition, cols, rows, grant, timeout))

    def _put_rows(
        self, partition: str, cols: Columns, rows: RowInfo, grant: Grant | None, timeout: float, retry: bool = True
    ) -> Flow:
        """Put `cols` as new rows described by `rows`, under `grant` (or none). The put holds the
        grant's slots while it runs and spends them once it is committed: a failed put leaves
        them to the grant, for a retry or `release` (the controller counts slots only for puts it
        applied), unless its commit was sent and never answered (cancelled, timed out: it may
        have been applied), which leaves them to `release` alone. With `retry`, a put that failed
        because a unit of its plan restarted (a write to its old address: nothing of the put was
        committed, and it was aborted) is put once more, to the units as they are now
        (`_restarted`)."""
        known = self.units  # `hello` replaces it
        drawn = 0 if grant is None else min(cols.n, grant.remaining)
        if grant is not None:
            grant.remaining -= drawn  # so that another put in flight does not draw them too
            grant._puts += 1  # nor does one that ends first drop the grant while these may come back
        mapped = list(self._arenas) if self.use_shm is not False else []  # these units get no frames
        row_bytes, sizes = self._accounted(cols)
        begin = BeginPut(partition, cols.specs, cols.n, row_bytes, timeout, mapped, self._stay, field_bytes=sizes)
        plan: PutPlan | None = None
        commit: _Commit | None = None
        try:
            plan, ahead = yield from self._begin(begin, cols, timeout)  # waits for room up to timeout
            commit = _Commit(
                Call(CONTROLLER, CommitPut(partition, plan.indexes, cols.specs, rows), (), timeout + GRACE)
            )
            yield from self._write(partition, cols, plan.indexes, plan.units, timeout, commit, plan.tickets, ahead)
        except BaseException as exc:  # a failed write or commit, a driver timeout, a cancel
            if grant is not None:
                if commit is not None and commit.unsure:  # maybe spent: never drawn on again (see `release`)
                    grant._unsure += drawn
                else:
                    grant.remaining += drawn
                self._put_ended(grant)
            # nothing to free; or GeneratorExit: the driver dropped this flow, nothing more may be sent
            if plan is None or isinstance(exc, GeneratorExit):
                raise
            try:  # free the rows now
                yield from self.one(CONTROLLER, AbortPut(partition, plan.indexes), Ok)
            except SluiceError:  # the controller's put deadline frees them anyway
                pass
            if not (retry and isinstance(exc, ServiceError) and (yield from self._restarted(plan.units, known))):
                raise
            return (yield from self._put_rows(partition, cols, rows, grant, timeout, retry=False))
        if grant is not None:
            self._put_ended(grant)
        self._stay = plan.units[-1]
        if plan.units[0] in self._arenas and self.use_shm is not False and _all_equal(plan.units):
            self._ahead = plan.units[0]
        return BatchMeta(
            partition=partition,
            indexes=plan.indexes,
            policy_versions=rows.versions_first,
            version_last=rows.versions_last,
            groups=rows.groups,
            units=plan.units,
            fields=dict(cols.specs),
        )

    def _accounted(self, cols: Columns) -> tuple[int, dict[str, int]]:
        """What a put of `cols` tells the controller it takes: its arena bytes per row, and each
        field's (`Columns.field_bytes`, which add up to them), the latter only for a controller
        that granted `FIELD_BYTES` (an older one refuses the field)."""
        sizes = cols.field_bytes()
        return sum(sizes.values()), sizes if FIELD_BYTES in self.features else {}

    def _draw(self, n: int) -> Grant | None:
        """The grant a put of `n` samples without `grant=` draws on: the oldest of this client's
        open grants with `n` slots left (slots held by its puts in flight are not left); None
        where it holds none (the samples then carry no version unless given one).

        Raises:
            SchemaError: it holds open grants, none with `n` slots left (a put under no grant
                would store unversioned samples, never too stale, past admission)."""
        if not self.grants:
            return None
        fits = next((g for g in self.grants if g.remaining >= n), None)
        if fits is None:
            left = ", ".join(f"grant {g.grant_id}: {g.remaining}" for g in self.grants)
            raise SchemaError(
                f"a put of {n} samples without grant=, and no open grant of this client has {n} slots left "
                f"({left}): pass grant=, put smaller batches, or acquire more"
            )
        return fits

    def _put_ended(self, grant: Grant) -> None:
        """A put under `grant` ended, its slots spent or given back: with no slot left and no
        put in flight that may give some back, the grant is spent (no longer drawn on)."""
        grant._puts -= 1
        if grant.remaining == 0 and grant._puts == 0 and grant in self.grants:
            self.grants.remove(grant)

    def _begin(self, begin: BeginPut, cols: Columns, timeout: float) -> Flow:
        """`begin`'s plan, and (unit, its reply) where the put holds arena space reserved along
        with it, else None. A producer whose previous put went whole to a unit it maps reserves
        the space of this one there at the same time (`Write.ahead`; the `BeginPut` then places
        the put at once or not at all, `BeginPut.now`, since the controller does not count that
        space): a put placed whole on that unit takes it, and costs no round trip for its
        reservation. Space the plan does not use is given back; a put not placed at once asks
        again, waiting for room, holding nothing. After a put that did not go whole to a mapped
        unit (or failed), the next one does not reserve ahead."""
        unit, self._ahead = self._ahead, -1

        def placed() -> Flow:  # as any put is: waiting for room, holding nothing
            return self.one(CONTROLLER, begin, PutPlan, timeout + GRACE)

        if unit not in self._arenas or self.use_shm is False:
            return (yield from placed()), None
        reserve = Write(begin.partition, list(range(cols.n)), cols.specs, cols.lengths(), "shm", timeout, ahead=True)
        try:
            (plan, _), (space, _) = yield [
                Call(CONTROLLER, msgspec.structs.replace(begin, now=True), (), timeout + GRACE),
                Call(unit, reserve, (), timeout + GRACE),
            ]
        except SluiceError:  # that unit (or the controller) is gone: asked as any put is, which raises if it must
            return (yield from placed()), None
        held = space if isinstance(space, WriteReply) else None  # a refusal (no room now) is no error
        if isinstance(plan, PutPlan) and plan.indexes and held is not None and set(plan.units) == {unit}:
            return plan, (unit, held)
        if held is not None:  # not this put's space
            yield [Call(unit, CommitWrite(held.token, abort=True), notice=True)]
        if not isinstance(plan, PutPlan) or plan.indexes:
            return check(plan, PutPlan), None  # placed elsewhere, or the controller's refusal raised
        return (yield from placed()), None

    def _write(
        self,
        partition: str,
        cols: Columns,
        indexes: list[int],
        units: list[int],
        timeout: float,
        commit: _Commit | None = None,
        tickets: dict[int, bytes] | None = None,
        ahead: tuple[int, WriteReply] | None = None,
    ):
        """Send each unit its rows: raw frames, or straight into its mapped arena (space reserved
        first, or `ahead`: (unit, its reservation) made along with the put's `BeginPut`). With
        `commit`, an open put's `CommitPut`: it goes with the writes, which are notices
        (`Write.put`, each with its unit's ticket from the put's plan): each unit reports its
        write to the controller, whose answer to the commit says how all of them went, so the
        put costs no round trip of its own. Space reserved ahead is committed with the put's rows
        and ticket (`CommitWrite.put`)."""
        put = -1 if commit is None else indexes[0]
        if cols.device is not None:
            self._pin_arenas()
        calls: list[Call] = []
        jobs: list[tuple[int, Via, list[torch.Tensor], WriteReply | None, list[int], bytes]] = []
        for unit_id, positions, rows in _by_unit(units, indexes):
            buffers, lengths = cols.slice(positions)
            nbytes = sum(b.numel() for b in buffers)
            if nbytes > self.units[unit_id].capacity:
                raise CapacityError(
                    f"{cols.n if positions is None else len(positions)} samples ({nbytes} bytes) exceed storage unit "
                    f"{unit_id}'s whole capacity of {self.units[unit_id].capacity} bytes; put smaller batches or "
                    "raise storage_capacity"
                )
            via: Via = "shm" if unit_id in self._arenas and self.use_shm is not False else "frames"
            ticket = b"" if tickets is None else tickets.get(unit_id, b"")
            if ahead is not None and ahead[0] == unit_id and via == "shm":
                jobs.append((unit_id, via, buffers, ahead[1], rows, ticket))
                continue
            msg = Write(partition, rows, cols.specs, lengths, via, timeout, put, ticket)
            data = _host_frames(buffers, cols.device) if via == "frames" else ()
            calls.append(Call(unit_id, msg, data, timeout + GRACE, notice=via == "frames" and commit is not None))
            jobs.append((unit_id, via, buffers, None, rows, ticket))
        framed = commit is not None and all(job[1] == "frames" for job in jobs)
        if framed and commit is not None:
            calls.append(commit.sent())  # every write carries its bytes: commit along with them
        answered = [reply for reply, _ in (yield calls)] if calls else []
        if commit is not None:
            commit.unsure = False  # answered, if it was sent
        errors = [exc for reply in answered if (exc := _failure(reply)) is not None]
        replies = iter(answered)  # one per job that sent a write, in order
        commits = []
        with copies(cols.device):  # a GPU batch: device to the arenas, one wait for all of them
            for unit_id, via, buffers, space, rows, ticket in jobs:
                reply = space if space is not None else next(replies)
                if via == "shm" and isinstance(reply, WriteReply):  # a reservation: fill it, then commit it
                    if not errors:
                        arena = self._arenas[unit_id][1]
                        for name, buf in zip(cols.specs, buffers):
                            off = reply.offsets[name]
                            arena[off : off + buf.numel()].copy_(buf, non_blocking=cols.device is not None)
                    done = (
                        CommitWrite(reply.token, put=put, indexes=rows, ticket=ticket)
                        if space is not None and not errors
                        else CommitWrite(reply.token, abort=bool(errors))
                    )
                    commits.append(Call(unit_id, done, notice=put >= 0))
        if commit is not None and not framed and not errors:
            commits.append(commit.sent())
        if commits:
            replies = yield commits
            if commit is not None:
                commit.unsure = False
            errors += [exc for reply, _ in replies if (exc := _failure(reply)) is not None]
        if errors:
            raise errors[0]

    def _row_info(self, cols: Columns, policy_version, groups, grant: Grant | None, source) -> RowInfo:
        """What the controller records of a put's rows: versions (by default `grant`'s; with
        neither, unversioned), groups, lengths, the grant, the prompt source. Raises
        `SchemaError` where an argument does not fit the batch."""
        n = cols.n
        versioned = policy_version is not None or grant is not None
        if policy_version is None:
            policy_version = grant.version if grant else 0
        first, last = _versions(policy_version, n)
        group_ids = list(range(n)) if groups is None else [count("group id", g, -INT64) for g in groups]
        if len(group_ids) != n:
            raise SchemaError(f"groups has {len(group_ids)} entries for {n} samples")
        src: tuple[str, str, list[int]] = ("", "", [])
        if source is not None:
            if len(source) != n:
                raise SchemaError(f"source has {len(source)} samples, the batch has {n}")
            src = (source.partition, source.task, list(source.indexes))
        grant_id = 0 if grant is None else grant.grant_id
        return RowInfo(first, last, group_ids, cols.seqlens(), grant_id, *src, versioned=versioned)

    def acquire(self, n: int, timeout: float = 30.0) -> Flow:
        """The flow of `Client.acquire`."""
        reply = yield from self.one(CONTROLLER, Acquire(count("n", n, 1), timeout), GrantReply, timeout + GRACE)
        grant = Grant(reply.grant_id, reply.n, reply.version, reply.n)
        self.grants.append(grant)
        return grant

    def release(self, grant: Grant) -> Flow:
        """Return a grant's unused slots. While no put under it is in flight, those of failed puts
        that may have been committed are offered too: the controller returns at most the slots
        it still holds for the grant, so none a put spent comes back."""
        if grant in self.grants:
            self.grants.remove(grant)
        unsure = grant._unsure if grant._puts == 0 else 0
        if grant.remaining + unsure > 0:
            yield from self.one(CONTROLLER, Release(grant.grant_id, grant.remaining + unsure), Ok)
            grant.remaining = 0
            grant._unsure -= unsure

    # -- consumers ---------------------------------------------------------------------

    def get_meta(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str = "train",
        *,
        sampler: str = "fifo",
        max_staleness: int | None = None,
        timeout: float = 30.0,
        allow_partial: bool = False,
        lease_timeout: float | None = None,
        **sampler_options: int | float | str,
    ) -> Flow:
        """The flow of `Client.get_meta`."""
        msg = GetMeta(
            partition,
            task,
            list(fields),
            count("batch_size", batch_size, 1),
            sampler,
            dict(sampler_options),
            max_staleness,
            timeout,
            allow_partial,
            lease_timeout,
        )
        reply = yield from self.one(CONTROLLER, msg, MetaReply, timeout + GRACE)
        return reply.meta

    def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, device: str | torch.device | None = None
    ) -> Flow:
        """The flow of `Client.get_data` (`_read`); a read that failed because a unit of the
        batch restarted since this client learned of it is read once more from the units as they
        are now (`_restarted`)."""
        known = self.units  # `hello` replaces it
        try:
            return (yield from self._read(meta, fields, device))
        except ServiceError:
            if not (yield from self._restarted(meta.units, known)):
                raise
        return (yield from self._read(meta, fields, device))

    def _read(self, meta: BatchMeta, fields: Sequence[str] | None, device: str | torch.device | None) -> Flow:
        """Reads from every unit holding the batch, in parallel; on a CUDA `device`, each run is
        copied straight from the arena or the received frame.

        Rows copied out of a mapped arena are checked against the unit's free log once the
        copies are done (`FreeLog`): where an extent they were copied from was freed meanwhile
        (the rows cleared, or replaced), or that cannot be told, the batch is read again, that
        unit's rows as frames, which its unit holds until sent: the rows, or the `SchemaError` a
        read of rows it no longer holds raises. Never another write's bytes."""
        names = list(meta.fields) if fields is None else list(fields)
        missing = [f for f in names if f not in meta.fields]
        if missing:
            raise SchemaError(f"the batch has no field(s) {missing}; it has {sorted(meta.fields)}")
        dev = target_device(device)
        if dev is not None:
            self._pin_arenas()
        specs = {f: meta.fields[f] for f in names}
        if not len(meta) or not names:
            return Assembler(specs, len(meta), self._pool, dev).result()
        targets = _by_unit(meta.units, meta.indexes)
        framed: set[int] = set()  # units whose mapped read may have been freed under it: read as frames
        while True:  # at most once more per unit read through its arena
            calls: list[Call] = []
            vias: list[Via] = []
            since: dict[int, tuple[FreeLog, int]] = {}
            for unit_id, _, rows in targets:
                log = None if unit_id in framed else self._free_log(unit_id)
                if log is None:
                    keep_freed_memory(256 << 20)  # the frames ZeroMQ receives then land in warm memory
                else:
                    since[unit_id] = log, log.epoch()  # noted before the unit names the runs
                via: Via = "frames" if log is None else "shm"
                calls.append(Call(unit_id, Read(meta.partition, rows, names, via)))
                vias.append(via)
            replies = yield calls
            assembler = Assembler(specs, len(meta), self._pool, dev)
            _assemble(assembler, self._arenas, names, len(meta), targets, vias, replies)
            with copies(dev):  # the frames and arena views stay referenced until the copies are done
                data = assembler.result()
            moved = {
                unit_id
                for (unit_id, _, _), (reply, _) in zip(targets, replies)
                if unit_id in since
                and not since[unit_id][0].intact((run for name in names for run in reply.runs[name]), since[unit_id][1])
            }
            if not moved:
                return data
            framed |= moved

    def _free_log(self, unit_id: int) -> FreeLog | None:
        """The free log of a unit whose arena this client reads, or None: reach it with frames
        (no arena mapped, `use_shm=False`, or a unit of a release before the free log)."""
        if unit_id not in self._arenas or self.use_shm is False:
            return None
        if unit_id not in self._frees:
            unit = self.units[unit_id]
            self._frees[unit_id] = FreeLog.open(self.cluster_id, unit_id, unit.shm_path, unit.capacity)
        return self._frees[unit_id]

    def ack(self, meta: BatchMeta) -> Flow:
        """Mark the batch consumed by its task (exactly-once effect per task), ending its lease.
        Raises `LeaseExpiredError` when the lease had expired and some samples were leased again
        to another consumer of the task: those are left to it, the others acked."""
        if len(meta):
            yield from self.one(CONTROLLER, Ack(meta.partition, meta.task, list(meta.indexes), self.lease_of(meta)), Ok)

    def nack(self, meta: BatchMeta) -> Flow:
        """Give the batch back unconsumed: its samples still under its lease are ready for the
        task again (those leased again since it expired stay with their new consumer)."""
        if len(meta):
            yield from self.one(
                CONTROLLER, Nack(meta.partition, meta.task, list(meta.indexes), self.lease_of(meta)), Ok
            )

    def clear(self, meta: BatchMeta) -> Flow:
        """Delete the batch's samples from the controller and the storage units."""
        if len(meta):
            yield from self.one(CONTROLLER, Clear(meta.partition, list(meta.indexes)), Ok)

    def clear_partition(self, partition: str = "train") -> Flow:
        """Delete every sample of `partition` (the name may then be reused, unsealed)."""
        yield from self.one(CONTROLLER, ClearPartition(partition), Ok)

    def fetch(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str,
        timeout: float,
        options: dict[str, Any],
        device: str | torch.device | None = None,
    ) -> Flow:
        """One step of `stream`: lease the next batch and read it; `(None, meta)` with an empty
        `meta` once the sealed partition is drained for `task`. A failed read gives the lease back.

        A whole batch is asked for first, waiting up to `timeout`: the controller answers it
        empty only when the sealed partition is drained for the task (short when what is left
        is), where an empty partial batch may also mean that nothing was ready. With
        `allow_partial`, a request that timed out is followed by one for what is ready now
        (`timeout=0`), and when that is nothing too, the first one's `TimeoutError` is raised
        (its message names fields no put has brought)."""
        whole = {**options, "allow_partial": False}
        try:
            meta = yield from self.get_meta(fields, batch_size, task, partition, timeout=timeout, **whole)
        except TimeoutError:
            if not options.get("allow_partial"):
                raise
            meta = yield from self.get_meta(fields, batch_size, task, partition, timeout=0.0, **options)
            if not len(meta):
                raise
        if not len(meta):
            return None, meta
        try:
            data = yield from self.get_data(meta, device=device)
        except GeneratorExit:  # the driver dropped this flow: nothing more may be sent from here
            raise
        except BaseException:
            try:
                yield from self.nack(meta)
            except SluiceError:  # the lease runs out by itself
                pass
            raise
        return data, meta

    def stream(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str,
        timeout: float | None,
        options: dict[str, Any],
        device: str | torch.device | None = None,
    ) -> Plan:
        """The plan of `Client.stream` and `AsyncClient.stream`: each batch handed out with the
        next one already launched (its lease, then its data, advancing while the driver waits
        for anything; launched once this one is in hand, so that `timeout` counts from there);
        taking the next batch sends the previous one's ack, whose answer is collected when the
        batch after is taken. Leaving early, or on an ack's error (`LeaseExpiredError`: raised
        once that is done), withdraws the prefetched batch (giving its lease back) and nacks the
        one in hand. Batches come on `device` (see `get_data`)."""
        wait = 1e9 if timeout is None else timeout
        target_device(device)  # a bad device fails here, not in the first fetch

        def fetch() -> Launch:
            return Launch(self.fetch(fields, batch_size, task, partition, wait, options, device))

        nxt = yield fetch()  # in flight until taken: withdrawn if the loop is left
        acks: list[Any] = []  # acks sent, their answers not yet collected
        meta = None
        leaving: BaseException | None = None
        try:
            while True:
                while len(acks) > 1:  # its answer came long ago, while a batch was fetched
                    yield Finish(acks.pop(0))
                batch, meta = yield Finish(nxt)
                nxt = None
                if not len(meta):
                    meta = None
                    return
                nxt = yield fetch()
                yield Give((batch, meta))
                acks.append((yield Launch(self.ack(meta))))
                meta = None
        except BaseException as exc:
            leaving = exc
            raise
        finally:
            # an ack's error (a late one: `LeaseExpiredError`) waits until every lease the stream
            # holds is given back, or the prefetched batch and the one in hand would stay leased
            failed: SluiceError | None = None
            while acks:
                try:
                    yield Finish(acks.pop(0))
                except SluiceError as exc:
                    failed = failed or exc
            if nxt is not None:
                held = yield Withdraw(nxt)
                if held is not None and len(held[1]):
                    yield Run(self.nack(held[1]))
            if meta is not None:
                yield Run(self.nack(meta))
            if failed is not None and (leaving is None or isinstance(leaving, GeneratorExit)):
                raise failed  # the stream ended or was left: this is its only error

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike) -> Flow:
        """The flow of `Client.save_checkpoint`."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        status = (yield from self.one(CONTROLLER, Status(), StatusReply)).status
        manifest = Manifest(status["version"], {})
        saved = 0
        for p, name in enumerate(sorted(status["partitions"])):
            export = yield from self.one(CONTROLLER, Export(name), ExportReply)
            files: list[str] = []
            details = export.rows or [None] * len(export.batches)
            for meta, rows in zip(export.batches, details):
                if not meta.fields:
                    continue
                for start in range(0, len(meta), _CHECKPOINT_ROWS):  # bounded memory, one put each on restore
                    chunk = slice(start, min(start + _CHECKPOINT_ROWS, len(meta)))
                    part = meta.select(range(chunk.start, chunk.stop))
                    data = yield from self.get_data(part)
                    files.append(f"p{p}-b{len(files)}.bin")
                    facts = (
                        None
                        if rows is None
                        else ExportRows(rows.versioned[chunk], rows.source[chunk], rows.source_index[chunk])
                    )
                    write_batch(directory / files[-1], part, data, facts, export.sources)
                    saved += len(part)
            sources = sorted({src for src, _ in export.sources})
            manifest.partitions[name] = PartitionState(export.sealed, files, export.consumed, sources)
        write_manifest(directory, manifest)
        return saved

    def restore_checkpoint(self, path: str | os.PathLike) -> Flow:
        """Put a checkpoint's samples into this (empty) cluster, with their policy versions and
        groups, mark what each consumer task had consumed, seal what was sealed and set the
        version. Samples get new indexes and keep their version span (first, last), whether they
        have a version at all (prompts do not) and the prompt they came from (for `requeue`).
        Raises `SchemaError` if `path` holds no checkpoint. Returns the number of samples."""
        directory = Path(path)
        manifest = read_manifest(directory)
        if manifest.version > 0:
            yield from self.one(CONTROLLER, SetVersion(manifest.version), VersionReply)
        restored = 0
        new_indexes: dict[str, dict[int, int]] = {}  # partition -> old index -> new index
        for name in restore_order(manifest):  # prompt partitions before the samples made from them
            state = manifest.partitions[name]
            new_index = new_indexes[name] = {}
            for file in state.batches:  # each sample is in one file, with all its ready fields
                header, data = read_batch(directory / file)
                old = header.meta
                for put in restore_puts(header, new_indexes):
                    pos = put.positions
                    cols = Columns(data if len(pos) == len(old) else data[torch.as_tensor(pos)])
                    groups = [old.groups[i] for i in pos]
                    # under no grant of this client's: unversioned samples stay unversioned
                    rows = self._row_info(cols, put.policy_version, groups, None, put.source)
                    meta = yield from self._put_rows(name, cols, rows, None, 30.0)
                    new_index.update(zip((old.indexes[i] for i in pos), meta.indexes))
                    restored += len(meta)
            for task, indexes in state.consumed.items():
                mapped = [new_index[i] for i in indexes if i in new_index]
                if mapped:
                    yield from self.one(CONTROLLER, Ack(name, task, mapped), Ok)
            if state.sealed:
                yield from self.one(CONTROLLER, Seal(name), Ok)
        return restored


def _failure(reply: Any) -> BaseException | None:
    """The error a write's or a commit's reply stands for, or None (a notice has no reply)."""
    if reply is None or isinstance(reply, (WriteReply, Ok)):
        return None
    try:
        check(reply, WriteReply)
    except Exception as exc:  # noqa: BLE001 - collected; the flow raises the first
        return exc
    return None


def _versions(policy_version, n: int) -> tuple[list[int], list[int]]:
    """(first, last) version per sample from one version, a (first, last) span or one per sample."""
    if as_int(policy_version) is not None:
        version = count("policy_version", policy_version, 0)
        return [version] * n, [version] * n
    if (
        isinstance(policy_version, tuple)
        and len(policy_version) == 2
        and all(as_int(v) is not None for v in policy_version)
    ):
        first, last = (count("policy_version", v, 0) for v in policy_version)
        if last < first:
            raise SchemaError(f"a version span must be (first, last) with first <= last, got {policy_version}")
        return [first] * n, [last] * n
    try:
        versions = [count("policy_version", v, 0) for v in policy_version]
    except TypeError:  # not iterable (a float, a 0-dim float tensor...)
        raise SchemaError(
            f"policy_version must be an int, a (first, last) span or one int per sample, got {policy_version!r}"
        ) from None
    if len(versions) != n:
        raise SchemaError(f"policy_version has {len(versions)} entries for {n} samples")
    return versions, list(versions)


def _all_equal(values: list[int]) -> bool:
    """Whether `values` holds one value throughout (a batch's rows all on one unit)."""
    return values.count(values[0]) == len(values) if values else True


def _by_unit(units: list[int], indexes: Sequence[int]) -> list[tuple[int, np.ndarray | None, list[int]]]:
    """Each unit of a batch's rows (`units`: one per row, `indexes`: their global indexes) with
    the batch positions of its rows (None for all of them, in order, when one unit holds the
    whole batch: the common case, which takes no numpy index work) and their global indexes."""
    if not units:
        return []
    if _all_equal(units):
        return [(units[0], None, list(indexes))]
    column = np.asarray(units, np.int64)
    at = np.asarray(indexes, np.int64)
    placed: list[tuple[int, np.ndarray | None, list[int]]] = []
    for unit_id in np.unique(column).tolist():
        positions = np.flatnonzero(column == unit_id)
        placed.append((unit_id, positions, at[positions].tolist()))
    return placed


def _assemble(
    assembler: Assembler, arenas, names: list[str], batch_size: int, targets, vias: list[Via], replies
) -> None:
    """Hand the assembler each unit's rows (`targets`: units and their batch positions, see
    `_by_unit`; `vias`: how each was read): received frames, or views of its mapped arena. A
    read over frames may bring none (its rows' ragged fields all empty)."""
    for (unit_id, positions, _), via, (reply, frames) in zip(targets, vias, replies):
        reply = check(reply, ReadReply)
        runs: dict[str, list[torch.Tensor]] = {}
        if via == "frames":
            it = iter(frames)
            for name in names:
                runs[name] = [_frame_bytes(next(it)) for _ in reply.runs[name]]
        else:
            arena = arenas[unit_id][1]
            runs = {name: [arena[o : o + n] for o, n in reply.runs[name]] for name in names}
        rows = np.arange(batch_size) if positions is None else positions
        assembler.add_unit(rows, reply.lengths, runs, owned=via == "frames")


def _host_frames(buffers: list[torch.Tensor], device: torch.device | None) -> list[np.ndarray]:
    """The frames of a write: the buffers' bytes; a GPU batch's copied device to host once, into
    pinned memory (torch's pinned allocator reuses it once the frames are sent and dropped)."""
    if device is None:
        return [b.numpy() for b in buffers]
    host = []
    with copies(device):
        for b in buffers:
            if b.is_cuda:
                b = pinned_empty(b.numel()).copy_(b, non_blocking=True)
            host.append(b)
    return [b.numpy() for b in host]


def _frame_bytes(frame: Any) -> torch.Tensor:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)
