"""The transport interface, the registry, and what every byte-stream transport shares.

A transport moves the staged bytes of one publisher rank to a subscriber. Publisher side:
`serve(source)` starts whatever serves the rank's slots and returns the endpoint subscribers
are told; `send(slot, release)` is called when a version starts staging in `slot` (push
transports broadcast it as it fills, pull transports have nothing to do). Subscriber side:
`receive(job)` brings one rank's bytes in and returns the tensor the job's reads resolve
against. `close()` ends both sides. `mode` says what `receive` returns:

- "map"   the publisher's slot itself, mapped (shm): reads index it by their slot offset and
          are copied straight into the subscriber's tensors at apply time.
- "image" a copy of the whole slot in the subscriber's buffer (torch broadcast).
- "reads" the job's reads back to back in the subscriber's buffer, as planned (tcp, ucx).

Byte-stream transports (tcp, ucx) speak one protocol: a request (`Pull` for a publisher,
`RelayPull` for a relaying subscriber), a status header, then every read's box as contiguous
bytes, in `read_chunks` pieces (message boundaries for transports that keep them). `Source`
turns a request into those views, waiting for bytes that are still being staged.
"""

from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Literal

import msgspec
import torch

from transfer_queue._errors import WeightSyncError, error_code, error_from_code

from ..layout import Box
from ..plan import Read
from ..protocol import DATA_DECODER, DATA_ENCODER, Granted, Pull, RelayPull

__all__ = [
    "Transport",
    "Job",
    "Source",
    "register",
    "get",
    "names",
    "read_chunks",
    "gather",
    "as_bytes",
    "encode_request",
    "decode_request",
    "STATUS",
    "status_header",
    "raise_status",
]

Mode = Literal["map", "image", "reads"]
GATHER_BYTES = 16 << 20
"""Most bytes of a strided box gathered at once on the sending side (bounds its scratch)."""


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


class Source(ABC):
    """What a stream server reads from: a publisher's slots or a relay's receive buffer."""

    @abstractmethod
    def open(self, request: Pull | RelayPull) -> tuple[Iterator[memoryview], Callable[[bool], None]]:
        """(the request's bytes as views, in `read_chunks` order, each valid until the next is
        taken; `done(ok)`, to call when the stream ended, completely or not). Raises
        `WeightSyncError` if the request cannot be served."""


class Transport(ABC):
    """One way of moving staged bytes; subclasses register themselves by `name`."""

    name: ClassVar[str]
    mode: ClassVar[Mode]
    fanout: int | None = None
    """Direct children per node of a relay tree; None: this transport does not relay."""

    @classmethod
    def is_available(cls) -> bool:
        """True when this transport can run here (its libraries import)."""
        return True

    def serve(self, source: Source) -> str:
        """Publisher side: start serving `source`; returns the endpoint for subscribers."""
        return ""

    def send(self, slot, release: Callable[[], None]) -> None:  # noqa: ANN001 - a staging.Slot
        """Publisher side: a version started staging in `slot`, pinned for this transport
        until it calls `release()` (pull transports have nothing to push: they release at once)."""
        release()

    @abstractmethod
    def receive(self, job: Job) -> torch.Tensor:
        """Subscriber side: bring `job`'s bytes in; raises `WeightSyncError` on failure."""

    def close(self) -> None:
        """Stop serving, drop connections and mappings."""


_REGISTRY: dict[str, type[Transport]] = {}


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


# -- the byte-stream protocol --------------------------------------------------------------


def _contiguous(shape: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
    """True when box [lo, hi) of a row-major `shape` is one contiguous run."""
    for d in range(len(shape)):
        if hi[d] - lo[d] != shape[d]:  # dims after d must be full, dims before d single
            return all(hi[k] - lo[k] == 1 for k in range(d)) and all(hi[k] - lo[k] == shape[k] for k in range(d + 1, len(shape)))
    return True


def read_chunks(read: Read) -> list[Box]:
    """Sub-boxes of `read`'s box whose bytes, concatenated, are the box's bytes (row-major):
    a contiguous box is one chunk; a strided one is cut along its outer dims into chunks of at
    most `GATHER_BYTES` (or single rows of its innermost dim)."""
    out: list[Box] = []

    def cut(lo: tuple[int, ...], hi: tuple[int, ...]) -> None:
        nbytes = math.prod(h - l for l, h in zip(lo, hi)) * read.itemsize
        if nbytes <= GATHER_BYTES or _contiguous(read.shape, lo, hi) or len(lo) == 1:
            out.append((lo, hi))
            return
        d = next(k for k in range(len(lo)) if hi[k] - lo[k] > 1)
        row = nbytes // (hi[d] - lo[d])
        step = max(1, GATHER_BYTES // row)
        for start in range(lo[d], hi[d], step):
            sub_lo = lo[:d] + (start,) + lo[d + 1 :]
            sub_hi = hi[:d] + (min(start + step, hi[d]),) + hi[d + 1 :]
            if row <= GATHER_BYTES:
                out.append((sub_lo, sub_hi))
            else:
                cut(sub_lo, sub_hi)

    cut(read.lo, read.hi)
    return out


def gather(slot: torch.Tensor, read: Read, box: Box, scratch: list[torch.Tensor]) -> memoryview:
    """The bytes of `box` (piece coordinates) of `read`'s piece in `slot`, as one buffer:
    a view of the slot when the box is contiguous there, else gathered into a scratch buffer
    of `GATHER_BYTES` (allocated into `scratch` on first need, then reused)."""
    lo, hi = box
    piece = slot[read.offset : read.end].view(*read.shape, read.itemsize)
    part = piece[tuple(slice(l, h) for l, h in zip(lo, hi))]
    if not part.is_contiguous():
        if not scratch:
            scratch.append(torch.empty(GATHER_BYTES, dtype=torch.uint8))
        part = scratch[0][: part.numel()].view(part.shape).copy_(part)
    return memoryview(part.numpy()).cast("B")


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 tensor (for `recv_into`-style receives)."""
    return memoryview(tensor.numpy()).cast("B")


STATUS = struct.Struct("<BI")
"""Reply header: 0 and 0 for "bytes follow", else 1 and the length of an error message."""


def encode_request(request: Pull | RelayPull) -> bytes:
    """The request's body (transports frame it: tcp prefixes its length, ucx sends it alone)."""
    return DATA_ENCODER.encode(request)


def decode_request(body: bytes) -> Pull | RelayPull:
    try:
        return DATA_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WeightSyncError(f"undecodable stream request: {exc}") from exc


def status_header(exc: BaseException | None) -> bytes:
    """The header that starts a reply: success, or `exc` as "code: message"."""
    if exc is None:
        return STATUS.pack(0, 0)
    text = f"{error_code(exc)}:{exc}".encode()
    return STATUS.pack(1, len(text)) + text


def raise_status(text: bytes) -> None:
    """Raise the error a stream server reported."""
    code, _, message = text.decode(errors="replace").partition(":")
    err = error_from_code(code, message)
    raise err if isinstance(err, WeightSyncError) else WeightSyncError(f"stream refused: {message}") from err
