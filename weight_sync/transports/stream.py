"""The byte-stream protocol the tcp and ucx transports share.

A request (`Pull` for a publisher, `RelayPull` for a relaying subscriber), a status header,
then every read's box as contiguous bytes, in `read_chunks` pieces (message boundaries for
transports that keep them). A `base.Source` turns a request into those views, waiting for bytes
that are still being staged; `gather` builds a strided box's bytes on the sending side.

A `Pull` with a base is answered with delta frames instead (`weight_sync.delta`): per read, a
header and its payload for each part of the read inside one staging bucket (`delta_frames`;
a strided read goes as WHOLE frames, `whole_frames`), which `receive_frames` applies to the
subscriber's copy of the base in its receive buffer. A relaying subscriber keeps the frames
it received (`FrameLog`) and forwards them to a `RelayPull` against the same base.
"""

from __future__ import annotations

import functools
import math
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from transfer_queue import WeightSyncError
from transfer_queue.cuda import pinned_empty
from transfer_queue.wire.rpc import error_code, error_from_code

from ..delta import GAPS, HEADER, WHOLE, Changes, Frame, apply, encode_span
from ..layout import Box
from ..plan import Read
from ..protocol import DATA_DECODER, DATA_ENCODER, Pull, RelayPull

__all__ = [
    "GATHER_BYTES",
    "IN_FLIGHT",
    "read_chunks",
    "Scratch",
    "gather",
    "as_bytes",
    "Landing",
    "encode_request",
    "decode_request",
    "STATUS",
    "status_header",
    "raise_status",
    "contiguous_span",
    "delta_frames",
    "whole_frames",
    "receive_frames",
    "FrameLog",
]

GATHER_BYTES = 4 << 20
"""Most bytes of a strided box gathered at once on the sending side (its scratch holds
`IN_FLIGHT` of these: 64 MiB)."""
IN_FLIGHT = 16
"""Views of one stream a sender may have in flight at once: a `Source`'s view stays valid until
`IN_FLIGHT` more have been taken (ucx keeps that many sends posted, so it goes from one piece
straight to the next instead of waiting for Python to learn of each completion)."""


def _contiguous(shape: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]) -> bool:
    """True when box [lo, hi) of a row-major `shape` is one contiguous run."""
    for d in range(len(shape)):
        if hi[d] - lo[d] != shape[d]:  # dims after d must be full, dims before d single
            return all(hi[k] - lo[k] == 1 for k in range(d)) and all(
                hi[k] - lo[k] == shape[k] for k in range(d + 1, len(shape))
            )
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


class Scratch:
    """The buffers strided boxes of one stream are gathered into: `IN_FLIGHT` of `GATHER_BYTES`,
    allocated on first need and handed out in turn, so a gathered view stays valid while the
    next `IN_FLIGHT - 1` are taken."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._taken = 0

    def take(self) -> torch.Tensor:
        """The next buffer, `GATHER_BYTES` of uint8 (the oldest one again after `IN_FLIGHT`)."""
        if len(self._buffers) < IN_FLIGHT:
            self._buffers.append(torch.empty(GATHER_BYTES, dtype=torch.uint8))
        buffer = self._buffers[self._taken % IN_FLIGHT]
        self._taken += 1
        return buffer


def gather(slot: torch.Tensor, read: Read, box: Box, scratch: Scratch) -> memoryview:
    """The bytes of `box` (piece coordinates) of `read`'s piece in `slot`, as one buffer:
    a view of the slot when the box is contiguous there, else gathered into `scratch`'s next
    buffer."""
    lo, hi = box
    piece = slot[read.offset : read.end].view(*read.shape, read.itemsize)
    part = piece[tuple(slice(l, h) for l, h in zip(lo, hi))]
    if not part.is_contiguous():
        part = scratch.take()[: part.numel()].view(part.shape).copy_(part)
    return part.numpy().data.cast("B")


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 tensor (for `recv_into`-style receives)."""
    return tensor.numpy().data.cast("B")


class Landing:
    """Where a stream's bytes land on their way into a receive buffer in GPU memory (a socket
    can fill only host memory): `LANDING_BUFFERS` pinned buffers of `LANDING_BYTES`, taken in
    turn, each copied to the GPU on a stream of its own while the next one is received. One
    per receiving transport, used by one thread at a time; the buffers are allocated on first
    use and reused from version to version."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._stream: Any = None

    def receive(self, recv: Callable[[memoryview], None], target: torch.Tensor) -> None:
        """Fill `target` (uint8 on `device`) with the next `target.numel()` bytes `recv`
        reads; returns once they are in `target`. Whatever `recv` raises is raised as it is,
        with no copy still running."""
        if self._stream is None:  # the stream last: a failed allocation is tried again next time
            self._buffers = [pinned_empty(LANDING_BYTES) for _ in range(LANDING_BUFFERS)]
            self._events = [None] * LANDING_BUFFERS
            self._stream = torch.cuda.Stream(self.device)
        try:
            for turn, lo in enumerate(range(0, target.numel(), LANDING_BYTES)):
                which = turn % LANDING_BUFFERS
                if self._events[which] is not None:
                    self._events[which].synchronize()  # its last copy to the GPU is done
                hi = min(lo + LANDING_BYTES, target.numel())
                landed = self._buffers[which][: hi - lo]
                recv(as_bytes(landed))
                with torch.cuda.stream(self._stream):
                    target[lo:hi].copy_(landed, non_blocking=True)
                    self._events[which] = self._stream.record_event()
        finally:
            self._stream.synchronize()


LANDING_BYTES = 8 << 20
"""Bytes a `Landing` buffer takes: large enough that each copy to the GPU costs little beyond
its bytes, small enough that the buffers hold little pinned memory."""
LANDING_BUFFERS = 4
"""`Landing` buffers in turn: the socket fills one while the others' copies run."""


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


def contiguous_span(read: Read) -> tuple[int, int] | None:
    """[start, stop) bytes of `read`'s box in the slot when the box is one contiguous run."""
    if not _contiguous(read.shape, read.lo, read.hi):
        return None
    first = 0
    for lo, size in zip(read.lo, read.shape):
        first = first * size + lo
    start = read.offset + first * read.itemsize
    return start, start + read.nbytes


_INLINE = 64 << 10
"""A bucket with fewer changed bytes than this is encoded on the stream's own thread, and a
GAPS frame with a shorter payload is applied there: handing them to a pool would cost about
as much as the work."""


def delta_frames(
    slot: torch.Tensor,
    span: tuple[int, int],
    changes_of: Callable[[int], Changes | None],
    bucket_bytes: int,
    base: int,
    encoder: Executor | None = None,
    ahead: int = 1,
    ready: Callable[[int], bool] = lambda k: True,
    filled: Callable[[int], None] = lambda end: None,
) -> Iterator[memoryview]:
    """Frames for bytes [start, stop) of `slot` against version `base`: a header and payload
    per staging bucket the span touches; `changes_of(k)` gives bucket k's changes (None:
    whole), waiting for them if need be. With an `encoder` pool, buckets with changes worth
    it are encoded there, up to `ahead` of them while the earlier frames are sent; while the
    next bucket's changes are not `ready(k)` (a non-blocking look), the oldest encoded frames
    are sent instead of waiting for them with the link idle. Only a WHOLE frame sends the
    slot's bytes, so only it waits for them to be staged (`filled(end)` blocks until bytes
    [0, end) of the slot are): a GAPS frame comes from its changes, which the compare found
    in the staged bytes or in the version packed on the GPU, and goes out while the slot
    is still being staged."""
    start, stop = span
    pending: deque[tuple[Future[tuple[Frame, torch.Tensor | None]], int, int]] = deque()

    def send(job: Future[tuple[Frame, torch.Tensor | None]], lo: int, hi: int) -> Iterator[memoryview]:
        frame, payload = job.result()
        if payload is None:
            filled(hi)
        yield memoryview(frame.pack())
        yield as_bytes(slot[lo:hi] if payload is None else payload)

    try:
        for k in range(start // bucket_bytes, -(-stop // bucket_bytes)):
            while pending and not ready(k):
                yield from send(*pending.popleft())
            lo, hi = max(start, k * bucket_bytes), min(stop, (k + 1) * bucket_bytes)
            at = k * bucket_bytes
            changes = changes_of(k)
            encode = functools.partial(encode_span, changes, lo - at, hi - at, base)
            job: Future[tuple[Frame, torch.Tensor | None]] = Future()
            if encoder is None or changes is None or changes.count < _INLINE:
                job.set_result(encode())
            else:
                job = encoder.submit(encode)
            pending.append((job, lo, hi))
            while pending and (len(pending) > ahead or pending[0][0].done()):
                yield from send(*pending.popleft())
        while pending:
            yield from send(*pending.popleft())
    finally:  # the stream ended early: drop the encodes not yet started
        for job, _, _ in pending:
            job.cancel()


def whole_frames(slot: torch.Tensor, read: Read, scratch: Scratch, base: int) -> Iterator[memoryview]:
    """A strided read in a delta stream: each `read_chunks` piece as a WHOLE frame."""
    for box in read_chunks(read):
        view = gather(slot, read, box, scratch)
        yield memoryview(Frame(WHOLE, len(view), 0, 0, base, 0, 0).pack())
        yield view


class FrameLog:
    """The delta frames one rank's stream brought a relaying subscriber, in order, so that it
    can forward them to subscribers that hold the same base: each frame with its payload
    (None for WHOLE frames, whose bytes are the buffer's). No bigger than the version, and
    replaced by the next version's."""

    def __init__(self, base: int) -> None:
        self.base = base
        self.frames: list[tuple[Frame, torch.Tensor | None]] = []


@dataclass
class _Applied:
    """A received frame on its way into the buffer: what the stream's log keeps of it, the
    buffer byte it completes, and whether its apply ended."""

    frame: Frame
    payload: torch.Tensor | None
    end: int
    applied: bool = False


class _InOrder:
    """Reports a stream's frames in stream order as their applies end, on whichever thread
    ends one (the receiving thread or an apply thread): each is logged, then `progress` is
    called with the byte it completes, once it and every frame before it are applied. The
    first failure (a bad frame, or `progress` raising) stops all reporting after it."""

    def __init__(self, progress: Callable[[int], None], log: FrameLog | None, bound: int) -> None:
        self.progress = progress
        self.log = log
        self.bound = bound
        self.frames: deque[_Applied] = deque()
        self.failure: BaseException | None = None
        self.cond = threading.Condition()

    def add(self, frame: Frame, payload: torch.Tensor | None, end: int) -> _Applied:
        """A received frame, before its apply starts; waits while `bound` frames are not yet
        reported (their payloads are held), and raises the first failure."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.frames) < self.bound or self.failure is not None)
            self.check()
            entry = _Applied(frame, payload, end)
            self.frames.append(entry)
            return entry

    def done(self, entry: _Applied, job: Future[None] | None = None) -> None:
        """`entry`'s apply ended (`job`: on the pool, maybe with an error)."""
        with self.cond:
            try:
                if job is not None:
                    job.result()  # its error, or CancelledError once the pull failed
                entry.applied = True
                while self.failure is None and self.frames and self.frames[0].applied:
                    oldest = self.frames.popleft()
                    if self.log is not None:
                        self.log.frames.append((oldest.frame, oldest.payload))
                    self.progress(oldest.end)
            except BaseException as exc:  # noqa: BLE001 - kept for the receiving thread to raise
                if self.failure is None:
                    self.failure = exc
            finally:
                self.cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        """The receiving thread failed: nothing more is reported."""
        with self.cond:
            if self.failure is None:
                self.failure = exc

    def check(self) -> None:
        """Raise the first failure, if any (the caller holds `cond` or is the only thread)."""
        if self.failure is not None:
            raise self.failure

    def drain(self) -> None:
        """Wait until every frame is reported; raises the first failure."""
        with self.cond:
            self.cond.wait_for(lambda: not self.frames or self.failure is not None)
            self.check()


def receive_frames(
    recv: Callable[[memoryview], None],
    buffer: torch.Tensor,
    reads: Sequence[Read],
    offsets: Sequence[int],
    base: int,
    progress: Callable[[int], None],
    log: FrameLog | None = None,
    workers: int = 1,
    landing: Landing | None = None,
) -> int:
    """Apply a delta stream to `buffer` (uint8, holding version `base` of these reads at
    `offsets`): `recv(view)` fills `view` from the stream; `progress(n)` once bytes [0, n) of
    the buffer hold the new version, each frame having been added to `log` before. Returns
    the bytes the stream carried. A `buffer` in GPU memory takes WHOLE frames through
    `landing` and GAPS frames as their payloads, applied there (`delta.apply`).

    With `workers` > 1 (`delta.threads()`, read by the subscriber when it was built), GAPS
    frames are applied on a pool of that many threads while this thread receives the next
    ones (each checks its own payload and base before writing its span, which no other frame
    touches). Frames are logged and reported in stream order as soon as their applies end, by
    the thread that ends one (so `progress` and `log` must be safe to call from any thread).
    At most `2 * workers + 1` frames are received and not yet reported, so a stream holds at
    most that many payloads plus the one being received. With 1, everything runs on this
    thread, each frame reported as it is applied.

    Raises:
        WeightSyncError: a frame is malformed, corrupt or meant for another base, or an apply
            thread could not be started (the buffer is then part new, part base: the caller
            discards it). Nothing is reported past the frame before it, and no apply is
            still running when it is raised. Whatever `recv` or `progress` raise is raised
            as it is, also with no apply running.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix="sluice-ws-apply") if workers > 1 else None
    order = _InOrder(progress, log, 2 * workers + 1)
    head = bytearray(HEADER.size)
    carried = 0
    try:
        for read, offset in zip(reads, offsets):
            covered = 0
            while covered < read.nbytes:
                recv(memoryview(head))
                frame = Frame.unpack(head)
                if frame.span <= 0 or covered + frame.span > read.nbytes or frame.base != base:
                    raise WeightSyncError(f"delta frame {frame} does not fit this pull (base {base})")
                target = buffer[offset + covered : offset + covered + frame.span]
                payload = None
                if frame.kind == WHOLE:
                    if landing is not None:
                        landing.receive(recv, target)
                    else:
                        recv(as_bytes(target))
                else:
                    assert frame.kind == GAPS
                    payload = torch.empty(frame.payload, dtype=torch.uint8)
                    recv(as_bytes(payload))
                carried += HEADER.size + frame.payload
                covered += frame.span
                entry = order.add(frame, payload, offset + covered)
                if payload is None:
                    order.done(entry)
                elif pool is None or frame.payload < _INLINE:
                    apply(frame, payload, target)
                    order.done(entry)
                else:
                    try:
                        job = pool.submit(apply, frame, payload, target)
                    except RuntimeError as exc:  # "can't start new thread": a pids or memory limit
                        raise WeightSyncError(f"no thread to apply a delta frame on: {exc}") from exc
                    job.add_done_callback(functools.partial(order.done, entry))
                with order.cond:
                    order.check()
        order.drain()
    except BaseException as exc:
        order.fail(exc)
        raise
    finally:
        if pool is not None:  # on a failure: the queued applies are dropped, the running ones end
            pool.shutdown(wait=True, cancel_futures=True)
    return carried
