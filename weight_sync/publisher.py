"""`WeightPublisher`: the trainer's side of the weight channel.

`publish(tensors, version)` makes one snapshot copy of the weights into a pre-faulted staging
slot (casting as declared) and returns: the trainer may change its weights again at once. CUDA
weights going to host staging are copied on a side stream that the trainer's stream then waits
for: `publish` returns once the copies are issued, and the finisher waits for them (an event
per bucket) before readers see each bucket and before the version is offered.
Everything else happens in the background: transports stream the slot bucket by bucket as it
fills, a finisher thread checksums it (validation mode) and marks it complete, and the
coordinator (rank 0) records version v in the controller only once every rank has v complete,
then tells subscribers. A slot is reused only after every lease on it is released.

With deltas on (by default, from the first lease a subscriber takes over tcp or ucx), compare
threads diff each staged bucket against the previous version, still in the other slot, so
subscribers holding that version pull only what changed, their frames encoded on a pool of
their own; `publish` waits for the compares only when the slot it claims is the base still
being compared.

Threads in the trainer process: the control server (an `rpc.ThreadService`, which also runs
the coordinator's bookkeeping), the coordinator's recorder (controller round trips), the
finisher, with deltas on the compare and encode pools (`delta.threads()` each), and whatever
the transports serve with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import torch

import transfer_queue as tq
from transfer_queue import SchemaError, TimeoutError, VersionError, WeightSyncError
from transfer_queue.cuda import background_copies, background_done, is_cuda, side_stream, synchronize, trailing_copies
from transfer_queue.host import host_id
from transfer_queue.wire.rpc import Credentials, credentials_from_env

from .buckets import Destinations, layout_buckets, pack
from .checksum import Snapshot
from .coordinator import RECENT, Coordinator
from .delta import Changes, CompareScratch, compare, threads
from .device_packs import DevicePacks
from .gpu_mirror import GpuMirror
from .layout import Layout
from .manifest import Manifest
from .mapping import FlatShard, TPShard
from .protocol import (
    Checksums,
    Confirm,
    Describe,
    Described,
    Granted,
    Join,
    Latest,
    Lease,
    Ok,
    Pending,
    Pull,
    RankInfo,
    RelayPull,
    Release,
    RpcClient,
    SlotInfo,
    SlotList,
    Slots,
    Staged,
    Verify,
    directory_key,
    serve,
)
from .staging import Slot, SlotTable
from .transports import Source, Transport, resolve
from .transports.stream import Scratch, contiguous_span, delta_frames, gather, read_chunks, whole_frames

__all__ = ["WeightPublisher", "VersionStats"]

log = logging.getLogger("sluice.weight_sync")

_KEPT_MANIFESTS = 8
_DENSE_PROBE = 8
"""After a version whose buckets were mostly dense, the next `_DENSE_PROBE - 1` go whole without
a compare (which readers of a delta would wait for); then one is compared again, since update
sizes change slowly (learning-rate schedules)."""

_DENSE_RUN = 2
"""Buckets in a row found dense after which the rest of the version go whole without a compare:
an update that large is spread over the whole model, and the readers of a probed version then
wait for two compares that give up early, not for one per bucket."""


Sharding = TPShard | FlatShard | Mapping[str, Layout] | None


class WeightPublisher:
    """Publishes a trainer rank's weights to every `WeightSubscriber` of channel `name`.

    Args:
        address: the controller's address (`cluster.address`), or None to run without one
            (subscribers are then given `publisher.endpoint` directly).
        transport: "auto" (shm + ucx when installed + tcp, and cuda_ipc given `model=` of
            CUDA tensors in a process with CUDA), a name
            ("shm", "tcp", "ucx", "nixl", "torch", or "cuda_ipc", which stages on the GPU), a
            `Transport` instance (e.g. `TcpTransport(fanout=1)`; `NixlTransport(memory="cuda")`
            stages on the GPU too), or a list. GPU-staging transports served beside host ones
            read GPU slots staged from the first lease over them on (`gpu_mirror`); `torch`
            under NCCL, which broadcasts as it stages, serves only beside GPU-staging ones.
        name: the channel; one coordinator (rank 0) per name and controller.
        rank, world_size: this trainer rank among those that publish shards of the model.
        coordinator: rank 0's `endpoint`, for ranks > 0 without a controller.
        shard: which part of each tensor this rank holds: a `TPShard`, a `FlatShard`, or an
            explicit {name: Layout}; None means every tensor whole.
        cast: dtype conversions applied while staging, e.g. {torch.float32: torch.bfloat16}.
        bucket_bytes: staging bucket size: the unit of pipelining.
        slots: staging slots (2 = double buffering; 1 halves memory but `publish` then waits
            for readers of the previous version). Over GPU-staging transports they are GPU memory:
            `slots` × the model's bytes on the weights' device; served beside host transports
            (`auto` with `model=` of CUDA tensors), that GPU memory is taken only at the first lease a subscriber
            takes over one of them (`gpu_mirror`), and host staging keeps its own slots.
        validate: checksum every staged tensor so subscribers can verify what they applied.
        lease_timeout: how long a reader may pin a slot before it is presumed dead (a stream's
            lease is renewed by each piece it sends; a reader whose slot was staged again under
            its lease is told when it releases it: docs/reliability.md).
        timeout: how long `publish` waits for a free slot, and rank 0 for its peers.
        host: the interface the control endpoint binds (loopback by default).
        credentials: the cluster's CurveZMQ keys (default: `SLUICE_CREDENTIALS`); the control
            endpoint then admits only clients holding them. Binding `host` beyond loopback
            without them raises `SchemaError`.
        model: the tensors `publish` will be given (a module, a state dict or (name, tensor)
            pairs; meta tensors of the same shapes and dtypes do): every staging slot is then
            allocated and faulted in here (and registered with CUDA when they are CUDA
            tensors), so the first versions publish as fast as the next. Without it, the first
            `publish` allocates its slot and starts allocating the others on a thread, so that
            only the first version pays for its staging.
        delta: compare each staged bucket with the previous version's (one vectorised pass
            per bucket, on compare threads while `publish` stages the next buckets and
            transports send the previous ones) so that a subscriber holding that version pulls
            only the bytes that changed (`delta.py`). "auto" (the default): on from the first
            lease a subscriber takes over a pull transport that takes deltas (tcp, its relays
            included, or ucx), or from the start when a push transport that takes deltas is
            served (torch under gloo); never with one slot. Until then nothing is compared, no
            compare thread runs and no GPU memory is taken for packed copies, so a trainer
            whose subscribers all map its staging (shm, on its host) pays nothing for it. Once
            on, each version staged is compared with the one before it (CUDA weights: from the
            second one on, as a base must first be packed on the GPU). Deltas pay where the
            link is the bottleneck: across hosts, or into GPU receive buffers (on an H200, 4 GiB
            at lr 1e-6 over loopback tcp: a delta arrived 5.0x faster than the whole version).
            Between processes of one CPU-only host, comparing, framing and applying still cost
            more than copying the bytes: pass False for tcp or gloo subscribers on the trainer's
            host there. Each rank turns on at its own first such lease. True: on from the first
            version (needs `slots >= 2`). False: every subscriber pulls whole versions. With
            deltas on or able to turn on, the compares, frame encodes and frame applies run on
            `delta.threads()` threads each (`SLUICE_DELTA_THREADS`), read here.

    Raises:
        SchemaError: `SLUICE_DELTA_THREADS` is malformed (deltas on or able to turn on), or
            `host` is beyond loopback without credentials.
        ValueError: `rank` is not below `world_size`; `slots` < 1; `torch` under NCCL with host transports;
            `validate=True` with GPU-staging transports only.
        SchemaError (rank > 0): rank 0 counts another `world_size` (nothing is left running).
    """

    def __init__(
        self,
        address: str | None,
        transport: str | Transport | list = "auto",
        *,
        name: str = "policy",
        rank: int = 0,
        world_size: int = 1,
        coordinator: str | None = None,
        shard: Sharding = None,
        cast: Mapping[torch.dtype, torch.dtype] | None = None,
        bucket_bytes: int = 64 << 20,
        slots: int = 2,
        validate: bool = False,
        lease_timeout: float = 60.0,
        timeout: float = 60.0,
        host: str = "127.0.0.1",
        credentials: Credentials | None = None,
        model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | None = None,
        delta: bool | Literal["auto"] = "auto",
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if slots < 1:
            raise ValueError(f"slots={slots}: a publisher needs at least one staging slot")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.shard = shard
        self.cast = dict(cast or {})
        self.bucket_bytes = bucket_bytes
        self.validate = validate
        self.timeout = timeout
        self.last_publish_seconds = 0.0
        """How long the last `publish` blocked the trainer."""
        model_items = (
            _items(model.state_dict() if isinstance(model, torch.nn.Module) else model) if model is not None else []
        )
        model_device = _cuda_device(model_items)
        transports = resolve(transport)
        if transport == "auto" and model_device is None:
            # GPU staging pays only for CUDA weights, known up front from `model=`
            transports = [t for t in transports if t.staging == "host"]
        self._transports = {t.name: t for t in transports}
        on_gpu = {t.name for t in self._transports.values() if t.staging == "cuda"}
        self._gpu_staging = on_gpu == set(self._transports)
        """Whether every transport reads GPU staging: the slot table is then GPU memory."""
        apart = sorted(n for n in on_gpu if self._transports[n].mode != "map")
        if apart and not self._gpu_staging:
            raise ValueError(
                f"{apart} read GPU staging as a whole version's image, and {sorted(set(self._transports) - on_gpu)} "
                "read host staging; serve them from a publisher of their own (only cuda_ipc serves beside host transports)"
            )
        ids = itertools.count(1)
        self._table = SlotTable(slots, shared=True, lease_timeout=lease_timeout, ids=ids)
        self._mirror = GpuMirror(slots, lease_timeout, ids, timeout) if on_gpu and not self._gpu_staging else None
        """GPU staging beside host staging, for the GPU-staging transports served with host ones
        (`gpu_mirror`): empty until a subscriber leases over one of them."""
        self._on_mirror = on_gpu if self._mirror is not None else set()
        self._weights_device: torch.device | None = None
        """The CUDA device of the weights last published (None: on the host, or none yet)."""
        self._announce_early = any(t.mode != "map" for t in self._transports.values())
        """Whether the server thread hears of a version as it starts staging (readers that
        pull or are pushed a version while it stages start then); a publisher serving only
        "map" transports, whose readers read complete versions, tells it with the version's
        completion, in one wake of that thread rather than two."""
        if self._gpu_staging and validate:
            raise ValueError(f"validate=True checksums host staging; {sorted(self._transports)} stage on the GPU")
        if delta is True and slots < 2:
            raise ValueError("delta=True needs slots >= 2: the previous version is the base")
        served_deltas = [t for t in self._transports.values() if t.deltas]
        pushed_deltas = any(t.mode == "image" for t in served_deltas)
        self.delta = slots >= 2 and (delta is True or (delta == "auto" and pushed_deltas))
        """Whether staged versions are compared with the previous one for delta pulls (the
        benchmark turns it off and on between versions)."""
        self._delta_on_lease = delta == "auto" and slots >= 2 and bool(served_deltas) and not self.delta
        """Whether deltas are "auto" and still off: the first lease over a transport that takes
        deltas (a pull: tcp, ucx) turns them on (`_turn_deltas_on`), so that none is compared
        before a subscriber can use it."""
        self._deltas: dict[int, _StagedDelta] = {}  # slot index -> its changes against the previous version
        self._stats: OrderedDict[int, VersionStats] = OrderedDict()
        self._stats_lock = threading.Lock()
        # ThreadPoolExecutor starts its threads at the first jobs: none run before deltas are on
        workers = threads() if self.delta or self._delta_on_lease else 1
        self._comparer = ThreadPoolExecutor(workers, thread_name_prefix="sluice-ws-compare")
        """Compares staged buckets, several at once (each a pass over memory)."""
        self._compare_scratch = threading.local()  # a CompareScratch per compare thread
        self._comparing: list[Future] = []
        """The compares handed to `_comparer` for the version being staged (by `publish`'s
        staging, or by a compare that released the buckets held behind it)."""
        self._encoder = ThreadPoolExecutor(workers, thread_name_prefix="sluice-ws-encode") if workers > 1 else None
        """Encodes delta frames for the streams, ahead of their sending threads (None: one
        thread; each stream then encodes its own frames as it sends)."""
        self._device_packs = DevicePacks() if self.delta else None
        """Once deltas are on, CUDA weights are packed on the GPU first, so the compare runs
        there (every version, also one published with `delta` turned off: it is the next one's
        base); None before ("auto") and once the GPU had no memory for the packs (the compare
        then runs on the host)."""
        self._skip_dense = 0
        """Versions still to publish without a compare, since the last compare found most
        buckets dense (updates too large for deltas)."""
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._latest_manifest = 0
        """The id of the newest manifest (what a subscriber plans for ahead of the first version)."""
        self._manifest_key: list | None = None
        self._last = -1
        self._failed = -1
        """The newest version whose staging failed (its number is taken: publish a newer one)."""
        self._started = -1  # newest version this rank began staging (server thread's copy)
        self._lease_waiters: list[tuple[Lease, Pending]] = []
        self._relays: dict[tuple[int, int, str], list[str]] = {}
        self._snapshots: dict[int, Snapshot] = {}  # slot index -> checksums taken after staging
        self._closed = False
        self._prepared = model is not None
        """Whether every slot was allocated (`model=`) or is being allocated (`_preparing`)."""
        self._preparing: threading.Thread | None = None
        """The thread the first `publish` starts to allocate the other slots, without `model=`."""
        if model is not None:
            self._prepare(model_items)
        self._client = tq.ControlClient(address, credentials) if address is not None else None
        self._client_lock = threading.Lock()
        source = _SlotSource(self._table, timeout, self._deltas, self._count, self._encoder, 2 * workers)
        data = {t.name: t.serve(source) for t in self._transports.values()}
        self.credentials = credentials if credentials is not None else credentials_from_env()
        # a lease is its reader's connection's: a reader that exits or dies frees its slots
        self._server = serve(
            self._handle,
            f"tcp://{host}:*",
            self.credentials,
            self._release_holder,
            # a "map" transport's readers are on this host; with credentials every client proves
            # it holds the cluster's keys, which the lane (same user only) could not ask
            local=self.credentials is None and any(t.mode == "map" for t in self._transports.values()),
        )
        self.info = RankInfo(
            rank, world_size, host_id(), self._server.endpoint, data, self._server.local_endpoint, lease_timeout
        )
        self._coordinator = (
            Coordinator(
                self.info,
                world_size,
                self._server.park,
                self._server.submit,
                self._record if self._client else None,
                self._grant_offered,
                self._table.newest,
            )
            if rank == 0
            else None
        )
        self._upstream: RpcClient | None = None
        self._drained = threading.Event()
        """Clear while a version's copies to host staging are still draining (`_pack_in_background`)."""
        self._drained.set()
        self._finished: queue.Queue = queue.Queue()
        self._finisher = threading.Thread(target=self._finish_loop, name="sluice-ws-finisher", daemon=True)
        self._finisher.start()
        try:
            if rank == 0:
                if self._client is not None:
                    self._controller(lambda c: c.announce(directory_key(name), msgspec.msgpack.encode(self.info)))
            else:
                self._upstream = RpcClient(
                    coordinator or self._find_coordinator(), timeout=timeout, credentials=self.credentials
                )
                self._upstream.call(Join(self.info))
        except BaseException:
            self.close()  # a rank that could not join or be announced leaves nothing running
            raise

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (give rank 0's to subscribers when there is no controller)."""
        return self.info.control

    @property
    def version(self) -> int:
        """The newest version this rank has been asked to publish (-1 before the first)."""
        return self._last

    def _find_coordinator(self) -> str:
        if self._client is None:
            raise ValueError("ranks > 0 need the controller's address or `coordinator=` (rank 0's endpoint)")
        raw = self._controller(lambda c: c.lookup(directory_key(self.name), timeout=self.timeout))
        if raw is None:
            raise TimeoutError(
                f"rank 0 of weight channel {self.name!r} did not announce itself within {self.timeout} s"
            )
        return msgspec.msgpack.decode(raw, type=RankInfo).control

    def _controller(self, call):  # noqa: ANN001, ANN202 - one blocking client, several threads
        with self._client_lock:
            return call(self._client)

    def _record(self, version: int) -> None:
        """Set the controller's version (one already there, set by someone else, is fine)."""
        try:
            self._controller(lambda c: c.set_version(version))
        except VersionError:
            if self._controller(lambda c: c.version) < version:
                raise

    # -- publishing ----------------------------------------------------------------------

    def publish(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stage `tensors` as `version`; returns once the trainer may change them again.

        `tensors` is a state dict or (name, tensor) pairs, in a stable order. Raises
        `VersionError` unless `version` is above every version published before,
        `SchemaError` if a tensor contradicts `shard`, `TimeoutError` if readers pin every
        slot for `timeout` seconds. Version v reaches the controller only once every rank
        has it complete; a publish that fails leaves the previous version in place.
        """
        start = time.perf_counter()
        if self._closed:
            raise tq.ClosedError("this publisher was closed")
        if version <= self._last:
            failed = " (its publish failed: publish a newer version)" if self._failed == self._last else ""
            raise VersionError(f"version {version} is not above the last published version {self._last}{failed}")
        items = _items(tensors)
        manifest = self._manifest(items)
        cuda = _cuda_device(items)
        self._place_staging(cuda)
        self._weights_device = cuda
        if self._mirror is not None and cuda is not None:
            self._mirror.place(cuda, manifest.nbytes)
        if not self._drained.wait(self.timeout):
            raise TimeoutError(f"the previous version's copies to host staging did not end within {self.timeout} s")
        # the slot about to be claimed may be the base they read; a compare may hand on more
        # before it ends, so look again until none is left running
        while running := [f for f in self._comparing if not f.done()]:
            wait(running)
        self._comparing = []
        base = self._table.find(self._last)
        slot = self._table.claim(version, manifest.nbytes, self.timeout)
        mirror = None
        try:
            # CUDA weights are staged on the GPU too once a subscriber reads GPU staging; a
            # version of CPU weights reaches it at its first lease there (`_grant`)
            mirror = self._mirror.claim(version, manifest) if self._mirror is not None and cuda is not None else None
            drain = self._stage(version, manifest, items, slot, base, cuda, mirror)
            synchronize(self._table.device)  # a GPU snapshot is whole before the version is offered
        except BaseException as exc:
            # whatever fails once the slot is claimed fails the version, so the slot is free
            # again (a slot left neither complete nor failed is never claimed)
            self._fail(slot, version, mirror)
            self._finished.put((slot, version, False, None, mirror))
            if isinstance(exc, Exception):
                raise WeightSyncError(f"staging version {version} failed: {exc}") from exc
            raise
        if (
            drain is None
            and not self.validate
            and self._coordinator is not None
            and not self._finished.unfinished_tasks
        ):
            # complete already, nothing to checksum, and no earlier version still finishing:
            # rank 0 completes it here rather than waking the finisher for it (a thread hop
            # on every version's way to its subscribers)
            self._finish(slot, version, True, None)
        else:
            self._finished.put((slot, version, True, drain, mirror))
        self.last_publish_seconds = time.perf_counter() - start

    def _stage(
        self,
        version: int,
        manifest: Manifest,
        items: list[tuple[str, torch.Tensor]],
        slot: Slot,
        base: Slot | None,
        cuda: torch.device | None,
        mirror: Slot | None,
    ) -> Callable[[], None] | None:
        """Stage `version` into the claimed `slot` (deltas against `base` when on) and offer it
        to the transports as it stages; returns the drain of background GPU copies, if any.
        `cuda`: the device of the CUDA tensors among `items` (None: all on the host); `mirror`:
        the GPU slot claimed for it beside host staging, if any."""
        if not self._prepared:  # not given the model: ready the other slots for the next versions
            self._prepared = True
            self._preparing = self._table.prepare_in_background(manifest.nbytes, self._prepare_failed)
        staged = None
        skip, self._skip_dense = self._skip_dense > 0, max(0, self._skip_dense - 1)
        on = self.delta
        device = cuda if self._table.device is None else None  # GPU weights into host staging
        # after `delta` (`_turn_deltas_on` sets the packs first), and once: the server thread
        # may turn deltas on while this version stages
        packs = self._device_packs if device is not None else None
        if (
            on
            and not skip
            and base is not None
            and base is not slot
            and base.manifest is manifest
            # CUDA weights compare on the GPU, against a base packed there (none when deltas
            # have just turned on, or the previous version's weights were on the host)
            and (packs is None or packs.base(self._last, manifest) is not None)
        ):
            staged = self._deltas[slot.index] = _StagedDelta(
                version, self._last, manifest.bucket_bytes, manifest.num_buckets
            )
        else:
            self._deltas.pop(slot.index, None)
        slot.manifest = manifest
        self._last = version
        if self._announce_early:
            self._server.submit(lambda: self._on_started(version))
        for transport in self._transports.values():
            if transport.name in self._on_mirror:
                continue  # no push transport reads the mirror: nothing to send
            got = self._table.lease(version)
            assert got is not None  # the slot was claimed for `version` just above
            transport.send(slot, functools.partial(self._table.release, got[0]))
        self._record_stats(version, manifest.nbytes, staged)
        progress = functools.partial(self._table.advance, slot)
        if staged is not None and base is not None:
            progress = functools.partial(self._staged_with_delta, slot, base, staged)
        if device is not None and (packs is not None or mirror is not None):
            try:
                return self._pack_on_device(packs, mirror, version, manifest, items, slot, device, staged, progress)
            except torch.cuda.OutOfMemoryError as exc:
                # the version goes on through host staging alone (its compare on the host)
                if packs is not None:
                    log.warning(
                        "no GPU memory for the two packed copies (%d bytes each) deltas compare on the device; "
                        "comparing on the host from now on",
                        manifest.nbytes,
                    )
                    packs.clear()
                    self._device_packs = None
                if mirror is not None and self._mirror is not None:
                    self._mirror.stop(exc)
                    # the pack that failed may have queued copies into the slot: done before
                    # failing it frees it (GPU staging stopped), so its memory is not reused
                    # under them
                    background_done(device)
                    self._mirror.table.fail(mirror)
        if device is None:
            pack(manifest, [t for _, t in items], slot.mapped.tensor, progress, _destinations(slot))
            return None
        return self._pack_in_background(manifest, items, slot, device, progress)

    def _pack_in_background(
        self,
        manifest: Manifest,
        items: list[tuple[str, torch.Tensor]],
        slot: Slot,
        device: torch.device,
        progress: Callable[[int], None],
    ) -> Callable[[], None]:
        """Issue the device-to-host copies of CUDA weights into the (registered) slot on a side
        stream, an event after each bucket, and return without waiting: the trainer's stream is
        ordered after them, so it may change its tensors at once. Returns the drain the finisher
        runs: wait for each bucket's event, then report it staged (readers stream it), so the
        version is offered only once every copy is done. The next `publish` waits for it."""
        marks: list[tuple[Callable[[], None], int]] = []
        with background_copies(device) as mark:
            pack(
                manifest,
                [t for _, t in items],
                slot.mapped.tensor,
                lambda end: marks.append((mark(), end)),
                _destinations(slot),
            )
        return self._drain(marks, progress)

    def _drain(
        self, marks: list[tuple[Callable[[], None], int]], progress: Callable[[int], None]
    ) -> Callable[[], None]:
        """The drain the finisher runs for copies issued in the background: wait for each
        group's event (`marks`: its wait and the bytes staged once it is done), then report
        those bytes (`progress`). The next `publish` waits for it (`_drained`, cleared here:
        call this last, so a failure before it leaves nothing to wait on)."""

        def drain() -> None:
            try:
                for copied, end in marks:
                    copied()
                    progress(end)
            finally:
                self._drained.set()

        self._drained.clear()
        return drain

    def _pack_on_device(
        self,
        packs: DevicePacks | None,
        mirror: Slot | None,
        version: int,
        manifest: Manifest,
        items: list[tuple[str, torch.Tensor]],
        slot: Slot,
        device: torch.device,
        staged: _StagedDelta | None,
        progress: Callable[[int], None],
    ) -> Callable[[], None]:
        """`_pack_in_background` for CUDA weights packed on the GPU first: into the `mirror`
        slot (GPU staging beside host staging) and, with deltas on, into `packs`; the trainer's
        stream waits for these device-to-device packs only. Then copy the packed bytes to the
        host slot bucket by bucket on a stream of their own and, with `packs`, have the compare
        thread compare them with the base's packed bytes on the device (`_stage` compares only
        against a base packed there); without, host staging reports its bytes to `progress`.
        Returns the drain of the copies to the host (the mirror slot is complete with it).

        Raises:
            torch.cuda.OutOfMemoryError: no GPU memory for the pack (nothing is left half done).
        """
        bucket = manifest.bucket_bytes
        tensors = [t for _, t in items]
        with background_copies(device) as mark:
            if mirror is not None:
                packed = mirror.mapped.tensor[: manifest.nbytes]
                pack(manifest, tensors, packed, lambda _: None, _destinations(mirror))
                if packs is not None:
                    try:
                        packs.copy(version, manifest, packed)
                    except torch.cuda.OutOfMemoryError:  # the packs' own memory: GPU staging goes on
                        log.warning("no GPU memory for the packed copies deltas compare on; comparing on the host")
                        packs.clear()
                        self._device_packs = packs = None
            else:
                assert packs is not None  # `_stage` packs on the device for one or the other
                packed = packs.pack(version, manifest, tensors, device)
            ready = mark()
        marks: list[tuple[Callable[[], None], int]] = []
        with trailing_copies(device) as mark:  # they read the pack only: the trainer need not wait
            host = slot.mapped.tensor
            for k in range(manifest.num_buckets):
                lo, hi = k * bucket, min((k + 1) * bucket, manifest.nbytes)
                host[lo:hi].copy_(packed[lo:hi], non_blocking=True)
                marks.append((mark(), hi))
        if staged is not None and packs is not None:
            old = packs.base(staged.base, manifest)
            assert old is not None  # `_stage` compares only against a packed base; packing kept the newest
            # one job: the device runs its compares one after another anyway
            self._comparing.append(
                self._comparer.submit(self._compare, packed, old, manifest, staged, 0, manifest.num_buckets, ready)
            )
            progress = functools.partial(self._table.advance, slot)
        return self._drain(marks, progress)

    def _prepare(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Build the manifest of the model's tensors (`model=`) and allocate every slot for it
        now (GPU staging beside host staging: once a subscriber reads it)."""
        manifest = self._manifest(items)
        cuda = _cuda_device(items)
        self._place_staging(cuda)
        self._table.prepare(manifest.nbytes)
        if self._mirror is not None and cuda is not None:
            self._mirror.place(cuda, manifest.nbytes)

    def _prepare_failed(self, exc: Exception) -> None:
        """Allocating the other slots in the background failed (`_stage`): each is allocated
        by the `publish` that claims it instead, which raises if there is still no memory."""
        log.warning("weight channel %r rank %d: allocating the staging slots failed: %s", self.name, self.rank, exc)

    def _place_staging(self, cuda: torch.device | None) -> None:
        """Settle where staging lives, before the first slot is allocated: GPU slots on the
        weights' device (`cuda`, that of the CUDA weights) for a GPU-staging transport; else
        host slots, registered with CUDA once GPU weights are copied into them."""
        if self._gpu_staging:
            if self._table.device is None:
                self._table.device = cuda or torch.device("cuda", torch.cuda.current_device())
        elif cuda is not None and not self._table.pin:
            self._table.pin_all()

    def _staged_with_delta(self, slot: Slot, base: Slot, staged: _StagedDelta, filled: int) -> None:
        """Staging progress with deltas on: readers of whole bytes go on at once, and every
        bucket staged whole since the last call is handed to the compare threads, one job
        each (delta readers wait for it there; `_StagedDelta.take` holds back those past the
        first `_DENSE_RUN` until these are compared), so `publish` does not wait for the compare."""
        self._table.advance(slot, filled)
        manifest = slot.manifest
        upto = manifest.num_buckets if filled >= manifest.nbytes else filled // manifest.bucket_bytes
        self._submit_compares(slot.mapped.tensor, base.mapped.tensor, manifest, staged, staged.take(upto))

    def _submit_compares(
        self, new: torch.Tensor, old: torch.Tensor, manifest: Manifest, staged: _StagedDelta, buckets: range
    ) -> None:
        """Hand `buckets` of the host-staged `new` to the compare threads, one job each."""
        for k in buckets:
            self._comparing.append(self._comparer.submit(self._compare, new, old, manifest, staged, k, k + 1))

    def _compare(
        self,
        new: torch.Tensor,
        old: torch.Tensor,
        manifest: Manifest,
        staged: _StagedDelta,
        first: int,
        upto: int,
        ready: Callable[[], None] | None = None,
    ) -> None:
        """A compare thread: buckets [first, upto) of `new` (a version's staged bytes, on the
        host or packed on the GPU) against the same bytes of `old` (its base's), one vectorised
        pass each, once `ready()` returns (the GPU pack is done); records the version's density
        once its last bucket is compared (by whichever thread that is)."""
        bucket = staged.bucket_bytes
        try:
            if ready is not None:
                ready()
            with side_stream(new.device, "compare") if new.is_cuda else contextlib.nullcontext():
                complete = self._compare_buckets(new, old, staged, first, upto)
        except Exception:
            log.exception("comparing version %d with %d failed; it is served whole", staged.version, staged.base)
            staged.fail()
            raise
        try:  # the buckets held until the first ones were compared, if these were the last of them
            self._submit_compares(new, old, manifest, staged, staged.take())
        except RuntimeError:  # the publisher is closing: its readers stop waiting
            staged.fail()
        if complete:
            found = list(staged.buckets.values())
            if sum(c is None for c in found) * 2 > len(found):
                self._skip_dense = _DENSE_PROBE - 1
            changed = sum(bucket if c is None else c.count for c in found)
            with self._stats_lock:
                stats = self._stats.get(staged.version)
                if stats is not None:
                    stats.changed = changed
                    stats.compared_on = str(new.device)

    def _compare_buckets(
        self, new: torch.Tensor, old: torch.Tensor, staged: _StagedDelta, first: int, upto: int
    ) -> bool:
        """Compare buckets [first, upto) in turn; True once every bucket of the version has
        its changes. A bucket goes whole without a compare when the version's first
        `_DENSE_RUN` buckets were found dense (those past them are handed out only once these
        are compared, so a dense version costs `_DENSE_RUN` compares with any number of
        threads), or when its `_DENSE_RUN` predecessors were (with several compare threads,
        those may still be running: it is then compared)."""
        bucket = staged.bucket_bytes
        scratch = getattr(self._compare_scratch, "scratch", None)
        if scratch is None:
            scratch = self._compare_scratch.scratch = CompareScratch()
        complete = False
        for k in range(first, upto):
            if (k >= _DENSE_RUN and staged.dense_before(_DENSE_RUN, _DENSE_RUN)) or staged.dense_before(k, _DENSE_RUN):
                complete = staged.add(k, None)
                continue
            try:
                changes = compare(
                    new[k * bucket : (k + 1) * bucket], old[k * bucket : (k + 1) * bucket], scratch=scratch
                )
            except torch.cuda.OutOfMemoryError:  # no GPU memory for this bucket's changes: it goes whole
                log.warning("no GPU memory to compare bucket %d of version %d; it is sent whole", k, staged.version)
                changes = None
            complete = staged.add(k, changes)
        return complete

    def _record_stats(self, version: int, nbytes: int, staged: _StagedDelta | None) -> None:
        with self._stats_lock:
            self._stats[version] = VersionStats(version, -1 if staged is None else staged.base, nbytes, nbytes)
            while len(self._stats) > RECENT:
                self._stats.popitem(last=False)

    def _count(self, version: int, requested: int, sent: int, delta: bool) -> None:
        """A stream of `version` ended: `requested` bytes whole, `sent` on the wire."""
        with self._stats_lock:
            stats = self._stats.get(version)
            if stats is not None:
                stats.requested += requested
                stats.sent += sent
                if delta:
                    stats.delta_pulls += 1
                else:
                    stats.whole_pulls += 1

    def stats(self) -> list[VersionStats]:
        """What the recent versions cost on the wire (copies; newest last): bytes staged and
        changed against the previous version (their density), bytes pulled as whole and on
        the wire, and how many pulls were deltas."""
        with self._stats_lock:
            return [dataclasses.replace(s) for s in self._stats.values()]

    def _manifest(self, items: list[tuple[str, torch.Tensor]]) -> Manifest:
        """The manifest for `items`, reused while names, shapes and dtypes stay the same."""
        key = [(n, t.shape, t.dtype) for n, t in items]
        if key == self._manifest_key:
            return next(reversed(self._manifests.values()))
        specs = []
        for name, tensor in items:
            layout = self._layout(name, tensor)
            layout.check()
            flat = layout.flat_stop >= 0
            if (flat and layout.numel != tensor.numel()) or (not flat and layout.local_shape != tuple(tensor.shape)):
                raise SchemaError(
                    f"{name}: local tensor of shape {tuple(tensor.shape)} does not match its layout {layout}"
                )
            specs.append((name, self.cast.get(tensor.dtype, tensor.dtype), layout))
        manifest = layout_buckets(specs, self.bucket_bytes, self.rank, self.world_size)
        self._manifest_key = key
        self._latest_manifest = manifest.id
        self._manifests[manifest.id] = manifest
        self._manifests.move_to_end(manifest.id)
        while len(self._manifests) > _KEPT_MANIFESTS:
            self._manifests.popitem(last=False)
        return manifest

    def _layout(self, name: str, tensor: torch.Tensor) -> Layout:
        if self.shard is None:
            return Layout.full(tensor.shape)
        if isinstance(self.shard, Mapping):
            return self.shard[name] if name in self.shard else Layout.full(tensor.shape)
        return self.shard.layout(name, tensor)

    def _fail(self, slot: Slot, version: int, mirror: Slot | None = None) -> None:
        """Staging `version` into `slot` (and its GPU `mirror` slot) failed: its readers, of
        whole bytes or of the delta, get `WeightSyncError`, and the slots may be claimed again."""
        self._failed = version
        staged = _staged_in(self._deltas, slot, version)
        if staged is not None:
            staged.fail()
        self._table.fail(slot)
        if mirror is not None and self._mirror is not None:
            self._mirror.table.fail(mirror)

    def _finish_loop(self) -> None:
        """Background: finish each version `publish` queued, in order."""
        while (job := self._finished.get()) is not None:
            try:
                self._finish(*job)
            finally:
                self._finished.task_done()

    def _finish(
        self, slot: Slot, version: int, ok: bool, drain: Callable[[], None] | None, mirror: Slot | None = None
    ) -> None:
        """Wait for the version's background copies (`drain`), checksum it (validation mode),
        mark it complete, in its GPU `mirror` slot too, and report it to the coordinator (or
        fail it)."""
        if drain is not None:
            try:
                drain()
            except Exception:  # noqa: BLE001 - a failed copy: readers get WeightSyncError
                log.exception("copying version %d to host staging failed", version)
                self._fail(slot, version, mirror)
                ok = False
        try:
            if ok and self.validate:
                self._snapshots[slot.index] = Snapshot.take(slot.manifest, slot.mapped.tensor)
        except Exception:  # noqa: BLE001 - the version fails, the loop goes on
            log.exception("checksumming version %d failed", version)
            self._fail(slot, version, mirror)
            ok = False
        if ok:
            self._table.advance(slot, slot.manifest.nbytes, complete=True)
        if mirror is not None and self._mirror is not None:
            # a GPU slot failed after GPU staging stopped was freed (and holds no version)
            if ok and not mirror.failed and mirror.version == version:
                self._mirror.table.advance(mirror, slot.manifest.nbytes, complete=True)
            with contextlib.suppress(OSError):  # leases waiting for the GPU slot: granted or told
                self._server.submit(self._retry_leases)
        coordinator, upstream = self._coordinator, self._upstream
        started = None if self._announce_early else functools.partial(self._on_started, version)
        if coordinator is not None:

            def report() -> None:
                if started is not None:
                    started()
                coordinator.on_staged(0, version, ok)

            with contextlib.suppress(OSError):  # the server has stopped: the publisher is closing
                self._server.submit(report)
            return
        if started is not None:
            with contextlib.suppress(OSError):
                self._server.submit(started)
        if upstream is not None:
            try:
                upstream.call(Staged(self.rank, version, ok))
            except Exception as exc:  # noqa: BLE001 - rank 0 gone: subscribers will notice too
                log.warning("could not tell rank 0 that version %d is staged: %s", version, exc)

    # -- control requests (server thread) ------------------------------------------------

    def _handle(self, msg: msgspec.Struct, pending: Pending) -> None:
        match msg:
            case Lease():
                self._lease(msg, pending)
            case Release(lease=lease):
                if not self._release(lease):
                    raise WeightSyncError(
                        f"lease {lease} did not hold its slot until its release: the slot was staged again "
                        "under it (its reads outlasted lease_timeout), or it was already released"
                    )
                pending.reply(Ok())
            case Describe(manifest=mid):
                manifest = self._manifests.get(mid)
                if manifest is None:
                    raise WeightSyncError(f"manifest {mid:#x} is no longer kept by rank {self.rank}")
                pending.reply(Described(manifest))
            case Slots(transport=name):
                mirror = self._mirror_for(name)
                stopped = mirror.error if mirror is not None else ""
                pending.reply(SlotList(self._describe_slots(name), self._latest_manifest, stopped))
            case Verify():
                pending.reply(self._verify(msg))
            case Join() | Staged() | Latest() | Confirm() if self._coordinator is not None:
                self._coordinator.handle(msg, pending)
            case _:
                raise WeightSyncError(f"{type(msg).__name__} must go to rank 0 of the channel, not rank {self.rank}")

    def _on_started(self, version: int) -> None:
        self._started = version
        self._retry_leases()
        if self._coordinator is not None:
            self._coordinator.on_started(version)

    def _retry_leases(self) -> None:
        """Ask again for the leases waiting on a version to start staging or to reach GPU
        staging; one that cannot be granted any more gets its error (server thread, outside a
        request's dispatch: nothing may escape)."""
        waiting, self._lease_waiters = self._lease_waiters, []
        for msg, pending in waiting:
            if not pending.done:
                try:
                    self._lease(msg, pending, parked=True)
                except Exception as exc:  # noqa: BLE001 - the requester gets it, typed
                    pending.fail(exc)

    def _release(self, lease: int) -> bool:
        """End `lease`; whether it still pinned its slot (`SlotTable.release`)."""
        held = self._table.release(lease)
        if self._mirror is not None:  # lease ids are unique across both tables
            held = self._mirror.table.release(lease) or held
        return held

    def _release_holder(self, holder: bytes) -> None:
        """A connection closed: release its reader's leases, in host and GPU staging; a rank
        that joined over it may join again."""
        self._table.release_holder(holder)
        if self._mirror is not None:
            self._mirror.table.release_holder(holder)
        if self._coordinator is not None:
            self._coordinator.left(holder)

    def _lease(self, msg: Lease, pending: Pending, parked: bool = False) -> None:
        """Grant `msg`, or keep it waiting (`parked`: it waits already, with its deadline) for its
        version to start staging or to reach GPU staging, or refuse it."""
        granted = self._grant(msg, pending.peer)
        mirror = self._mirror_for(msg.transport)
        if granted is not None:
            pending.reply(granted)
        elif not self._closed and (
            msg.version > self._started or (mirror is not None and mirror.on_its_way(msg.version))
        ):
            self._lease_waiters.append((msg, pending))
            if not parked:
                self._server.park(
                    pending, msg.timeout, f"version {msg.version} was not staged on rank {self.rank} in time"
                )
        else:
            if self._closed:
                raise WeightSyncError(f"rank {self.rank} is closing")
            if mirror is not None:
                mirror.check()  # stopped since `_grant` asked: the subscriber reads host staging
            why = mirror.why(msg.version) if mirror is not None else ""
            if why:
                raise WeightSyncError(
                    f"version {msg.version} cannot be read from rank {self.rank}'s GPU staging: {why}"
                )
            if msg.version == self._last:
                raise WeightSyncError(f"staging version {msg.version} failed on rank {self.rank}")
            raise WeightSyncError(
                f"version {msg.version} is no longer staged on rank {self.rank} (newest: {self._last})"
            )

    def _grant_offered(self, version: int, transport: str, holder: bytes) -> Granted | None:
        """Rank 0: the lease a `Latest` asked for with its offer of `version`, held by the
        requesting connection `holder`, or None (the subscriber then leases with `Lease`,
        which reports why)."""
        try:
            return self._grant(Lease(version, transport), holder)
        except Exception:  # noqa: BLE001 - the subscriber's own Lease gets the error
            return None

    def _grant(self, msg: Lease, holder: bytes) -> Granted | None:
        """Pin the slot holding `msg.version` for the requester; None if no slot holds it.

        A "map" transport's reader is on this host, so its connection (`holder`) closes only
        when its process dies or closes the channel: its lease ends with that closing. Other
        readers may be across a network whose connections reset and reconnect under a live
        reader, so theirs end only when released or expired.

        Raises:
            WeightSyncError: the transport cannot describe the slot (nothing stays pinned).
        """
        transport = self._transports.get(msg.transport)
        if self._delta_on_lease and transport is not None and transport.deltas:
            self._turn_deltas_on()
        mirror = self._mirror_for(msg.transport)
        table = mirror.table if mirror is not None else self._table
        if mirror is not None:
            mirror.turn_on()
        local = transport is not None and transport.mode == "map"
        got = table.lease(msg.version, holder if local else b"")
        if mirror is not None and got is not None and not got[1].complete:
            table.release(got[0])  # GPU staging is read whole: `_finish` or the catch-up retries it
            got = None
        if got is None:
            if (
                mirror is not None
                and not self._closed  # its GPU staging is retired: nothing is copied there any more
                and mirror.table.find(msg.version) is None
                and self._table.find(msg.version)
            ):
                # staged before GPU staging turned on, or CPU weights: copy it there first
                mirror.catch_up(
                    self._table, msg.version, self._weights_device, functools.partial(self._caught_up, msg.version)
                )
            return None
        lease, slot = got
        try:
            handle = transport.describe(slot) if transport is not None else b""
        except BaseException:
            table.release(lease)
            raise
        staged = _staged_in(self._deltas, slot, msg.version) if mirror is None else None
        base = staged.base if staged is not None else -1
        info = SlotInfo(slot.index, slot.generation, slot.size, slot.mapped.path, handle)
        return Granted(lease, msg.version, slot.manifest.id, info, self._relay_source(msg), base)

    def _mirror_for(self, transport: str) -> GpuMirror | None:
        """The GPU staging beside host staging that a subscriber of `transport` reads (a
        GPU-staging transport served with host ones), or None: it reads this rank's one table."""
        return self._mirror if transport in self._on_mirror else None

    def _caught_up(self, version: int) -> None:
        """`version`'s copy to GPU staging ended (mirror thread): retry its leases (server thread)."""
        assert self._mirror is not None

        def retry() -> None:
            assert self._mirror is not None
            self._mirror.finished(version)
            self._retry_leases()

        with contextlib.suppress(OSError):  # the server has stopped: the publisher is closing
            self._server.submit(retry)

    def _turn_deltas_on(self) -> None:
        """Deltas are "auto" and a subscriber leased a version over a transport that takes
        deltas: compare the versions published from now on (server thread). The packs are set
        before `delta`, so a `publish` that sees deltas on packs CUDA weights on the GPU; one
        that sees only the packs makes its version the next one's packed base."""
        self._delta_on_lease = False
        self._device_packs = DevicePacks()
        self.delta = True
        log.info("weight channel %r rank %d: a subscriber can pull deltas; comparing versions", self.name, self.rank)

    def _describe_slots(self, name: str) -> list[SlotInfo]:
        """The slots allocated so far, as a subscriber of transport `name` reaches them (none
        for a transport this rank does not serve)."""
        transport = self._transports.get(name)
        if transport is None:
            return []
        mirror = self._mirror_for(name)
        table = mirror.table if mirror is not None else self._table
        with table.cond:  # a slot being replaced is seen before or after, not half-way
            return [
                SlotInfo(slot.index, slot.generation, slot.size, slot.mapped.path, transport.describe(slot))
                for slot in table.slots
                if slot.segment is not None
            ]

    def _relay_source(self, msg: Lease) -> str:
        """Where this subscriber should pull from: "" (this rank) or a relay's endpoint.

        Subscribers on the same plan form a tree, `fanout` children per node, in arrival order.
        """
        transport = self._transports.get(msg.transport)
        if transport is None or transport.fanout is None or not msg.relay or msg.direct:
            return ""
        key = (msg.version, msg.plan, msg.transport)
        members = self._relays.setdefault(key, [])
        for old in [k for k in self._relays if k[0] < msg.version - RECENT]:
            del self._relays[old]
        position = len(members)
        members.append(msg.relay)
        fanout = transport.fanout
        return "" if position < fanout else members[(position - fanout) // fanout]

    def _verify(self, msg: Verify) -> Checksums:
        """Checksums of the requested boxes, after re-checking their tensors against the
        snapshot taken when they were staged."""
        slot = self._table.leased(msg.lease)
        if slot is None:
            if self._mirror is not None and self._mirror.table.leased(msg.lease) is not None:
                raise WeightSyncError("checksums cover host staging; a version read from GPU staging is not verified")
            raise WeightSyncError("verify needs a lease that is still held")
        snapshot = self._snapshots.get(slot.index)
        if snapshot is None:
            raise WeightSyncError("this publisher was not started with validate=True")
        return snapshot.verify(slot.manifest, slot.mapped.tensor, msg.reads)

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop serving and free the staging memory; subscribers keep what they applied. GPU
        staging is freed once its readers released their leases (at most `timeout` s)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + self.timeout
        self._finished.put(None)
        self._finisher.join(timeout=self.timeout)
        self._let_gpu_readers_finish(deadline)
        self._comparer.shutdown(wait=True, cancel_futures=True)
        for staged in list(self._deltas.values()):  # their readers stop waiting for cancelled compares
            if len(staged.buckets) < staged.num_buckets:
                staged.fail()
        for transport in self._transports.values():
            transport.close()
        if self._mirror is not None:  # after cuda_ipc, which keeps its slots' handles
            self._mirror.close()
        if self._encoder is not None:  # after the streams it encodes for
            self._encoder.shutdown(wait=True, cancel_futures=True)
        self._server.close()
        if self._coordinator is not None:
            self._coordinator.close()
        if self._upstream is not None:
            self._upstream.close()
        self._table.close()
        if self._device_packs is not None:
            self._device_packs.clear()
        if self._client is not None:
            self._client.close()

    def _let_gpu_readers_finish(self, deadline: float) -> None:
        """Retire GPU staging (no lease is granted on it any more) and wait, until `deadline`
        (`close`'s: `timeout` from its start), for the readers holding leases on it to release
        them, the server still running: a freed GPU slot is back in PyTorch's allocator at
        once, where a reader still copying out of it would read what the trainer allocates
        next (a host slot stays mapped in its readers). A reader whose connection closes
        releases its leases with it. Past the deadline the slots are freed anyway, after the
        copies queued on the device (a writer that did not finish)."""
        tables = [(t, t.device) for t in (self._table, self._mirror.table if self._mirror else None) if t and t.device]
        for table, _ in tables:
            table.retire()
        for table, device in tables:
            if not table.wait_freed(max(deadline - time.monotonic(), 0.0)):
                log.warning(
                    "weight channel %r rank %d: GPU staging is still read or written %s s after close began; "
                    "freeing it under them",
                    self.name,
                    self.rank,
                    self.timeout,
                )
                background_done(device)  # the packs `publish` queued

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _destinations(slot: Slot) -> Destinations:
    """Where `slot`'s manifest packs into its segment: made once per manifest and segment."""
    segment = slot.mapped
    made = segment.derived.get("pack")
    if made is None or made.manifest is not slot.manifest:
        made = segment.derived["pack"] = Destinations(slot.manifest, segment.tensor)
    return made


def _staged_in(deltas: dict[int, _StagedDelta], slot: Slot, version: int) -> _StagedDelta | None:
    """The changes staged in `slot` for `version` (None: that version is not compared there)."""
    staged = deltas.get(slot.index)
    return staged if staged is not None and staged.version == version else None


def _cuda_device(items: list[tuple[str, torch.Tensor]]) -> torch.device | None:
    """The device of the first CUDA tensor among `items`; None when all are on the host."""
    return next((t.device for _, t in items if is_cuda(t)), None)


def _items(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)


@dataclass
class VersionStats:
    """What one version cost on the wire (`WeightPublisher.stats`)."""

    version: int
    base: int
    """The version it was compared with (-1: none, every pull is whole)."""
    staged: int
    """Bytes staged (whole buckets)."""
    changed: int
    """Bytes that differ from `base` (dense buckets count whole)."""
    requested: int = 0
    """Bytes the pulls of this version asked for, whole."""
    sent: int = 0
    """Bytes those pulls put on the wire (frames included)."""
    delta_pulls: int = 0
    whole_pulls: int = 0
    compared_on: str = ""
    """Where the compare ran: "cpu" (host staging), a CUDA device (weights packed on the GPU
    first), or "" (not compared)."""

    @property
    def density(self) -> float:
        """Fraction of the staged bytes that changed."""
        return self.changed / self.staged if self.staged else 0.0


@dataclass
class _StagedDelta:
    """The changes of the version staged in a slot against `base`, per bucket as the compare
    threads find them (None: denser than break-even, sent whole)."""

    version: int
    base: int
    bucket_bytes: int
    num_buckets: int
    buckets: dict[int, Changes | None] = field(default_factory=dict)
    """Changes of the buckets compared so far, by bucket index."""
    submitted: int = 0
    """Buckets handed to the compare threads so far."""
    staged: int = 0
    """Buckets staged whole so far (host staging)."""
    failed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, bucket: int, changes: Changes | None) -> bool:
        """A compare thread: bucket `bucket`'s changes. Returns True when it is the last
        bucket of the version to get them."""
        with self.cond:
            self.buckets[bucket] = changes
            self.cond.notify_all()
            return len(self.buckets) == self.num_buckets

    def take(self, staged: int | None = None) -> range:
        """The buckets to hand to the compare threads now, as staging reaches `staged` buckets
        (None: no further) or a compare ends: those staged and not handed out yet, but past the
        first `_DENSE_RUN` only once those are compared (a probed version that is dense then
        costs only them, as with one thread)."""
        with self.cond:
            if staged is not None:
                self.staged = max(self.staged, staged)
            limit = self.staged
            first = min(_DENSE_RUN, self.num_buckets)
            if any(k not in self.buckets for k in range(first)):
                limit = min(limit, first)
            taken = range(self.submitted, max(self.submitted, limit))
            self.submitted = max(self.submitted, limit)
            return taken

    def ready(self, bucket: int) -> bool:
        """Whether `changes(bucket)` would return (or raise) at once."""
        with self.cond:
            return self.failed or bucket in self.buckets

    def dense_before(self, bucket: int, run: int) -> bool:
        """Whether the `run` buckets before `bucket` are compared and all dense."""
        with self.cond:
            return bucket >= run and all(
                k in self.buckets and self.buckets[k] is None for k in range(bucket - run, bucket)
            )

    def fail(self) -> None:
        """Staging or comparing this version failed: delta readers get `WeightSyncError`."""
        with self.cond:
            self.failed = True
            self.cond.notify_all()

    def changes(self, bucket: int, timeout: float) -> Changes | None:
        """Bucket `bucket`'s changes, waiting for the compare threads.

        Raises:
            WeightSyncError: the version failed.
            TimeoutError: not compared within `timeout` seconds.
        """
        with self.cond:
            if not self.cond.wait_for(lambda: self.failed or bucket in self.buckets, timeout):
                raise TimeoutError(f"bucket {bucket} of version {self.version} not compared within {timeout} s")
            if self.failed:
                raise WeightSyncError(f"version {self.version} was abandoned while it was being read")
            return self.buckets[bucket]


class _SlotSource(Source):
    """Serves `Pull`s from the slots of a publisher rank, waiting for bytes still staging; a
    pull with a base gets delta frames (`stream.delta_frames`) against it. Push transports
    read the staged changes (`staged_delta`) and report what they sent (`record`)."""

    def __init__(
        self,
        table: SlotTable,
        timeout: float,
        deltas: dict[int, _StagedDelta],
        count,  # noqa: ANN001 - WeightPublisher._count
        encoder: ThreadPoolExecutor | None,
        ahead: int,
    ):
        self.table = table
        self.timeout = timeout
        self.deltas = deltas
        self.count = count
        self.encoder = encoder
        """Where streams' frames are encoded ahead of their sending (None: by each stream)."""
        self.ahead = ahead if encoder is not None else 1
        """Frames a stream may have encoding or encoded ahead of the one it sends (twice the
        encoder's threads)."""

    def staged_delta(self, slot: Slot) -> _StagedDelta | None:
        return _staged_in(self.deltas, slot, slot.version)

    def record(self, version: int, requested: int, sent: int, delta: bool) -> None:
        self.count(version, requested, sent, delta)

    def open(self, request: Pull | RelayPull):  # noqa: ANN201
        if not isinstance(request, Pull):
            raise WeightSyncError("a publisher rank is not a relay")
        slot = self.table.leased(request.lease)
        if slot is None or slot.version != request.version:
            raise WeightSyncError(f"lease {request.lease} on version {request.version} is not held (expired?)")
        staged = None
        if request.base >= 0:
            staged = _staged_in(self.deltas, slot, request.version)
            if staged is None or staged.base != request.base:
                raise WeightSyncError(f"rank holds no delta of version {request.version} from {request.base}")
        sent = 0

        def renewed() -> None:
            """Before each piece: the lease lasts while the stream makes progress, and a stream
            that stalled past it (its reader stopped reading) while the slot was staged again
            breaks off (the reader then sees a short stream and discards it)."""
            if not self.table.renew(request.lease):
                why = f"lease {request.lease} on version {request.version} ended while it was sent: its slot was staged again"
                log.warning("%s; breaking off the stream", why)  # the reader sees only a short stream
                raise WeightSyncError(why)

        def views():  # noqa: ANN202
            nonlocal sent
            scratch = Scratch()
            for read in request.reads:
                span = None if staged is None else contiguous_span(read)
                if span is None:  # whole bytes: once staged (delta frames wait for them where they send them)
                    slot.wait_filled(read.end, request.version, self.timeout)
                if staged is None:
                    for box in read_chunks(read):
                        view = gather(slot.mapped.tensor, read, box, scratch)
                        renewed()
                        sent += len(view)
                        yield view
                    continue
                pieces = (
                    delta_frames(
                        slot.mapped.tensor,
                        span,
                        functools.partial(staged.changes, timeout=self.timeout),
                        staged.bucket_bytes,
                        staged.base,
                        self.encoder,
                        self.ahead,
                        staged.ready,
                        functools.partial(slot.wait_filled, version=request.version, timeout=self.timeout),
                    )
                    if span is not None
                    else whole_frames(slot.mapped.tensor, read, scratch, staged.base)
                )
                for view in pieces:
                    renewed()
                    sent += len(view)
                    yield view

        def done(ok: bool) -> None:
            self.count(request.version, sum(r.nbytes for r in request.reads), sent, staged is not None)
            if not ok:
                self.table.release(request.lease)  # the reader failed; it will lease again

        return views(), done
