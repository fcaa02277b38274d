"""Delta encoding of weight versions: only the bytes that changed since the subscriber's version.

Between two RL policy versions most bf16 weights do not change at all, and those that change
mostly move by one unit in the last place, which touches only the low byte. So the unit of
change is the byte, not the element: `compare` makes one vectorised pass over a staged range
(new bytes against the base version's bytes at the same place) and keeps the sorted positions
of the bytes that differ and the base's bytes there (`Changes`). `encode` turns the changes
inside one span into a frame: the positions as byte-sized gaps (a 0 byte means "255 further,
no change yet", so a gap costs one byte unless it is over 255), then the new bytes. A span
whose frame would not be smaller than the span goes whole instead (`WHOLE`), so a dense update
never costs more than today plus a 48-byte header per bucket. `apply` checks a frame against
the receiver's copy of the base and writes the new bytes in place.

Every function takes and returns torch tensors. `compare` runs where the staged bytes are:
torch ops on a device (a GPU staging buffer, before its device-to-host copy: only the frames
built from its `Changes`, a few percent of the bytes, then cross to the host), numpy kernels
over the same memory on the host, where it compares 8-byte words first and bytes only inside the words that changed, a
cache-sized chunk at a time. `encode` builds a frame where the changes are: numpy on the host
(a few passes per changed byte, the gaps over 255, a few percent, fixed up apart), torch ops
on a GPU, from which only the frame crosses to the host. `apply` runs where the receiver's
copy of the base is: numpy on the host, torch ops on a GPU receive buffer.

Frame layout (`HEADER`, then the payload):

    kind (WHOLE or GAPS), span (bytes the frame covers), gaps (bytes of gap stream),
    count (changed bytes), base (the version the frame applies to),
    base_sum (xxh3-64 of the base's bytes at the changed positions),
    payload_sum (xxh3-64 of the payload; 0 for WHOLE frames)
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from transfer_queue import SchemaError, WeightSyncError
from transfer_queue.cuda import side_stream

__all__ = [
    "WHOLE",
    "GAPS",
    "HEADER",
    "DENSE",
    "Changes",
    "CompareScratch",
    "Frame",
    "compare",
    "encode",
    "encode_span",
    "apply",
    "positions_of",
    "threads",
]

WHOLE, GAPS = 0, 1
HEADER = struct.Struct("<BxxxxxxxQQQqQQ")
DENSE = 0.05
"""Fraction of bytes changed above which `compare` gives up and the range goes whole (about
a tenth of bf16 values moved by one unit in the last place). Byte-wise a frame breaks even
only at half the bytes changed (a gap byte and a value byte per change), but each change
also costs the publisher and the subscriber index work that a whole copy does not: past a
twentieth that work takes longer than sending the bytes whole at memory or fast-link speed
(`benchmarks/weight_sync_delta.py --micro`)."""

_MAX_GAP = 255

_MAX_THREADS = 8
"""Most threads `threads` gives by default: past it the passes are bound by memory bandwidth,
not cores."""
_MAX_OVERRIDE = 64
"""Most threads `SLUICE_DELTA_THREADS` may ask for."""


def threads() -> int:
    """Threads a process spreads its compares, frame encodes or frame applies over: the cores
    it may run on (its CPU affinity and its cgroup's CPU quota) but one, which the stream's own
    thread (sending or receiving) or the trainer's staging keeps busy, and at most
    `_MAX_THREADS`; `SLUICE_DELTA_THREADS` sets it (1: no pool, each pass on the thread that
    needs it). The passes' numpy and xxh3 calls release the GIL, so these threads run in
    parallel. Publishers and subscribers read it once, when they are built, and only with
    deltas on or able to turn on (a publisher's "auto").

    Raises:
        SchemaError: `SLUICE_DELTA_THREADS` is not a whole number from 1 to `_MAX_OVERRIDE`.
    """
    override = os.environ.get("SLUICE_DELTA_THREADS")
    if override is not None:
        if not (override.isascii() and override.isdigit() and 1 <= int(override) <= _MAX_OVERRIDE):
            raise SchemaError(f"SLUICE_DELTA_THREADS={override!r}: a whole number from 1 to {_MAX_OVERRIDE} is needed")
        return int(override)
    return max(1, min(_MAX_THREADS, _cores() - 1))


def _cores() -> int:
    """Cores this process may run on: its CPU affinity (where the OS has one), capped by its
    cgroup's CPU quota (a container given 4 CPUs of a 64-core host gets 4)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return cores if quota is None else max(1, min(cores, quota))


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPUs this process's cgroup may use, rounded up (cgroup v2 `cpu.max`, else v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`); None: no quota, or none readable."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        except OSError:
            return None
    try:
        q, p = int(quota), int(period)
    except ValueError:  # "max": no quota
        return None
    if q <= 0 or p <= 0:  # v1's -1: no quota
        return None
    return -(-q // p)


@dataclass(frozen=True)
class Changes:
    """The bytes of one staged range that differ from the base version at the same place."""

    positions: torch.Tensor
    """Sorted byte positions from the start of the range (int64, where the range was compared:
    the host, or the GPU that holds a packed version)."""
    old: torch.Tensor
    """The base's bytes at `positions` (uint8, beside them): what a delta assumes the receiver holds."""
    new: torch.Tensor
    """The new version's bytes at `positions` (uint8, beside them): what a delta carries."""
    size: int
    """Bytes in the range."""

    @property
    def count(self) -> int:
        return self.positions.numel()


_CHUNK_WORDS = 1 << 16
"""Words `compare` handles per step on the host (512 KiB of each version): small enough that
the changed words it gathers are still in cache, large enough that numpy's per-call cost (and
the GIL, held between the calls, which several compare threads share) is a few percent of the
pass."""


class CompareScratch:
    """The word mask `compare` reuses from one chunk and one bucket to the next on the host
    (one per thread that compares)."""

    def __init__(self) -> None:
        self.mask = np.empty(_CHUNK_WORDS, dtype=bool)


def compare(
    new: torch.Tensor, old: torch.Tensor, dense: float = DENSE, scratch: CompareScratch | None = None
) -> Changes | None:
    """The changes from `old` to `new` (flat uint8 tensors of one size, on any device), or
    None when more than `dense` of the bytes changed (the range then goes whole).

    On the host: one pass over 8-byte words (`_compare_host`), bytes looked at only inside
    the words that changed; `scratch` (one per compare thread) keeps the word mask between
    calls. Device tensors stay in torch, where they are (`_compare_device`), and so do their
    changes: frames are then built there too (`encode`), and only they cross to the host.

    Raises:
        ValueError: the tensors are not flat uint8 of one size.
    """
    if new.shape != old.shape or new.dtype != torch.uint8 or old.dtype != torch.uint8 or new.dim() != 1:
        raise ValueError("compare needs two flat uint8 tensors of the same size")
    if new.device.type == "cpu":
        host = _compare_host(new.numpy(), old.numpy(), dense, scratch or CompareScratch())
        if host is None:
            return None
        positions, before, after = (torch.from_numpy(found) for found in host)
    else:
        device = _compare_device(new, old, dense)
        if device is None:
            return None
        positions, before, after = device
        if new.is_cuda:  # done before other threads' encodes read them, on a stream of their own
            torch.cuda.current_stream(new.device).synchronize()
    return Changes(positions, before, after, new.numel())


def _compare_host(
    new: np.ndarray, old: np.ndarray, dense: float, scratch: CompareScratch
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`compare` on the host: (positions, old bytes there, new bytes there) or None.

    Changed bf16 values are a few percent and mostly one byte each, so most 8-byte words are
    equal: the pass compares words (one bool per word, not per byte) and looks at bytes only
    inside the words that changed, chunk by chunk so that those words are gathered from cache
    rather than from memory a second time. A changed word holds at least one changed byte, so
    the range goes whole as soon as the changed words pass `dense` of its bytes; and after a
    quarter of the range, once they pass `dense` of the bytes seen so far (updates spread
    over a whole tensor, so a dense prefix means a dense range; whole is never wrong)."""
    size = len(new)
    aligned = size - size % 8
    new_words, old_words = new[:aligned].view(np.uint64), old[:aligned].view(np.uint64)
    limit, probe = dense * size, aligned // 32  # words in a quarter of the range
    changed, positions, olds, news = 0, [], [], []
    for first in range(0, len(new_words), _CHUNK_WORDS):
        new_chunk, old_chunk = new_words[first : first + _CHUNK_WORDS], old_words[first : first + _CHUNK_WORDS]
        mask = scratch.mask[: len(new_chunk)]
        np.not_equal(new_chunk, old_chunk, out=mask)
        words = np.flatnonzero(mask)
        changed += len(words)
        if changed > limit or (first >= probe and changed > dense * 8 * (first + len(new_chunk))):
            return None
        if len(words):
            was, now = np.take(old_chunk, words), np.take(new_chunk, words)
            inside = np.flatnonzero(now.view(np.uint8) != was.view(np.uint8))
            words += first
            words *= 8
            at = np.take(words, inside >> 3)
            at += inside & 7
            positions.append(at)
            olds.append(np.take(was.view(np.uint8), inside))
            news.append(np.take(now.view(np.uint8), inside))
    tail = np.flatnonzero(new[aligned:] != old[aligned:]) + aligned
    positions.append(tail)
    olds.append(old[tail])
    news.append(new[tail])
    if sum(map(len, positions)) > limit:
        return None
    return np.concatenate(positions), np.concatenate(olds), np.concatenate(news)


def _compare_device(
    new: torch.Tensor, old: torch.Tensor, dense: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`compare` as torch ops on the tensors' device: (positions, old bytes there, new bytes
    there) or None."""
    differ = new != old
    if int(torch.count_nonzero(differ)) > dense * len(new):
        return None
    positions = differ.nonzero().view(-1)
    return positions, old[positions], new[positions]


@dataclass(frozen=True)
class Frame:
    """One span on the wire: the header's fields and the payload."""

    kind: int
    span: int
    gaps: int
    count: int
    base: int
    base_sum: int
    payload_sum: int

    def pack(self) -> bytes:
        return HEADER.pack(self.kind, self.span, self.gaps, self.count, self.base, self.base_sum, self.payload_sum)

    @classmethod
    def unpack(cls, raw: bytes | bytearray) -> Frame:
        frame = cls(*HEADER.unpack(raw))
        if frame.kind not in (WHOLE, GAPS) or frame.gaps + frame.count > max(frame.span, 0) * 2 + 1:
            raise WeightSyncError(f"malformed delta frame header {frame}")
        return frame

    @property
    def payload(self) -> int:
        """Bytes of payload after the header."""
        return self.span if self.kind == WHOLE else self.gaps + self.count


def _sum(array: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(array).data)


def encode(
    span: int, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, base: int
) -> tuple[Frame, torch.Tensor | None]:
    """The frame for a span of `span` bytes whose bytes at `positions` (sorted, from the
    span's start) changed from `old` to `new` (uint8): (frame, payload), the payload None for
    a WHOLE frame (send the span itself). The payload is on the host, where it is sent: built
    with numpy from host changes, or with torch ops on the device that holds the changes
    (`_encode_torch`), so that only the frame crosses to the host."""
    count = positions.numel()
    if 2 * count >= span:
        return Frame(WHOLE, span, 0, 0, base, 0, 0), None
    if positions.device.type != "cpu":
        try:
            with _on_its_stream(positions.device, "delta-encode"):
                return _encode_torch(span, positions, old, new, base)
        except torch.cuda.OutOfMemoryError:  # no GPU memory for the frame: build it on the host
            positions, old, new = positions.cpu(), old.cpu(), new.cpu()
    stream = _gap_stream(positions.numpy())
    if len(stream) + count >= span:
        return Frame(WHOLE, span, 0, 0, base, 0, 0), None
    payload = np.empty(len(stream) + count, dtype=np.uint8)
    payload[: len(stream)] = stream
    payload[len(stream) :] = new.numpy()
    frame = Frame(GAPS, span, len(stream), count, base, _sum(old.numpy()), _sum(payload))
    return frame, torch.from_numpy(payload)


def _on_its_stream(device: torch.device, purpose: str) -> contextlib.AbstractContextManager:
    """A GPU's encodes and applies run on side streams of their own (one per purpose), not on
    the default stream that the trainer's or the engine's work is queued on: each waits for its
    own work only. Nothing to do for the host."""
    return side_stream(device, purpose) if device.type == "cuda" else contextlib.nullcontext()


def _encode_torch(
    span: int, positions: torch.Tensor, old: torch.Tensor, new: torch.Tensor, base: int
) -> tuple[Frame, torch.Tensor | None]:
    """`encode` as torch ops where the changes are: the gaps written straight to their places
    in the payload (a gap over 255 preceded by its 0 bytes, left as allocated), then the
    payload and the base's bytes (for their checksums) copied to the host."""
    count = positions.numel()
    steps = torch.diff(positions, prepend=positions.new_full((1,), -1))  # the first gap from -1
    escapes = torch.div(steps - 1, _MAX_GAP, rounding_mode="floor")  # 0 bytes before each gap
    at = torch.cumsum(escapes, 0)
    gaps = count + (int(at[-1]) if count else 0)
    if gaps + count >= span:
        return Frame(WHOLE, span, 0, 0, base, 0, 0), None
    at += torch.arange(count, device=positions.device)  # where each gap's last byte goes
    body = torch.zeros(gaps + count, dtype=torch.uint8, device=positions.device)
    body[at] = (steps - escapes * _MAX_GAP).to(torch.uint8)
    body[gaps:] = new
    payload, before = body.cpu(), old.cpu()
    return Frame(GAPS, span, gaps, count, base, _sum(before.numpy()), _sum(payload.numpy())), payload


def _gap_stream(at: np.ndarray) -> np.ndarray:
    """The gaps between sorted positions `at` (the first from -1) as bytes, a gap over 255
    preceded by a 0 byte per 255 of it: the differences written straight into one array, the
    long gaps (a few percent) fixed up after."""
    steps = np.empty(len(at), dtype=np.int64)
    steps[:1] = at[:1] + 1
    np.subtract(at[1:], at[:-1], out=steps[1:])
    long = np.flatnonzero(steps > _MAX_GAP)
    if not len(long):
        return steps.astype(np.uint8)
    extra = (steps[long] - 1) // _MAX_GAP
    steps[long] -= extra * _MAX_GAP
    return np.insert(steps.astype(np.uint8), np.repeat(long, extra), 0)


def encode_span(changes: Changes | None, lo: int, hi: int, base: int) -> tuple[Frame, torch.Tensor | None]:
    """The frame for bytes [lo, hi) of a staging bucket whose changes against version `base`
    are `changes` (positions from the bucket's start; None: the bucket is dense and goes whole):
    (frame, payload), the payload None for a WHOLE frame (send the span's bytes themselves)."""
    if changes is None:
        return Frame(WHOLE, hi - lo, 0, 0, base, 0, 0), None
    bounds = torch.tensor([lo, hi], device=changes.positions.device)
    with _on_its_stream(changes.positions.device, "delta-encode"):  # the cut too, not only `encode`
        first, last = torch.searchsorted(changes.positions, bounds).tolist()
        positions = changes.positions[first:last]
        old, new = changes.old[first:last], changes.new[first:last]
        return encode(hi - lo, positions - lo if lo else positions, old, new, base)


def positions_of(gaps: torch.Tensor) -> torch.Tensor:
    """Decode a gap stream (host uint8) back to sorted positions (int64).

    Raises:
        WeightSyncError: the stream ends in a 0 byte (a gap with no change after it).
    """
    stream = gaps.numpy()
    if not len(stream):
        return torch.empty(0, dtype=torch.int64)
    zeros = np.flatnonzero(stream == 0)  # few: one per 255 bytes of a gap over 255
    if len(zeros) and zeros[-1] == len(stream) - 1:
        raise WeightSyncError("a delta frame's gap stream ends without a change")
    at = stream.astype(np.int64)  # then summed in place: numpy's cumsum from uint8 is slower
    at[zeros] = _MAX_GAP  # a 0 adds 255 and is no change itself
    at[0] -= 1  # positions count from 0, gaps from -1
    np.cumsum(at, out=at)
    return torch.from_numpy(np.delete(at, zeros) if len(zeros) else at)


def apply(frame: Frame, payload: torch.Tensor, target: torch.Tensor) -> None:
    """Write GAPS `frame` (its `payload`, host uint8) into `target` (uint8, `frame.span`
    bytes, the receiver's copy of the base), checking first that the payload arrived intact
    and that `target` holds what the frame assumes. A host `target` is written with numpy;
    one on a GPU (a receive buffer in GPU memory) with torch ops there (`_apply_torch`), so
    that only the payload crosses to the device and the scattered writes run at device
    memory speed.

    Raises:
        WeightSyncError: the payload is corrupt, or `target` is not the frame's base; nothing
            was written then.
    """
    if target.numel() != frame.span or payload.numel() != frame.payload:
        raise WeightSyncError(f"delta frame of {frame.span} bytes does not fit a span of {target.numel()}")
    body = payload.numpy()
    if _sum(body) != frame.payload_sum:
        raise WeightSyncError("a delta frame arrived corrupt (payload checksum mismatch)")
    if target.device.type != "cpu":
        with _on_its_stream(target.device, "delta-apply"):
            _apply_torch(frame, payload, target)
        return
    at = positions_of(payload[: frame.gaps]).numpy()
    if len(at) != frame.count or (frame.count and int(at[-1]) >= frame.span):
        raise WeightSyncError("a delta frame's positions do not match its header")
    into = target.numpy()
    if _sum(np.take(into, at)) != frame.base_sum:
        raise _wrong_base(frame)
    np.put(into, at, body[frame.gaps :])


def _apply_torch(frame: Frame, payload: torch.Tensor, target: torch.Tensor) -> None:
    """`apply`'s checks and writes as torch ops on `target`'s device, the payload's checksum
    already checked: the payload is copied there, the gaps decoded there, and only the base's
    bytes at the changed positions come back to the host, for their checksum. Returns once
    the writes are done (the caller reports the span as new)."""
    if frame.gaps and int(payload[frame.gaps - 1]) == 0:
        raise WeightSyncError("a delta frame's gap stream ends without a change")
    body = payload.to(target.device)
    steps = body[: frame.gaps].to(torch.int64)
    marks = steps == 0  # a 0 adds 255 and is no change itself
    steps[marks] = _MAX_GAP
    if frame.gaps:
        steps[0] -= 1  # positions count from 0, gaps from -1
    at = torch.cumsum(steps, 0)[~marks]
    if at.numel() != frame.count or (frame.count and int(at[-1]) >= frame.span):
        raise WeightSyncError("a delta frame's positions do not match its header")
    if _sum(target[at].cpu().numpy()) != frame.base_sum:
        raise _wrong_base(frame)
    target[at] = body[frame.gaps :]
    if target.is_cuda:  # the apply stream: done before the span is reported new
        torch.cuda.current_stream(target.device).synchronize()


def _wrong_base(frame: Frame) -> WeightSyncError:
    return WeightSyncError(
        f"this subscriber's copy of version {frame.base} differs from the publisher's: delta refused"
    )
