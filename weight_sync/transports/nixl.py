"""`nixl`: NVIDIA's NIXL (its UCX backend): subscribers READ their plan's bytes straight out of the
publisher's registered staging, with no server loop on the publisher's side.

The publisher's NIXL agent registers each staging slot once (per slot generation); the slot's
address, its memory (host "DRAM" or GPU "VRAM", and which GPU) and the agent's metadata (its
connection info and the slot's remote keys) travel in the subscriber's `Granted` reply
(`SlotInfo.handle`, a msgspec struct, never pickled), over the channel's control connection,
which is authenticated like every other (CurveZMQ with the cluster's credentials): only a
subscriber holding a lease learns where to read. A subscriber adds the publisher's agent once
(again when its metadata changes, e.g. a slot was reallocated), registers each receive buffer
once, and reads every read's contiguous runs in one NIXL transfer into the buffer where its plan
puts them. A READ cannot wait for bytes still being staged, so subscribers read complete
versions only (`pipelined = False`).

Memory: `NixlTransport(memory="host")` (the default) stages in host slots and receives into
host buffers. `memory="cuda"` (or "cuda:N") stages in GPU slots on a publisher (a device-to-
device snapshot, as for `cuda_ipc`) and receives into a GPU buffer on a subscriber
(`receive_device`), so the READ is GPU to GPU: UCX moves it with cuda_ipc / cuda_copy on one
host and GPUDirect RDMA across hosts where the NIC allows it, and the apply is a device-to-device
copy. The two sides choose independently (a host-memory subscriber may read GPU slots, UCX then
copies device to host). GPU memory needs UCX's CUDA transports: a UCX built with CUDA (the
`nixl-cu13` wheel's is) and, where `UCX_TLS` is set (the `ucx` transport sets `tcp,sm,self` in
its process when it is not), `cuda_copy` and `cuda_ipc` among them; NIXL refusing to register
GPU memory raises `WeightSyncError` saying so.

An optional extra (`pip install sluice-rl[nixl]`: PyPI `nixl-cu13`, import name `nixl_cu13`);
`is_available()` is False without it. NIXL's UCX honours `UCX_TLS` like the `ucx` transport.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import math
import os
import threading
import time
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np
import torch

from transfer_queue import WeightSyncError
from transfer_queue.cuda import make_current

from ..plan import Read
from .base import Job, Transport, memory_device, register

__all__ = ["NixlTransport", "NixlSlot", "runs"]

_MODULES = ("nixl_cu13", "nixl_cu12")
"""NIXL's Python packages on PyPI, by CUDA major version (either runs without a GPU)."""

_ids = itertools.count()


def _nixl() -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL prints every agent's creation at INFO to stdout
    for name in _MODULES:
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    raise WeightSyncError("the nixl transport needs NIXL: pip install sluice-rl[nixl]")


class NixlSlot(msgspec.Struct, frozen=True, array_like=True):
    """Where a granted slot can be read (`SlotInfo.handle` of a `nixl` grant)."""

    agent: str
    """The publisher's NIXL agent name."""
    metadata: bytes
    """`get_agent_metadata()` after the slot was registered: what `add_remote_agent` takes."""
    address: int
    """The slot's first byte in the publisher's address space."""
    device: int = 0
    """NIXL's device id of the slot's memory: the CUDA device's index for "VRAM", 0 for "DRAM"."""
    memory: Literal["DRAM", "VRAM"] = "DRAM"
    """NIXL's memory type of the slot: host ("DRAM") or GPU ("VRAM") memory."""


_SLOT_ENCODER = msgspec.msgpack.Encoder()
_SLOT_DECODER = msgspec.msgpack.Decoder(NixlSlot)


def runs(read: Read) -> np.ndarray:
    """The contiguous byte runs of `read`'s box in its rank's slot, row-major: an (n, 2) int64
    array of (slot offset, bytes). Their bytes, concatenated, are the read's bytes on the wire."""
    shape, lo, hi, size = read.shape, read.lo, read.hi, read.itemsize
    d = len(shape) - 1  # the outermost dim from which the box spans whole rows
    while d > 0 and lo[d] == 0 and hi[d] == shape[d]:
        d -= 1
    inner = math.prod(shape[d + 1 :]) * size
    length = (hi[d] - lo[d]) * inner
    strides = [math.prod(shape[k + 1 :]) * size for k in range(d)]
    starts = np.full(1, read.offset + lo[d] * inner, np.int64)
    for k in range(d):  # every combination of the outer dims' indexes, row-major
        idx = np.arange(lo[k], hi[k], dtype=np.int64) * strides[k]
        starts = (starts[:, None] + idx[None, :]).reshape(-1)
    return np.stack([starts, np.full(len(starts), length, np.int64)], axis=1)


def _where(tensor: torch.Tensor) -> tuple[Literal["DRAM", "VRAM"], int]:
    """NIXL's (memory type, device id) of `tensor`'s memory."""
    return ("VRAM", tensor.get_device()) if tensor.is_cuda else ("DRAM", 0)


def _register(agent: Any, address: int, size: int, memory: str, device: int, what: str) -> Any:
    """Register `size` bytes at `address` (NIXL's `memory` type on `device`) with `agent`;
    returns the registration.

    Raises:
        WeightSyncError: NIXL refused (GPU memory: a UCX without its CUDA transports).
    """
    try:
        if memory == "VRAM" and torch.cuda.is_available():  # (without CUDA, UCX refuses it below)
            make_current(torch.device("cuda", device))  # UCX registers it through this thread's context
        return agent.register_memory([(address, size, device, "")], memory)
    except Exception as exc:  # noqa: BLE001 - nixlBind raises its own types, torch.cuda RuntimeError
        hint = (
            " (GPU memory needs UCX's CUDA transports: a UCX built with CUDA, as in the nixl-cu13 wheel, and "
            f"cuda_copy and cuda_ipc among UCX_TLS where it is set; here UCX_TLS={os.environ.get('UCX_TLS')!r})"
            if memory == "VRAM"
            else ""
        )
        raise WeightSyncError(f"nixl could not register {what} ({memory}, {size} bytes){hint}: {exc!r}") from exc


def _wait(agent: Any, handle: Any, timeout: float, what: str) -> None:
    """Poll a NIXL transfer until it is done; NIXL offers no blocking wait (backing off up to 1 ms)."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise WeightSyncError(f"nixl read of {what} failed (is the publisher gone?)")
        if time.monotonic() > deadline:
            raise WeightSyncError(f"nixl read of {what} did not finish within {timeout} s")
        time.sleep(pause)
        pause = min(1e-3, pause + 5e-5)


@register
class NixlTransport(Transport):
    """NIXL agents, one per transport: the publisher's registers its slots, a subscriber's its
    receive buffers and reads into them.

    Args:
        memory: "host" (the default): host staging slots and host receive buffers. "cuda" or
            "cuda:N": a publisher stages in GPU slots on its weights' device (the current one
            for CPU weights), `slots` × the model's bytes of GPU memory as for `cuda_ipc`, and
            then serves no host-staging transport beside it (only `cuda_ipc` does); a subscriber receives into a GPU
            buffer on the named device (the current one for "cuda"), so READs go GPU to GPU.

    Raises:
        SchemaError: `memory` is neither "host" nor a CUDA device, or names CUDA in a process
            without CUDA, or a device it does not see.
    """

    name = "nixl"
    mode = "reads"
    pipelined: ClassVar[bool] = False

    def __init__(self, memory: str | torch.device = "host") -> None:
        device = memory_device("NixlTransport", memory)
        if device is not None:
            self.staging = "cuda"
            self.receive_device = device
        self._agent: Any = None
        self._lock = threading.Lock()
        self._slots: dict[int, tuple[int, Any, bytes]] = {}  # slot index -> (generation, registration, handle)
        self._buffers: dict[tuple[int, int], Any] = {}  # (address, bytes) -> registration
        self._remotes: dict[str, bytes] = {}  # publisher agent -> the metadata added

    @classmethod
    def is_available(cls) -> bool:
        return any(importlib.util.find_spec(name) is not None for name in _MODULES)

    def _get_agent(self) -> Any:
        if self._agent is None:
            nixl = _nixl()
            config = nixl.nixl_agent_config(backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self._agent = nixl.nixl_agent(f"sluice-{os.getpid()}-{next(_ids)}-{os.urandom(4).hex()}", config)
        return self._agent

    # -- publisher side ------------------------------------------------------------------

    def serve(self, source) -> str:  # noqa: ANN001 - nothing to serve: subscribers read
        return self._get_agent().name

    def describe(self, slot) -> bytes:  # noqa: ANN001 - a staging.Slot
        """Register `slot`'s segment with the agent (once per generation) and say where it is;
        raises `WeightSyncError` if NIXL refuses the memory."""
        with self._lock:
            held = self._slots.get(slot.index)
            if held is not None and held[0] == slot.generation:
                return held[2]
            agent = self._get_agent()
            if held is not None:
                agent.deregister_memory(held[1])
                del self._slots[slot.index]
            tensor = slot.mapped.tensor
            memory, device = _where(tensor)
            registration = _register(agent, tensor.data_ptr(), slot.size, memory, device, f"staging slot {slot.index}")
            handle = _SLOT_ENCODER.encode(
                NixlSlot(agent.name, agent.get_agent_metadata(), tensor.data_ptr(), device, memory)
            )
            self._slots[slot.index] = (slot.generation, registration, handle)
            return handle

    # -- subscriber side -----------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        grant = job.grant
        assert grant is not None  # a subscriber leases the slot before a "reads" transport reads it
        try:
            where = _SLOT_DECODER.decode(grant.slot.handle)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WeightSyncError(f"rank {job.rank} granted a slot without a nixl handle: {exc}") from None
        total = job.nbytes
        into = job.buffer()
        if not total:
            return into
        agent = self._get_agent()
        remote = self._remote(agent, where)
        local = self._buffer(agent, into)
        spans = [runs(read) for read in job.reads]
        remote_descs = np.concatenate(spans)
        remote_descs[:, 0] += where.address
        lengths = remote_descs[:, 1]
        starts = np.concatenate(
            [offset + np.concatenate(([0], np.cumsum(s[:-1, 1]))) for offset, s in zip(job.offsets, spans)]
        )
        zeros = np.zeros(len(starts), np.int64)
        memory, device = _where(into)
        local_descs = np.stack([starts + local, lengths, zeros + device], axis=1).astype(np.uint64)
        remote_descs = np.stack([remote_descs[:, 0], lengths, zeros + where.device], axis=1).astype(np.uint64)
        what = f"version {job.version} from rank {job.rank}"
        if into.is_cuda:  # UCX copies through this thread's context (the buffer's fill ended when made)
            make_current(into.device)
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_descs, memory),
                agent.get_xfer_descs(remote_descs, where.memory),
                remote,
            )
        except Exception as exc:  # noqa: BLE001 - nixlBind raises its own types
            raise WeightSyncError(f"nixl could not prepare the read of {what}: {exc}") from exc
        try:
            if agent.transfer(handle) != "DONE":
                _wait(agent, handle, job.timeout, what)
        finally:
            agent.release_xfer_handle(handle)
        job.progress(total)
        return into

    def _remote(self, agent: Any, where: NixlSlot) -> str:
        """The publisher's agent, added (again when its metadata changed)."""
        if self._remotes.get(where.agent) != where.metadata:
            if where.agent in self._remotes:
                agent.remove_remote_agent(where.agent)
            try:
                agent.add_remote_agent(where.metadata)
            except Exception as exc:  # noqa: BLE001 - nixlBind raises its own types
                raise WeightSyncError(f"nixl could not add the publisher's agent {where.agent}: {exc}") from exc
            self._remotes[where.agent] = where.metadata
        return where.agent

    def _buffer(self, agent: Any, into: torch.Tensor) -> int:
        """Register the receive buffer (once; registrations of memory it now overlaps, which
        was freed and reused, are dropped first) and return its address."""
        start, size = key = (into.data_ptr(), into.numel())
        if key not in self._buffers:
            for old in [k for k in self._buffers if k[0] < start + size and start < k[0] + k[1]]:
                agent.deregister_memory(self._buffers.pop(old))
            self._buffers[key] = _register(agent, start, size, *_where(into), "the receive buffer")
        return start

    def close(self) -> None:
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            for _, registration, _ in self._slots.values():
                agent.deregister_memory(registration)
            for registration in self._buffers.values():
                agent.deregister_memory(registration)
            for name in self._remotes:
                agent.remove_remote_agent(name)
            self._slots.clear()
            self._buffers.clear()
            self._remotes.clear()
