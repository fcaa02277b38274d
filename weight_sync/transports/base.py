"""The transport interface and the registry.

A transport moves the staged bytes of one publisher rank to a subscriber. Publisher side:
`serve(source)` starts whatever serves the rank's slots and returns the endpoint subscribers
are told; `send(slot, release)` is called when a version starts staging in `slot` (push
transports broadcast it as it fills, pull transports have nothing to do). Subscriber side:
`receive(job)` brings one rank's bytes in and returns the tensor the job's reads resolve
against. `close()` ends both sides. `mode` says what `receive` returns, and so which receiver
strategy a subscriber runs (`weight_sync.receivers`):

- "map"   the publisher's slot itself, mapped (shm): reads index it by their slot offset and
          are copied straight into the subscriber's tensors at apply time.
- "image" a copy of the whole slot in the subscriber's buffer (torch broadcast).
- "reads" the job's reads back to back in the subscriber's buffer, as planned (tcp, ucx).

What the byte-stream transports (tcp, ucx) share beyond this lives in `stream`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch

from transfer_queue import SchemaError, WeightSyncError

from ..delta import Changes
from ..plan import Read
from ..protocol import Granted, Pull, RelayPull, SlotInfo
from .stream import FrameLog, Landing, receive_frames

__all__ = [
    "Transport",
    "MapTransport",
    "Mode",
    "Job",
    "Source",
    "StagedChanges",
    "memory_device",
    "register",
    "get",
    "names",
]

Mode = Literal["map", "image", "reads"]


@dataclass
class Job:
    """What a subscriber asks of a transport for one publisher rank and one version."""

    rank: int
    version: int
    """The version wanted; "image" transports set it to the (maybe newer) one that arrived."""
    manifest: int
    """Id of the rank's manifest for `version` (set by "image" transports, like `version`)."""
    endpoint: str
    """The rank's endpoint for this transport."""
    grant: Granted | None
    """The lease on the rank's slot (pull and map transports); `grant.source` names a relay."""
    reads: list[Read]
    offsets: list[int]
    """Byte offset of each read in the buffer ("reads" transports)."""
    digest: int
    """Identifies `reads` (relays serve only an identical plan)."""
    into: Callable[[int], torch.Tensor]
    """Returns the subscriber's uint8 buffer for this many bytes ("reads", "image")."""
    progress: Callable[[int], None]
    """Called with the number of bytes of the buffer received so far (relays forward them)."""
    timeout: float
    base: int = -1
    """The version the buffer already holds for these reads, to pull a delta against
    (-1: pull whole). Only transports with `deltas` are given one."""
    log: FrameLog | None = None
    """Where a relaying subscriber keeps the delta frames it receives, to forward them."""
    base_image: torch.Tensor | None = None
    """"image" transports: the receive buffer that holds version `base` whole (a delta is
    applied to a copy of it in the buffer `into` gives; the same buffer: in place)."""
    received: int = 0
    """Set by streaming transports: the bytes the stream carried (frames or whole reads)."""
    delta_threads: int = 1
    """Threads a streaming transport applies a delta's frames on (`delta.threads()`, read
    once when the subscriber was built)."""

    @property
    def nbytes(self) -> int:
        """Bytes the job's reads take in the buffer (the last read's end)."""
        return self.offsets[-1] + self.reads[-1].nbytes if self.reads else 0

    def buffer(self) -> torch.Tensor:
        """The subscriber's buffer for every read of this job (`into` of `nbytes`)."""
        return self.into(self.nbytes)

    def receive_delta(self, recv: Callable[[memoryview], None], landing: Landing | None = None) -> torch.Tensor:
        """Apply the delta stream `recv` reads (`stream.receive_frames`) to this job's buffer,
        which holds version `base` of its reads; returns the buffer, `received` set. A buffer
        in GPU memory needs `landing`.

        Raises:
            WeightSyncError: a frame is malformed, corrupt or meant for another base (the
                buffer is then part new, part base: discard it).
        """
        into = self.buffer()
        self.received = receive_frames(
            recv, into, self.reads, self.offsets, self.base, self.progress, self.log, self.delta_threads, landing
        )
        return into


class StagedChanges(Protocol):
    """The changes of a staged version against its base, bucket by bucket as the publisher's
    compare threads find them, in any order (`publisher._StagedDelta`)."""

    version: int
    base: int

    def ready(self, bucket: int) -> bool:
        """Whether `changes(bucket)` would return (or raise) at once."""
        ...

    def changes(self, bucket: int, timeout: float) -> Changes | None:
        """Bucket `bucket`'s changes (None: dense, send it whole), waiting for the compare;
        raises `WeightSyncError` if the version failed, `TimeoutError` after `timeout` s."""
        ...


class Source(ABC):
    """What a stream server reads from: a publisher's slots or a relay's receive buffer.
    Push transports (torch) use only the publisher's `staged_delta` and `record`."""

    @abstractmethod
    def open(self, request: Pull | RelayPull) -> tuple[Iterator[memoryview], Callable[[bool], None]]:
        """(the request's bytes as views, in `stream.read_chunks` order, each valid until
        `stream.IN_FLIGHT` more are taken; `done(ok)`, to call when the stream ended, completely
        or not). Raises `WeightSyncError` if the request cannot be served."""

    def staged_delta(self, slot) -> StagedChanges | None:  # noqa: ANN001 - a staging.Slot
        """The changes of the version staged in `slot` against its base, if it is compared
        (publisher sources with deltas on); None: it can only go whole."""
        return None

    def record(self, version: int, requested: int, sent: int, delta: bool) -> None:
        """A transfer of `version` to one receiver ended: `requested` bytes whole, `sent` on the
        wire, as a delta or whole (the publisher's `stats`)."""


class Transport(ABC):
    """One way of moving staged bytes; subclasses register themselves by `name`."""

    name: ClassVar[str]
    mode: ClassVar[Mode]
    fanout: int | None = None
    """Direct children per node of a relay tree; None: this transport does not relay."""
    staging: str = "host"
    """Where a publisher serving this transport stages versions: "host" memory, or "cuda" (GPU
    slots; a publisher cannot serve transports of both kinds)."""
    receive_device: torch.device | None = None
    """Where a subscriber's receive buffers live: None for host memory, else a CUDA device."""
    pipelined: ClassVar[bool] = True
    """Whether a subscriber may read a version still being staged (the rank's server waits for
    its bytes); False: it reads complete versions only (one-sided reads cannot wait)."""
    deltas: bool = False
    """Whether `receive` takes a delta when the job has a base (`Job.base`)."""

    @classmethod
    def is_available(cls) -> bool:
        """True when this transport can run here (its libraries import)."""
        return True

    def serve(self, source: Source) -> str:
        """Publisher side: start serving `source`; returns the endpoint for subscribers."""
        return ""

    def describe(self, slot) -> bytes:  # noqa: ANN001 - a staging.Slot
        """Publisher side: what a subscriber leasing `slot` needs to reach it with this
        transport (sent in its grant as `SlotInfo.handle`); raises `WeightSyncError` if the
        slot cannot be offered."""
        return b""

    def send(self, slot, release: Callable[[], object]) -> None:  # noqa: ANN001 - a staging.Slot
        """Publisher side: a version started staging in `slot`, pinned for this transport
        until it calls `release()` (pull transports have nothing to push: they release at once)."""
        release()

    @abstractmethod
    def receive(self, job: Job) -> torch.Tensor:
        """Subscriber side: bring `job`'s bytes in; raises `WeightSyncError` on failure."""

    def close(self) -> None:
        """Stop serving, drop connections and mappings."""


def memory_device(owner: str, memory: str | torch.device) -> torch.device | None:
    """What a transport's `memory=` names (`owner`, e.g. "TcpTransport", for the errors): None
    for "host", else the CUDA device (its index filled in: the current device for a bare
    "cuda").

    Raises:
        SchemaError: `memory` is neither "host" nor a CUDA device, or names CUDA in a process
            without CUDA, or a device it does not see.
    """
    if memory == "host":
        return None
    device = None
    if isinstance(memory, (str, torch.device)):  # not an int: torch reads 0 as a CUDA device
        try:
            device = torch.device(memory)
        except RuntimeError:
            pass
    if device is None or device.type != "cuda":
        raise SchemaError(f"{owner}(memory={memory!r}): 'host' or a CUDA device ('cuda', 'cuda:1')")
    if not torch.cuda.is_available():
        raise SchemaError(
            f"{owner}(memory={memory!r}) puts buffers in GPU memory, and this process has no CUDA "
            "(torch sees no CUDA device); use memory='host'"
        )
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= torch.cuda.device_count():
        raise SchemaError(f"{owner}(memory={memory!r}): this process sees {torch.cuda.device_count()} CUDA device(s)")
    return device


_REGISTRY: dict[str, type[Transport]] = {}


class MapTransport(Transport):
    """A "map" transport: subscribers read the publisher's slots in place, each opened once per
    slot generation (`open`), on the lease's grant or ahead of the first version."""

    mode = "map"

    @abstractmethod
    def open(self, rank: int, slot: SlotInfo) -> torch.Tensor:
        """Rank `rank`'s `slot` as a uint8 tensor (mapped, registered or opened once per slot
        generation); raises `WeightSyncError` if it cannot be reached."""

    def receive(self, job: Job) -> torch.Tensor:
        assert job.grant is not None  # a subscriber leases the slot before a "map" transport reads it
        return self.open(job.rank, job.grant.slot)

    def open_ahead(self, rank: int, slot: SlotInfo) -> None:
        """Open rank `rank`'s `slot` before any version needs it; a failure is left for the
        version's `receive` to report."""
        with contextlib.suppress(WeightSyncError):
            self.open(rank, slot)


def register(cls: type[Transport]) -> type[Transport]:
    """Class decorator: make `cls` available under `cls.name`; refuses duplicates."""
    if cls.name in _REGISTRY:
        raise ValueError(f"a transport named {cls.name!r} is already registered ({_REGISTRY[cls.name].__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def get(name: str) -> type[Transport]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}") from None


def names() -> list[str]:
    return sorted(_REGISTRY)
