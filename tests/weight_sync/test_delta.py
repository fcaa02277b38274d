"""The delta encoder and its stream frames: bit-exact round trips for every dtype, the switch to
whole spans when changes are dense, empty and full changes, long gaps, and refusals of a
corrupt frame or a wrong base that leave the target untouched."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from transfer_queue import SchemaError, WeightSyncError
from weight_sync import delta
from weight_sync.delta import (
    _CHUNK_WORDS,
    GAPS,
    HEADER,
    WHOLE,
    Changes,
    Frame,
    _apply_torch,
    _compare_device,
    _encode_torch,
    apply,
    compare,
    encode,
    encode_span,
    threads,
)
from weight_sync.plan import Read
from weight_sync.transports import stream
from weight_sync.transports.stream import FrameLog, delta_frames, receive_frames


def _versions(dtype: torch.dtype, n: int, fraction: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new) of `n` elements, `fraction` of them changed, as flat uint8 views."""
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        base = torch.randn(n, generator=gen).to(dtype)
        new = base.clone()
        mask = torch.rand(n, generator=gen) < fraction
        new[mask] = (base[mask].float() * (1 + 2.0**-6)).to(dtype)
    else:
        base = torch.randint(-100, 100, (n,), generator=gen).to(dtype)
        new = base.clone()
        mask = torch.rand(n, generator=gen) < fraction
        new[mask] += 1
    return base.view(torch.uint8), new.view(torch.uint8)


def _round_trip(base: torch.Tensor, new: torch.Tensor) -> tuple[int, int]:
    """Encode base -> new and apply it to a copy of base; returns (frame kind, payload bytes)."""
    changes = compare(new, base)
    assert changes is not None
    frame, payload = encode(new.numel(), changes.positions, changes.old, changes.new, base=7)
    target = base.clone()
    if payload is None:
        target.copy_(new)
    else:
        apply(frame, payload, target)
    assert torch.equal(target, new)
    return frame.kind, 0 if payload is None else payload.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.int32, torch.int8])
def test_round_trip_is_bit_exact_for_every_dtype(dtype):
    base, new = _versions(dtype, 10_000, 0.03)
    kind, size = _round_trip(base, new)
    changed = int((new != base).sum())
    assert kind == GAPS
    # a gap byte and a value byte per change, and an escape byte per 255 bytes without one
    assert changed <= size <= 2 * changed + base.numel() // 255 + 1


def test_small_updates_cost_little_more_than_the_changed_values():
    """bf16 weights moved by one unit in the last place: mostly the low byte changes, so the
    frame is close to the changed values' bytes and far below the whole."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(1 << 16, generator=gen).to(torch.bfloat16)
    new = base.clone()
    mask = torch.rand(base.numel(), generator=gen) < 0.03
    new.view(torch.int16)[mask] += 1
    floor = int(mask.sum()) * 2
    _, size = _round_trip(base.view(torch.uint8), new.view(torch.uint8))
    assert size <= 1.5 * floor
    assert size * 10 <= base.numel() * 2


def test_dense_changes_go_whole():
    base, new = _versions(torch.bfloat16, 4096, 1.0)
    assert compare(new, base) is None
    base = torch.zeros(40960, dtype=torch.uint8)
    new = base.clone()
    new[:1024] = 1  # 2.5% of the bytes changed: sparse enough to compare...
    changes = compare(new, base)
    assert changes is not None and changes.count == 1024
    frame, payload = encode(
        1000, changes.positions[:1000], changes.old[:1000], changes.new[:1000], base=1
    )  # ...not its start
    assert frame.kind == WHOLE and payload is None and frame.span == 1000


def test_empty_and_full_change():
    base = torch.arange(512, dtype=torch.int32).view(torch.uint8)
    changes = compare(base.clone(), base)
    assert changes is not None and changes.count == 0
    frame, payload = encode(base.numel(), changes.positions, changes.old, changes.new, base=1)
    assert frame.kind == GAPS and payload.numel() == 0
    target = base.clone()
    apply(frame, payload, target)
    assert torch.equal(target, base)
    assert compare(base ^ 0xFF, base) is None  # every byte changed


@pytest.mark.parametrize(
    "positions",
    [
        [0, 1, 255, 256, 511, 70_000, 100_002],
        [254, 509, 764],  # gaps of exactly 255: one byte each
        [255, 256],  # a first gap of 256, whose low byte is 0
        [3, 260, 773, 1030],  # gaps of 257, 513 and 257: low bytes 1, 1, 1
    ],
)
def test_gaps_longer_than_a_byte_and_unaligned_spans(positions):
    base = torch.zeros(100_003, dtype=torch.uint8)
    new = base.clone()
    new[positions] = torch.arange(1, len(positions) + 1, dtype=torch.uint8)
    kind, size = _round_trip(base, new)
    assert kind == GAPS and size < len(positions) * 2 + 100_003 // 255 + 2


def test_a_corrupt_payload_or_a_wrong_base_is_refused_untouched():
    base, new = _versions(torch.bfloat16, 4096, 0.02)
    changes = compare(new, base)
    frame, payload = encode(new.numel(), changes.positions, changes.old, changes.new, base=3)
    corrupt = payload.clone()
    corrupt[-1] ^= 0x10
    target = base.clone()
    with pytest.raises(WeightSyncError, match="corrupt"):
        apply(frame, corrupt, target)
    assert torch.equal(target, base)
    wrong = base.clone()
    wrong[changes.positions[0]] ^= 0x01  # not the base the delta assumes
    before = wrong.clone()
    with pytest.raises(WeightSyncError, match="differs"):
        apply(frame, payload, wrong)
    assert torch.equal(wrong, before)


def _stream(slot: torch.Tensor, base_slot: torch.Tensor, bucket: int, span: tuple[int, int]) -> bytearray:
    buckets = [compare(slot[k : k + bucket], base_slot[k : k + bucket]) for k in range(0, slot.numel(), bucket)]
    return bytearray(b"".join(bytes(v) for v in delta_frames(slot, span, buckets.__getitem__, bucket, base=5)))


def test_stream_frames_cross_buckets_and_apply_to_the_base():
    """A read spanning three buckets, one of them dense (sent whole), lands exactly."""
    bucket = 4096
    base_slot, slot = _versions(torch.bfloat16, 3 * bucket // 2 * 2, 0.02)
    slot[bucket : 2 * bucket] = torch.randint(0, 256, (bucket,), dtype=torch.uint8)  # dense bucket
    span = (100, 3 * bucket * 2 - 64)
    wire = _stream(slot, base_slot, bucket, span)
    read = Read(span[0], (span[1] - span[0],), (0,), (span[1] - span[0],), 1)
    buffer = torch.zeros(span[1] - span[0] + 64, dtype=torch.uint8)
    buffer[32 : 32 + read.nbytes] = base_slot[span[0] : span[1]]
    position = 0

    def recv(view: memoryview) -> None:
        nonlocal position
        view[:] = wire[position : position + len(view)]
        position += len(view)

    done = []
    receive_frames(recv, buffer, [read], [32], 5, done.append)
    assert torch.equal(buffer[32 : 32 + read.nbytes], slot[span[0] : span[1]])
    assert position == len(wire) < read.nbytes and done[-1] == 32 + read.nbytes
    position = 0
    with pytest.raises(WeightSyncError, match="base"):
        receive_frames(recv, buffer, [read], [32], 4, done.append)  # frames for base 5, not 4


@pytest.mark.parametrize(
    "positions",
    [
        [0, 1, 255, 256, 511, 70_000, 100_002],
        [255, 256],  # a first gap of 256, whose low byte is 0
        [3, 260, 773, 1030],
        [],
    ],
)
def test_the_device_apply_writes_what_the_host_apply_writes(positions):
    """`apply` on a GPU receive buffer runs as torch ops there (`_apply_torch`): run here on
    CPU tensors, it writes exactly what the numpy path writes, and refuses what it refuses,
    untouched."""
    base = torch.arange(100_003, dtype=torch.int64).to(torch.uint8)
    new = base.clone()
    new[positions] += torch.arange(1, len(positions) + 1, dtype=torch.uint8)
    changes = compare(new, base)
    frame, payload = encode(new.numel(), changes.positions, changes.old, changes.new, base=5)
    on_host, on_device = base.clone(), base.clone()
    apply(frame, payload, on_host)
    _apply_torch(frame, payload, on_device)
    assert torch.equal(on_device, new) and torch.equal(on_host, new)
    if not positions:
        return
    wrong = base.clone()
    wrong[positions[0]] ^= 0x01  # not the base the delta assumes
    before = wrong.clone()
    with pytest.raises(WeightSyncError, match="differs"):
        _apply_torch(frame, payload, wrong)
    one_more = Frame(frame.kind, frame.span, frame.gaps, frame.count + 1, frame.base, frame.base_sum, 0)
    with pytest.raises(WeightSyncError, match="do not match"):
        _apply_torch(one_more, payload, wrong)
    ends_open = payload.clone()
    ends_open[frame.gaps - 1] = 0
    with pytest.raises(WeightSyncError, match="ends without a change"):
        _apply_torch(frame, ends_open, wrong)
    assert torch.equal(wrong, before)


@pytest.mark.parametrize(
    "positions",
    [
        [0, 1, 255, 256, 511, 70_000, 100_002],
        [254, 509, 764],  # gaps of exactly 255: one byte each
        [255, 256],  # a first gap of 256, whose low byte is 0
        [3, 260, 773, 1030],  # gaps of 257, 513 and 257
        [0, 65_535, 65_536 + 510],  # gaps of 255 x 257 and of 511
        [],
    ],
)
def test_the_device_encoder_builds_the_host_encoders_frame(positions):
    """`encode` of changes found on a GPU runs as torch ops there (`_encode_torch`): run here
    on CPU tensors, it gives the numpy encoder's frame and payload byte for byte, and goes
    whole where that one does."""
    base = torch.arange(100_003, dtype=torch.int64).to(torch.uint8)
    new = base.clone()
    new[positions] += torch.arange(1, len(positions) + 1, dtype=torch.uint8)
    changes = compare(new, base)
    on_host = encode(new.numel(), changes.positions, changes.old, changes.new, base=9)
    on_device = _encode_torch(new.numel(), changes.positions, changes.old, changes.new, base=9)
    assert on_device[0] == on_host[0] and on_host[0].kind == GAPS
    assert torch.equal(on_device[1], on_host[1])
    for lo, hi in [(0, 300), (200, 70_001), (100, 100_003)]:  # spans of the range, as frames cut them
        first, last = torch.searchsorted(changes.positions, torch.tensor([lo, hi])).tolist()
        cut = (hi - lo, changes.positions[first:last] - lo, changes.old[first:last], changes.new[first:last], 9)
        host, device = encode(*cut), _encode_torch(*cut)
        assert device[0] == host[0] == encode_span(changes, lo, hi, 9)[0]
        assert (device[1] is None and host[1] is None) or torch.equal(device[1], host[1])
    dense = torch.arange(0, 600, 2)  # 300 changes in a span of 600: as many gap bytes as values
    assert _encode_torch(600, dense, dense.to(torch.uint8), dense.to(torch.uint8), 9) == (
        Frame(WHOLE, 600, 0, 0, 9, 0, 0),
        None,
    )


def test_the_device_apply_refuses_positions_past_the_span():
    """A frame whose gaps lead past its span is refused before anything is written (on a GPU an
    index past the buffer would be a device-side assert that poisons the process's CUDA)."""
    frame, payload = encode(
        1000, torch.tensor([0, 500]), torch.zeros(2, dtype=torch.uint8), torch.ones(2, dtype=torch.uint8), 3
    )
    short = Frame(frame.kind, 500, frame.gaps, frame.count, frame.base, frame.base_sum, frame.payload_sum)
    target = torch.zeros(500, dtype=torch.uint8)
    with pytest.raises(WeightSyncError, match="do not match"):
        _apply_torch(short, payload, target)
    assert not target.any()


def test_only_whole_frames_wait_for_staging():
    """`delta_frames` sends a GAPS frame without waiting for the slot (its bytes are its
    changes'); a WHOLE frame's bytes go only once `filled` said they are staged."""
    bucket = 4096
    base = torch.zeros(3 * bucket, dtype=torch.uint8)
    new = base.clone()
    new[[5, 900, 2 * bucket + 7]] = 1
    changes = {0: compare(new[:bucket], base[:bucket]), 1: None, 2: compare(new[2 * bucket :], base[2 * bucket :])}
    slot = torch.zeros_like(new)  # nothing staged yet
    events: list = []

    def filled(end: int) -> None:
        events.append(("filled", end))
        slot[:end] = new[:end]  # staging catches up to `end`

    out = delta_frames(slot, (0, 3 * bucket), changes.__getitem__, bucket, 5, filled=filled)
    for header in out:
        frame = Frame.unpack(bytes(header))
        body = bytes(next(out))
        events.append(("frame", frame.kind))
        if frame.kind == WHOLE:
            assert body == bytes(new[bucket : 2 * bucket].numpy())  # the staged bytes, not zeros
    assert events == [("frame", GAPS), ("filled", 2 * bucket), ("frame", WHOLE), ("frame", GAPS)]


def test_the_device_path_finds_the_same_changes():
    """`compare` keeps device tensors in torch: its torch path gives the host path's answer
    (run here on CPU tensors, of a size that leaves a tail after the last 8-byte word)."""
    base, new = _versions(torch.bfloat16, 3 * _CHUNK_WORDS * 4 + 3, 0.03)  # three chunks and a tail
    new[-1] ^= 0x10  # a change in the tail
    changes = compare(new, base)
    positions, old, now = _compare_device(new, base, 0.05)
    assert torch.equal(positions, changes.positions) and torch.equal(old, changes.old)
    assert torch.equal(now, changes.new) and torch.equal(now, new[positions])


def test_a_dense_stretch_past_a_quarter_sends_the_range_whole():
    """The host compare gives up once the changed words pass `dense` of the bytes seen after a
    quarter of the range, though the range as a whole would be under it (whole is never wrong);
    the same changes later in a larger range stay a delta."""
    size = 8 * 8 * _CHUNK_WORDS
    base = torch.zeros(size, dtype=torch.uint8)
    new = base.clone()
    new[: size // 4 : 8] = 1  # every word of the first quarter: 1/32 of the bytes, 1/4 of the words
    assert compare(new, base, dense=0.05) is None
    assert compare(new.roll(size // 2), base, dense=0.05).count == size // 32


def _sparse_slot(buckets: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, new) slots of `buckets` buckets, each changed at its own density (0.2% of the
    bytes: gaps over 255; 2%; 20%; none; 60%: whole), so frames of every size and kind."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (buckets * bucket,), dtype=torch.uint8, generator=gen)
    new = base.clone()
    for k in range(buckets):
        part = new[k * bucket : (k + 1) * bucket]
        part[torch.rand(bucket, generator=gen) < (0.002, 0.02, 0.2, 0.0, 0.6)[k % 5]] += 1
    return base, new


def _wire(new: torch.Tensor, base: torch.Tensor, bucket: int, span: tuple[int, int], **pool) -> bytearray:
    """The delta stream of `span` (bucket by bucket, dense up to half the bytes)."""
    changes = [compare(new[k : k + bucket], base[k : k + bucket], dense=0.5) for k in range(0, new.numel(), bucket)]
    return bytearray(b"".join(bytes(v) for v in delta_frames(new, span, changes.__getitem__, bucket, 5, **pool)))


def _frames_of(wire: bytearray) -> list[tuple[int, Frame]]:
    """(where its payload starts in `wire`, frame) of every frame of a delta stream."""
    out, at = [], 0
    while at < len(wire):
        frame = Frame.unpack(wire[at : at + HEADER.size])
        out.append((at + HEADER.size, frame))
        at += HEADER.size + frame.payload
    return out


class _Progress:
    """A `receive_frames` progress callback that checks, at every call, that the buffer's
    bytes up to the reported end are the new version's, and notes which threads reported."""

    def __init__(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        self.buffer, self.new = buffer, new
        self.ends: list[int] = []
        self.threads: set[str] = set()
        self.reported = threading.Event()

    def __call__(self, end: int) -> None:
        assert torch.equal(self.buffer[:end], self.new[:end]), f"bytes before {end} reported but not yet new"
        self.ends.append(end)  # calls are serialised by `receive_frames`
        self.threads.add(threading.current_thread().name)
        self.reported.set()


def _receive(
    wire: bytearray,
    buffer: torch.Tensor,
    span: int,
    progress: Callable[[int], None],
    log: FrameLog | None = None,
    workers: int = 1,
    arrives: Callable[[int], None] = lambda position: None,
) -> None:
    """`receive_frames` of `wire` into `buffer` (one read of `span` bytes at 0) on `workers`
    threads, `arrives(position)` called before each `recv`; afterwards, no apply thread is
    left, whatever happened."""
    position = 0

    def recv(view: memoryview) -> None:
        nonlocal position
        arrives(position)
        view[:] = wire[position : position + len(view)]
        position += len(view)

    try:
        receive_frames(recv, buffer, [Read(0, (span,), (0,), (span,), 1)], [0], 5, progress, log, workers)
    finally:
        assert not [t for t in threading.enumerate() if t.name.startswith("sluice-ws-apply")], "apply threads left"


@pytest.fixture
def pooled(monkeypatch):
    """Every GAPS frame goes through the encode and apply pools."""
    monkeypatch.setattr(stream, "_INLINE", 0)


def test_frames_encoded_and_applied_on_pools_match_the_serial_ones(pooled):
    """Twelve buckets at densities from 0.2% (gaps over 255) to 60% (whole), encoded four at a time
    ahead of the stream and applied on four threads while the next frames arrive: the same
    bytes on the wire as one thread encoding in turn, the same result, bit-exact, and the same
    progress, frame by frame in order, each frame logged before it is reported and every
    report true of the buffer when it is made; reports came from the apply threads. One
    thread: the same reports, all from the receiving thread."""
    bucket = 256 << 10
    base, new = _sparse_slot(12, bucket)
    span = (1000, new.numel() - 1000)
    serial = _wire(new, base, bucket, span)
    with ThreadPoolExecutor(4) as encoder:
        assert _wire(new, base, bucket, span, encoder=encoder, ahead=8) == serial
    frames = _frames_of(serial)
    assert [f.kind for _, f in frames] == [GAPS] * 4 + [WHOLE] + [GAPS] * 4 + [WHOLE] + [GAPS] * 2
    size = span[1] - span[0]
    buffer, log = base[span[0] : span[1]].clone(), FrameLog(5)
    progress = _Progress(buffer, new[span[0] : span[1]])
    _receive(serial, buffer, size, progress, log, workers=4)
    assert torch.equal(buffer, new[span[0] : span[1]])
    assert progress.ends == list(itertools.accumulate(f.span for _, f in frames))
    assert [f for f, _ in log.frames] == [f for _, f in frames]
    assert any(name.startswith("sluice-ws-apply") for name in progress.threads), progress.threads
    buffer = base[span[0] : span[1]].clone()
    again = _Progress(buffer, new[span[0] : span[1]])
    _receive(serial, buffer, size, again)
    assert again.ends == progress.ends and torch.equal(buffer, new[span[0] : span[1]])
    assert again.threads == {threading.current_thread().name}


@pytest.mark.parametrize("fault", ["payload", "base"])
def test_a_bad_frame_in_the_middle_stops_the_pooled_apply_there(pooled, fault):
    """A corrupt payload (or a receiver whose base differs there) in the seventh of twelve
    frames: `WeightSyncError`; progress and the log stop before that frame, whatever became of
    the frames after it; the bad frame's span is untouched; no apply thread is left."""
    bucket = 256 << 10
    base, new = _sparse_slot(12, bucket)
    wire = _wire(new, base, bucket, (0, new.numel()))
    bad = 6
    at, frame = _frames_of(wire)[bad]
    assert frame.kind == GAPS
    buffer, start = base.clone(), bad * bucket
    if fault == "payload":
        wire[at + frame.payload - 1] ^= 0x01
    else:
        changed = torch.nonzero(new[start : start + bucket] != base[start : start + bucket])
        buffer[start + int(changed[0])] ^= 0x01
    before = buffer[start : start + bucket].clone()
    log, progress = FrameLog(5), _Progress(buffer, new)
    with pytest.raises(WeightSyncError, match="corrupt" if fault == "payload" else "differs"):
        _receive(wire, buffer, new.numel(), progress, log, workers=4)
    assert torch.equal(buffer[start : start + bucket], before), "the bad frame wrote nothing"
    assert all(end <= start for end in progress.ends) and len(log.frames) == len(progress.ends)


def test_a_pooled_apply_is_reported_before_the_next_frame_arrives(pooled):
    """The next frame is late (its bucket still being compared upstream): the frame before it,
    applied on the pool, is reported (so a relay forwards it) without waiting for it."""
    bucket = 256 << 10
    base, new = _sparse_slot(4, bucket)
    wire = _wire(new, base, bucket, (0, new.numel()))
    second = _frames_of(wire)[1][0] - HEADER.size  # where frame 1 starts on the wire
    buffer = base.clone()
    progress = _Progress(buffer, new)

    def arrives(position: int) -> None:
        if position == second:
            assert progress.reported.wait(30), "frame 0 was not reported while frame 1 was late"

    _receive(wire, buffer, new.numel(), progress, workers=4, arrives=arrives)
    assert progress.ends[0] == bucket and torch.equal(buffer, new)


def test_an_apply_thread_that_cannot_start_is_a_weight_sync_error(pooled, monkeypatch):
    """The pool cannot start a thread (a pids limit): `WeightSyncError`, nothing reported past
    the frames applied, no apply left running."""

    class Starved(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(stream, "ThreadPoolExecutor", Starved)
    bucket = 256 << 10
    base, new = _sparse_slot(4, bucket)
    buffer = base.clone()
    progress = _Progress(buffer, new)
    with pytest.raises(WeightSyncError, match="thread") as raised:
        _receive(_wire(new, base, bucket, (0, new.numel())), buffer, new.numel(), progress, workers=4)
    assert isinstance(raised.value.__cause__, RuntimeError) and progress.ends == []


def test_frames_encoded_ahead_are_sent_while_the_next_bucket_is_compared(pooled):
    """Bucket 1 is not compared yet (`ready(1)` is False): the stream sends frame 0, encoded on
    the pool, instead of waiting for bucket 1's changes with the link idle."""
    bucket = 256 << 10
    base, new = _sparse_slot(3, bucket)
    changes = [compare(new[k : k + bucket], base[k : k + bucket], dense=0.5) for k in range(0, new.numel(), bucket)]
    compared = {0}

    def changes_of(k: int) -> Changes | None:
        assert k in compared, f"asked for bucket {k} before it was compared"
        return changes[k]

    encoded = []
    with ThreadPoolExecutor(2, thread_name_prefix="test-encode") as encoder:

        def encode_span(*args):  # noqa: ANN002, ANN202
            encoded.append(threading.current_thread().name)
            return real(*args)

        real, stream.encode_span = stream.encode_span, encode_span
        try:
            frames = delta_frames(new, (0, new.numel()), changes_of, bucket, 5, encoder, 4, compared.__contains__)
            header, payload = next(frames), next(frames)
            compared.update((1, 2))
            wire = bytearray(bytes(header) + bytes(payload) + b"".join(bytes(v) for v in frames))
        finally:
            stream.encode_span = real
    assert Frame.unpack(bytes(header)).span == bucket
    assert wire == _wire(new, base, bucket, (0, new.numel()))
    assert encoded and all(name.startswith("test-encode") for name in encoded), encoded


@pytest.mark.parametrize("value", ["0", "65", "-1", "", " 4", "4.0", "abc", "\u0663", "\u00b2"])
def test_a_bad_thread_count_is_a_schema_error(monkeypatch, value):
    """`SLUICE_DELTA_THREADS` takes ASCII digits from 1 to 64 and nothing else."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", value)
    with pytest.raises(SchemaError, match="SLUICE_DELTA_THREADS"):
        threads()


def test_thread_count_from_the_environment_affinity_and_cgroup_quota(monkeypatch, tmp_path):
    """An override is taken as given; otherwise the cores but one, at most 8, counting only
    those the cgroup's CPU quota allows (v2 `cpu.max`, v1 `cpu.cfs_*`), and `os.cpu_count`
    where there is no affinity."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", "64")
    assert threads() == 64
    monkeypatch.delenv("SLUICE_DELTA_THREADS")
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert delta._cgroup_quota(str(tmp_path)) == 3
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert delta._cgroup_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert delta._cgroup_quota(str(tmp_path)) == 4
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert delta._cgroup_quota(str(tmp_path)) is None
    monkeypatch.setattr(delta, "_cgroup_quota", lambda: 3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert threads() == 2
    monkeypatch.setattr(delta, "_cgroup_quota", lambda: None)
    assert threads() == 8
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert threads() == 3
