"""`torch`: torch.distributed broadcast from the publisher to a fixed group of subscribers.

NCCL on GPUs, gloo on CPU. Under NCCL there is no host bounce: the publisher stages into GPU
slots (`staging = "cuda"`) and broadcasts from them, and subscribers receive into GPU buffers
(`receive_device`); only the small headers go through a device buffer. NCCL needs a GPU per
member (it refuses two processes on one GPU). The group is the publisher (group rank 0) plus
`world_size - 1` subscribers, formed through a TCPStore the publisher hosts; subscribers take
group ranks from the store's counter. It is a standalone process group, so it never touches
the trainer's default group. A pusher thread broadcasts each version bucket by bucket as it
is staged (a header, the buckets, a trailer saying whether staging finished), so bucket k is
on the wire while k+1 is packed. Every member receives the whole slot (collective semantics:
no per-subscriber slicing); each applies only its own reads from it. Publishing one rank's
slot only: sharded trainers use the pull transports.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.cuda import synchronize

from .base import Job, Transport, register

if TYPE_CHECKING:  # the class of ProcessGroupGloo/NCCL (a torch without distributed lacks the module)
    from torch._C._distributed_c10d import Backend as _Backend

__all__ = ["TorchTransport"]

_WORLD = "sluice/weight_sync/world_size"
_RANK = "sluice/weight_sync/rank"
_GOODBYE = -2
"""Header version that tells subscribers the publisher closed the group."""
_IDLE = datetime.timedelta(days=7)
"""How long a subscriber waits for the next version's header (trainer steps can be long)."""
_HEADER = 5
"""int64s opening each broadcast: version, manifest id - 2**63, slot bytes, buckets, bucket bytes."""


@register
class TorchTransport(Transport):
    """Broadcast to a group of `world_size` (the publisher and `world_size - 1` subscribers;
    subscribers learn it from the publisher's store)."""

    name = "torch"
    mode = "image"

    def __init__(self, world_size: int = 2, backend: str = "gloo", host: str = "127.0.0.1", timeout: float = 60.0):
        self.world_size = world_size
        self.backend = backend
        self.host = host
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            self.staging = "cuda"
            self.receive_device = self.device
        self._store: dist.TCPStore | None = None
        self._group: _Backend | None = None
        self._cond = threading.Condition()
        self._queued: tuple | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._bounce: torch.Tensor | None = None
        self._ended = False

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    # -- group ---------------------------------------------------------------------------

    def _make_group(self, store: dist.Store, rank: int) -> _Backend:
        timeout = datetime.timedelta(seconds=self.timeout)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, self.world_size, opts)

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        """Broadcast `tensor` from group rank 0: in place when it is on the group's device, else
        (a small CPU header under NCCL) through a device buffer."""
        group = self._group
        assert group is not None  # publisher and subscriber form the group before broadcasting
        if tensor.device == self.device:
            group.broadcast(tensor, 0, timeout).wait()
            return
        if self._bounce is None or self._bounce.numel() < tensor.numel():
            self._bounce = torch.empty(tensor.numel(), dtype=tensor.dtype, device=self.device)
        bounce = self._bounce[: tensor.numel()]
        bounce.copy_(tensor)
        group.broadcast(bounce, 0, timeout).wait()
        tensor.copy_(bounce)

    # -- publisher -----------------------------------------------------------------------

    def serve(self, source) -> str:  # noqa: ANN001 - the pusher reads slots it is sent
        self._store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.timeout)
        )
        self._store.set(_WORLD, str(self.world_size))
        self._thread = threading.Thread(target=self._push_loop, name="sluice-ws-torch", daemon=True)
        self._thread.start()
        return f"{self.host}:{self._store.port}"

    def send(self, slot, release) -> None:  # noqa: ANN001
        """Queue `slot` for broadcast (only the newest queued version is kept)."""
        with self._cond:
            if self._queued is not None:
                self._queued[2]()  # a newer version supersedes one not yet on the wire
            self._queued = (slot, slot.version, release)
            self._cond.notify_all()

    def _push_loop(self) -> None:
        assert self._store is not None  # `serve` made it before starting this thread
        try:
            self._group = self._make_group(self._store, 0)
        except Exception:  # noqa: BLE001 - the group never formed (closed, or peers missing)
            return
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    try:
                        self._broadcast(torch.full((_HEADER,), _GOODBYE, dtype=torch.int64))
                    except RuntimeError:
                        pass  # members are gone already
                    return
                assert self._queued is not None  # woken with a slot queued, or closed (returned above)
                slot, version, release = self._queued
                self._queued = None
            try:
                self._push(slot, version)
            except (RuntimeError, SluiceError):
                return  # a member died: the group is broken for good
            finally:
                release()

    def _push(self, slot, version: int) -> None:  # noqa: ANN001
        manifest = slot.manifest
        bucket = manifest.bucket_bytes
        header = torch.tensor(
            [version, manifest.id - (1 << 63), slot.size, manifest.num_buckets, bucket], dtype=torch.int64
        )
        self._broadcast(header)
        ok = True
        for k in range(manifest.num_buckets):
            end = min((k + 1) * bucket, slot.size)
            if ok:
                try:
                    slot.wait_filled(end, version, self.timeout)
                except SluiceError:
                    ok = False  # staging failed: keep the collective in step, mark it bad
            self._broadcast(slot.mapped.tensor[k * bucket : end])
        self._broadcast(torch.tensor([int(ok)], dtype=torch.int64))
        synchronize(self.receive_device)  # NCCL ran on its stream: done before the slot is released

    # -- subscriber ----------------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        """Receive broadcasts until one of version >= `job.version` arrives whole; sets
        `job.version` and `job.manifest` to what arrived."""
        try:
            if self._group is None:
                host, port = job.endpoint.rsplit(":", 1)
                store = dist.TCPStore(
                    host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout)
                )
                self.world_size = int(store.get(_WORLD))
                rank = store.add(_RANK, 1)
                if rank >= self.world_size:
                    raise WeightSyncError(
                        f"the torch group is full ({self.world_size} members); raise world_size at the publisher"
                    )
                self._group = self._make_group(store, rank)
            if self._ended:
                raise WeightSyncError("the publisher closed the torch group")
            while True:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                self._broadcast(header, _IDLE)  # the next version may be far off
                version, manifest, size, buckets, bucket = header.tolist()
                if version == _GOODBYE:
                    self._ended = True
                    raise WeightSyncError("the publisher closed the torch group")
                wanted = version >= job.version
                if wanted:
                    job.version, job.manifest = version, manifest + (1 << 63)
                into = job.into(size) if wanted else torch.empty(size, dtype=torch.uint8, device=self.device)
                for k in range(buckets):
                    self._broadcast(into[k * bucket : min((k + 1) * bucket, size)])
                ok = torch.zeros(1, dtype=torch.int64)
                self._broadcast(ok)
                if wanted:
                    if not ok.item():
                        raise WeightSyncError(f"the publisher abandoned version {version} while broadcasting it")
                    return into
        except RuntimeError as exc:
            raise WeightSyncError(f"torch.distributed broadcast failed: {exc}") from exc

    def close(self) -> None:
        """Publisher: say goodbye to the group and stop. Subscriber: leave; a receive blocked
        in the collective cannot be interrupted (gloo has no cancel) and ends with the group."""
        with self._cond:
            self._closed = True
            if self._queued is not None:
                self._queued[2]()
            self._queued = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
