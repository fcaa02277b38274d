"""Everything a client does except touching sockets, written once for `Client` and `AsyncClient`.

Each operation is a *flow*: a generator that yields a list of `Call`s (sent in parallel) and
receives their decoded replies, until it returns the result. `Client` drives flows with blocking
sockets, `AsyncClient` with asyncio sockets; neither runs a hidden event loop or thread. Reply
checking, placement across units, the shared-memory fast path, and batch assembly live here.
"""

from __future__ import annotations

import functools
import mmap
import operator
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Mapping, Sequence

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

from ._auth import Credentials, from_env
from ._checkpoint import (
    Manifest, PartitionState, read_batch, read_manifest, restore_order, restore_puts, write_batch, write_manifest,
)
from ._errors import CapacityError, ProtocolError, SchemaError, ServiceError, SluiceError, error_from_code
from ._messages import (
    Ack,
    AbortPut,
    Export,
    ExportReply,
    ExportRows,
    Acquire,
    Announce,
    BeginPut,
    Clear,
    ClearPartition,
    ClusterConfig,
    CommitPut,
    CommitWrite,
    ErrorReply,
    GetMeta,
    GrantReply,
    Hello,
    HelloReply,
    Lookup,
    LookupReply,
    MetaReply,
    Nack,
    Ok,
    PutPlan,
    Read,
    ReadReply,
    Release,
    Reply,
    RowInfo,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    UnitInfo,
    VersionReply,
    WaitVersion,
    Write,
    WriteReply,
)
from ._meta import BatchMeta
from ._tensors import Assembler, BufferPool, Columns, keep_freed_memory
from ._wire import Codec
from ._host import host_id, open_arena

__all__ = ["Call", "ClientCore", "Grant", "flow", "CONTROLLER", "PROBE_AFTER", "DEAD_AFTER"]

_CHECKPOINT_ROWS = 1024
"""Samples per checkpoint batch file (what one get_data reads on save and one put writes on restore)."""

CONTROLLER = -1
"""`Call.target` of the controller; storage units are addressed by their unit id."""

_GRACE = 10.0
"""Seconds a client waits for a reply beyond the request's own timeout."""
PROBE_AFTER = 1.0
"""Seconds of silence from a service the client awaits before it pings it (`Ping`)."""
DEAD_AFTER = 5.0
"""Seconds of silence (pings unanswered) after which the service is reported dead (`ServiceError`)."""


@dataclass(frozen=True)
class Call:
    target: int
    msg: msgspec.Struct
    data: Sequence[Any] = ()
    wait: float | None = _GRACE
    """Seconds to wait for the reply (None: forever)."""


Flow = Generator[list[Call], list[tuple[Any, list[Any]]], Any]


def flow(fn: Callable[..., Flow]) -> Callable[..., Flow]:
    """Mark a `ClientCore` method as a flow; each driver exposes it as a blocking or async method."""
    fn.__sluice_flow__ = True
    return fn



@dataclass
class Grant:
    """Generation slots granted by `acquire`: `n` samples under policy `version`.

    Puts by the same client draw on its open grants (oldest first) unless given `grant=`.
    As a context manager it returns the slots it did not use when the block ends.
    """

    grant_id: int
    n: int
    version: int
    remaining: int
    _client: Any = field(repr=False, default=None)

    def __enter__(self) -> "Grant":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    async def __aenter__(self) -> "Grant":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.release()

    def release(self):
        """Give the unused slots back (returns an awaitable on an `AsyncClient`)."""
        return self._client.release(self)


class ClientCore:
    """State and flows shared by both clients: cluster info, unit maps, grants."""

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        self.address = address
        self.credentials = credentials if credentials is not None else from_env()
        """CurveZMQ keys for a cluster bound beyond loopback (default: `SLUICE_CREDENTIALS`)."""
        self.codec = Codec(Reply)
        self.use_shm = use_shm
        self.config: ClusterConfig | None = None
        self.cluster_id = ""
        self.units: dict[int, UnitInfo] = {}
        self._arenas: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
        self._pool = BufferPool()  # get_data's output memory, reused once the caller drops it
        self._grants: list[Grant] = []
        self._heard: dict[str, float] = {}  # address -> monotonic time of its last message
        self._pinged: dict[str, float] = {}  # address -> when it was last pinged
        self.dead: set[str] = set()  # addresses reported dead and silent since

    # -- driver plumbing ---------------------------------------------------------------

    def service_name(self, target: int) -> str:
        name = "the controller" if target == CONTROLLER else f"storage unit {target}"
        return f"{name} at {self.target_address(target)}"

    def unreachable(self, target: int) -> ServiceError:
        """The error for a send that found no connection to `target` for `DEAD_AFTER` seconds."""
        self.dead.add(self.target_address(target))
        return ServiceError(
            f"{self.service_name(target)} took no message for {DEAD_AFTER:g} s: it is down, or it refused "
            "this client's credentials (a cluster bound beyond loopback admits only clients given its "
            "SLUICE_CREDENTIALS)"
        )

    def heard(self, address: str, now: float) -> None:
        """A message came from `address`: it is alive."""
        self._heard[address] = now
        self.dead.discard(address)

    def probe(self, target: int, since: float, now: float) -> bool:
        """Liveness of a service whose reply the client has awaited since `since`: True when it
        should be pinged now; `ServiceError` naming it when it stayed silent for `DEAD_AFTER` s."""
        address = self.target_address(target)
        quiet = now - max(self._heard.get(address, 0.0), since)
        if quiet > DEAD_AFTER:
            self.dead.add(address)
            what = "restart the cluster" if target == CONTROLLER else "the controller retires it and counts its samples lost"
            raise ServiceError(
                f"{self.service_name(target)} has not answered for {quiet:.1f} s, pings included: "
                f"it died or hangs ({what}), or it refused this client's credentials (a cluster bound "
                "beyond loopback admits only clients given its SLUICE_CREDENTIALS)"
            )
        if quiet >= PROBE_AFTER and now - self._pinged.get(address, float("-inf")) >= PROBE_AFTER:
            self._pinged[address] = now
            return True
        return False

    def target_address(self, target: int) -> str:
        if target == CONTROLLER:
            return self.address
        unit = self.units.get(target)
        if unit is None:
            raise SchemaError(f"unknown storage unit {target}; the cluster has {sorted(self.units)}")
        return unit.address

    @staticmethod
    def check(reply: Any, expected: type) -> Any:
        """The reply if it is `expected`; the service's typed error if it reported one."""
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, expected):
            raise ProtocolError(f"expected {expected.__name__}, got {type(reply).__name__}")
        return reply

    @staticmethod
    def undo(reply: Any) -> msgspec.Struct | None:
        """The request that gives back what an abandoned reply holds (a lease, a grant)."""
        if isinstance(reply, MetaReply) and len(reply.meta):
            meta = reply.meta
            return Nack(meta.partition, meta.task, list(meta.indexes))
        if isinstance(reply, GrantReply):
            return Release(reply.grant_id, reply.n)
        return None

    @staticmethod
    def resume(flow: Flow, replies: list | None = None, error: BaseException | None = None) -> list[Call]:
        """The flow's next calls: start it, send it `replies`, or throw `error` into it (a driver
        timeout or cancel) so that its own clean-up (e.g. `AbortPut`) runs. `StopIteration`
        carries the flow's result; an error the flow does not handle propagates."""
        if error is not None:
            return flow.throw(error)
        return next(flow) if replies is None else flow.send(replies)

    def _one(self, target: int, msg: msgspec.Struct, expected: type, wait: float | None = _GRACE):
        replies = yield [Call(target, msg, (), wait)]
        return self.check(replies[0][0], expected)

    # -- cluster -----------------------------------------------------------------------

    @flow
    def hello(self) -> Flow:
        """Fetch the cluster's configuration and storage units (done on connect)."""
        reply = yield from self._one(CONTROLLER, Hello(), HelloReply)
        self.config, self.cluster_id = reply.config, reply.cluster_id
        self.units = {u.unit_id: u for u in reply.units}
        self._map_arenas()
        return reply

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
                mm = mmap.mmap(fd, unit.capacity)
            finally:
                os.close(fd)
            self._arenas[unit.unit_id] = (mm, torch.frombuffer(mm, dtype=torch.uint8))

    def close_arenas(self) -> None:
        for mm, view in self._arenas.values():
            del view
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with that tensor
                pass
        self._arenas.clear()
        self._pool.clear()

    # -- producers ---------------------------------------------------------------------

    @flow
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
        """Store a batch. New samples by default; with `meta=`, new columns for those samples.

        `policy_version` is the version that generated the samples: one int, a (first, last)
        span for a partial rollout resumed under newer weights, or one int per sample (default:
        the grant's version; with neither, the samples carry no version, e.g. prompts: they read
        as version 0 and are never too stale). `groups` are GRPO group ids (default: one group per
        sample). `source` is the prompt batch the samples came from (needed by the `requeue`
        stale policy). Raises `CapacityError` if storage stays full for `timeout` seconds,
        `SchemaError` for data that contradicts the partition's fields, `SealedError` after
        `seal`. On any error nothing of the batch becomes visible.
        """
        cols = Columns(data)
        if meta is not None:
            if len(meta) != cols.n:
                raise SchemaError(f"the data has {cols.n} samples, meta has {len(meta)}")
            partition = meta.partition
        rows = None if meta is not None else self._row_info(cols, policy_version, groups, grant, source)  # validates first
        mapped = list(self._arenas) if self.use_shm is not False else []  # these units get no frames
        begin = BeginPut(partition, cols.specs, cols.n, cols.row_bytes(), list(meta.indexes) if meta else [], timeout, mapped)
        plan = yield from self._one(CONTROLLER, begin, PutPlan, timeout + _GRACE)  # waits for room up to timeout
        units = np.asarray(plan.units, np.int64)
        try:
            yield from self._write(partition, cols, plan.indexes, units, timeout)
        except GeneratorExit:  # the driver dropped this flow: nothing more may be sent from here
            raise
        except BaseException:  # a failed write, a driver timeout, a cancel: free the rows now
            if meta is None:
                try:
                    yield from self._one(CONTROLLER, AbortPut(partition, plan.indexes), Ok)
                except SluiceError:  # the controller's put deadline frees them anyway
                    pass
            raise
        yield from self._one(CONTROLLER, CommitPut(partition, plan.indexes, cols.specs, rows), Ok)
        if meta is not None:
            return msgspec.structs.replace(meta, fields={**meta.fields, **cols.specs})
        return BatchMeta(
            partition=partition,
            indexes=plan.indexes,
            policy_versions=rows.versions_first,
            version_last=rows.versions_last,
            groups=rows.groups,
            units=plan.units,
            fields=cols.specs,
        )

    def _write(self, partition: str, cols: Columns, indexes: list[int], units: np.ndarray, timeout: float):
        """Send each unit its rows: raw frames, or straight into its mapped arena."""
        idx = np.asarray(indexes, np.int64)
        calls, shm_jobs = [], []
        for unit_id in np.unique(units).tolist():
            positions = np.flatnonzero(units == unit_id)
            buffers, lengths = cols.slice(positions)
            nbytes = sum(b.numel() for b in buffers)
            if nbytes > self.units[unit_id].capacity:
                raise CapacityError(
                    f"{len(positions)} samples ({nbytes} bytes) exceed storage unit {unit_id}'s whole capacity "
                    f"of {self.units[unit_id].capacity} bytes; put smaller batches or raise storage_capacity"
                )
            via = "shm" if unit_id in self._arenas and self.use_shm is not False else "frames"
            msg = Write(partition, idx[positions].tolist(), cols.specs, lengths, via, timeout)
            data = [b.numpy() for b in buffers] if via == "frames" else ()
            calls.append(Call(unit_id, msg, data, timeout + _GRACE))
            shm_jobs.append((unit_id, via, buffers))
        replies = yield calls
        errors, commits = [], []
        for (unit_id, via, buffers), (reply, _) in zip(shm_jobs, replies):
            try:
                reply = self.check(reply, WriteReply)
            except Exception as exc:  # noqa: BLE001 - collect, then raise the first
                errors.append(exc)
                continue
            if via == "shm":
                arena = self._arenas[unit_id][1]
                if not errors:
                    for name, buf in zip(cols.specs, buffers):
                        off = reply.offsets[name]
                        arena[off : off + buf.numel()].copy_(buf)
                commits.append(Call(unit_id, CommitWrite(reply.token, abort=bool(errors))))
        if commits:
            replies = yield commits
            for reply, _ in replies:
                try:
                    self.check(reply, Ok)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
        if errors:
            raise errors[0]

    def _row_info(self, cols, policy_version, groups, grant, source) -> RowInfo:
        n = cols.n
        grant = grant or next((g for g in self._grants if g.remaining > 0), None)
        versioned = policy_version is not None or grant is not None
        if policy_version is None:
            policy_version = grant.version if grant else 0
        first, last = _versions(policy_version, n)
        group_ids = list(range(n)) if groups is None else [_count("group id", g, -_INT64) for g in groups]
        if len(group_ids) != n:
            raise SchemaError(f"groups has {len(group_ids)} entries for {n} samples")
        grant_id = 0
        if grant is not None:
            grant_id = grant.grant_id
            grant.remaining = max(0, grant.remaining - n)
            if grant.remaining == 0 and grant in self._grants:
                self._grants.remove(grant)
        src = ("", "", [])
        if source is not None:
            if len(source) != n:
                raise SchemaError(f"source has {len(source)} samples, the batch has {n}")
            src = (source.partition, source.task, list(source.indexes))
        return RowInfo(first, last, group_ids, cols.seqlens(), grant_id, *src, versioned=versioned)

    @flow
    def acquire(self, n: int, timeout: float = 30.0) -> Flow:
        """Wait (without polling) for `n` generation slots inside the staleness budget.

        Returns a `Grant` with the policy version to generate with. Raises `TimeoutError` when
        the budget does not open within `timeout`.
        """
        reply = yield from self._one(CONTROLLER, Acquire(_count("n", n, 1), timeout), GrantReply, timeout + _GRACE)
        grant = Grant(reply.grant_id, reply.n, reply.version, reply.n, self)
        self._grants.append(grant)
        return grant

    @flow
    def release(self, grant: Grant) -> Flow:
        """Return a grant's unused slots."""
        if grant in self._grants:
            self._grants.remove(grant)
        if grant.remaining > 0:
            yield from self._one(CONTROLLER, Release(grant.grant_id, grant.remaining), Ok)
            grant.remaining = 0

    @flow
    def seal(self, partition: str = "train") -> Flow:
        """No more samples will come to `partition`; streams end once it is drained."""
        yield from self._one(CONTROLLER, Seal(partition), Ok)

    # -- consumers ---------------------------------------------------------------------

    @flow
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
        """Lease `batch_size` samples whose `fields` are ready and that `task` has not consumed.

        Waits up to `timeout` seconds; raises `TimeoutError` if too few are ready then (with
        `allow_partial=True`, returns what is ready, possibly nothing). A sealed, drained
        partition returns the remainder at once (an empty batch when nothing is left). Samples
        staler than `max_staleness` (default: the cluster's) are never served. The lease lasts
        `lease_timeout` seconds (default: the cluster's); unacked samples then return to the
        pool. Extra keyword arguments go to the sampler (`group_size=` for `grpo_group`,
        `dp_size=` for `seqlen_balanced`).
        """
        msg = GetMeta(
            partition, task, list(fields), _count("batch_size", batch_size, 1), sampler, dict(sampler_options),
            max_staleness, timeout, allow_partial, lease_timeout,
        )
        reply = yield from self._one(CONTROLLER, msg, MetaReply, timeout + _GRACE)
        return reply.meta

    @flow
    def get_data(self, meta: BatchMeta, fields: Sequence[str] | None = None) -> Flow:
        """Read the batch's fields from every unit holding it, in parallel; rows in meta order.

        Uniform fields come back dense, ragged ones as jagged nested tensors. Asking for a
        field the batch lacks raises `SchemaError`.
        """
        names = list(meta.fields) if fields is None else list(fields)
        missing = [f for f in names if f not in meta.fields]
        if missing:
            raise SchemaError(f"the batch has no field(s) {missing}; it has {sorted(meta.fields)}")
        assembler = Assembler({f: meta.fields[f] for f in names}, len(meta), self._pool)
        if not len(meta) or not names:
            return assembler.result()
        units = np.asarray(meta.units, np.int64)
        idx = np.asarray(meta.indexes, np.int64)
        targets = np.unique(units).tolist()
        calls = []
        for unit_id in targets:
            via = "shm" if unit_id in self._arenas and self.use_shm is not False else "frames"
            if via == "frames":
                keep_freed_memory()  # the frames ZeroMQ receives then land in warm memory
            calls.append(Call(unit_id, Read(meta.partition, idx[units == unit_id].tolist(), names, via)))
        replies = yield calls
        for unit_id, (reply, frames) in zip(targets, replies):
            reply = self.check(reply, ReadReply)
            runs: dict[str, list[torch.Tensor]] = {}
            if frames:
                it = iter(frames)
                for name in names:
                    runs[name] = [_frame_bytes(next(it)) for _ in reply.runs[name]]
            else:
                arena = self._arenas[unit_id][1]
                runs = {name: [arena[o : o + n] for o, n in reply.runs[name]] for name in names}
            assembler.add_unit(np.flatnonzero(units == unit_id), reply.lengths, runs)
        return assembler.result()

    @flow
    def ack(self, meta: BatchMeta) -> Flow:
        """Mark the batch consumed by its task (exactly-once effect per task)."""
        if len(meta):
            yield from self._one(CONTROLLER, Ack(meta.partition, meta.task, list(meta.indexes)), Ok)

    @flow
    def nack(self, meta: BatchMeta) -> Flow:
        """Give the batch back unconsumed: its samples are ready for the task again."""
        if len(meta):
            yield from self._one(CONTROLLER, Nack(meta.partition, meta.task, list(meta.indexes)), Ok)

    @flow
    def clear(self, meta: BatchMeta) -> Flow:
        """Delete the batch's samples from the controller and the storage units."""
        if len(meta):
            yield from self._one(CONTROLLER, Clear(meta.partition, list(meta.indexes)), Ok)

    @flow
    def clear_partition(self, partition: str = "train") -> Flow:
        """Delete every sample of `partition` (the name may then be reused, unsealed)."""
        yield from self._one(CONTROLLER, ClearPartition(partition), Ok)

    # -- versions ------------------------------------------------------------------------

    @flow
    def set_version(self, version: int) -> Flow:
        """Record the trainer's new weight version (monotone; `VersionError` going backwards)."""
        reply = yield from self._one(CONTROLLER, SetVersion(_count("version", version, 0)), VersionReply)
        return reply.version

    @flow
    def get_version(self) -> Flow:
        """The trainer's current weight version."""
        reply = yield from self._one(CONTROLLER, WaitVersion(-1, 0.0), VersionReply)
        return reply.version

    @flow
    def wait_version(self, version: int, timeout: float = 30.0) -> Flow:
        """Block until the version is at least `version`; returns the current version."""
        after = _count("version", version, 0) - 1
        reply = yield from self._one(CONTROLLER, WaitVersion(after, timeout), VersionReply, timeout + _GRACE)
        return reply.version

    @flow
    def _versions_after(self, after: int, timeout: float) -> Flow:
        reply = yield from self._one(CONTROLLER, WaitVersion(after, timeout), VersionReply, timeout + _GRACE)
        return reply.history

    # -- checkpoints ---------------------------------------------------------------------

    @flow
    def save_checkpoint(self, path: str | os.PathLike) -> Flow:
        """Write the cluster's samples and consumer progress to the directory `path`.

        Saves the version, every partition's committed samples (all their ready fields) and, per
        consumer task, which samples it consumed; leased samples count as not consumed, so they
        are delivered again after a restore. Run it while producers and consumers pause: samples
        put or acked meanwhile may or may not be in it. Restore with `tq.init(restore=path)`
        (any number of storage units) or `restore_checkpoint`. Returns the number of samples."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        status = (yield from self._one(CONTROLLER, Status(), StatusReply)).status
        manifest = Manifest(status["version"], {})
        saved = 0
        for p, name in enumerate(sorted(status["partitions"])):
            export = yield from self._one(CONTROLLER, Export(name), ExportReply)
            files = []
            details = export.rows or [None] * len(export.batches)
            for meta, rows in zip(export.batches, details):
                if not meta.fields:
                    continue
                for start in range(0, len(meta), _CHECKPOINT_ROWS):  # bounded memory, one put each on restore
                    chunk = slice(start, min(start + _CHECKPOINT_ROWS, len(meta)))
                    part = meta.select(range(chunk.start, chunk.stop))
                    data = yield from ClientCore.get_data(self, part)
                    files.append(f"p{p}-b{len(files)}.bin")
                    facts = None if rows is None else ExportRows(
                        rows.versioned[chunk], rows.source[chunk], rows.source_index[chunk]
                    )
                    write_batch(directory / files[-1], part, data, facts, export.sources)
                    saved += len(part)
            sources = sorted({src for src, _ in export.sources})
            manifest.partitions[name] = PartitionState(export.sealed, files, export.consumed, sources)
        write_manifest(directory, manifest)
        return saved

    @flow
    def restore_checkpoint(self, path: str | os.PathLike) -> Flow:
        """Put a checkpoint's samples into this (empty) cluster, with their policy versions and
        groups, mark what each consumer task had consumed, seal what was sealed and set the
        version. Samples get new indexes and keep their version span (first, last), whether they
        have a version at all (prompts do not) and the prompt they came from (for `requeue`).
        Raises `SchemaError` if `path` holds no checkpoint. Returns the number of samples."""
        directory = Path(path)
        manifest = read_manifest(directory)
        if manifest.version > 0:
            yield from self._one(CONTROLLER, SetVersion(manifest.version), VersionReply)
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
                    part = data if len(pos) == len(old) else data[torch.as_tensor(pos)]
                    meta = yield from ClientCore.put(
                        self, part, name, policy_version=put.policy_version, groups=[old.groups[i] for i in pos],
                        source=put.source,
                    )
                    new_index.update(zip((old.indexes[i] for i in pos), meta.indexes))
                    restored += len(meta)
            for task, indexes in state.consumed.items():
                mapped = [new_index[i] for i in indexes if i in new_index]
                if mapped:
                    yield from self._one(CONTROLLER, Ack(name, task, mapped), Ok)
            if state.sealed:
                yield from self._one(CONTROLLER, Seal(name), Ok)
        return restored

    # -- status and small shared values --------------------------------------------------

    @flow
    def status(self) -> Flow:
        """A dict: partitions with per-task counts, versions, staleness histogram, admission, bytes."""
        reply = yield from self._one(CONTROLLER, Status(), StatusReply)
        return reply.status

    @flow
    def announce(self, key: str, value: bytes) -> Flow:
        """Publish a small value (≤ 1 MiB) under `key` for other clients to `lookup`."""
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SchemaError(f"announce takes bytes, got {type(value).__name__}; encode it (e.g. str.encode())")
        yield from self._one(CONTROLLER, Announce(key, bytes(value)), Ok)

    @flow
    def lookup(self, key: str, timeout: float = 0.0) -> Flow:
        """The value announced under `key`, waiting up to `timeout` for it; None if absent."""
        reply = yield from self._one(CONTROLLER, Lookup(key, timeout), LookupReply, timeout + _GRACE)
        return reply.value


_INT64 = 1 << 63


def _as_int(value: Any) -> int | None:
    """`value` as an int if it is one (Python, numpy or a one-element torch integer), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def _count(name: str, value: Any, low: int, high: int = _INT64 - 1) -> int:
    """`value` as an int in low..high; `SchemaError` saying so otherwise, before anything is sent."""
    number = _as_int(value)
    if number is None or not low <= number <= high:
        raise SchemaError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return number


def _versions(policy_version, n: int) -> tuple[list[int], list[int]]:
    """(first, last) version per sample from one version, a (first, last) span or one per sample."""
    if _as_int(policy_version) is not None:
        version = _count("policy_version", policy_version, 0)
        return [version] * n, [version] * n
    if isinstance(policy_version, tuple) and len(policy_version) == 2 and all(_as_int(v) is not None for v in policy_version):
        first, last = (_count("policy_version", v, 0) for v in policy_version)
        if last < first:
            raise SchemaError(f"a version span must be (first, last) with first <= last, got {policy_version}")
        return [first] * n, [last] * n
    try:
        versions = [_count("policy_version", v, 0) for v in policy_version]
    except TypeError:  # not iterable (a float, a 0-dim float tensor...)
        raise SchemaError(f"policy_version must be an int, a (first, last) span or one int per sample, got {policy_version!r}") from None
    if len(versions) != n:
        raise SchemaError(f"policy_version has {len(versions)} entries for {n} samples")
    return versions, list(versions)


def _frame_bytes(frame: Any) -> torch.Tensor:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


def flows_of(cls: type) -> dict[str, Callable]:
    """The flow methods of `cls`, by name."""
    return {name: fn for klass in reversed(cls.__mro__) for name, fn in vars(klass).items() if getattr(fn, "__sluice_flow__", False)}


def wrap_flows(cls: type, make: Callable[[Callable], Callable]) -> type:
    """Give `cls` one driver method per flow, keeping name, signature and docstring."""
    for name, fn in flows_of(ClientCore).items():
        setattr(cls, name, functools.wraps(fn)(make(fn)))
    return cls
