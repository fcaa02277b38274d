"""The arena: the extent allocator's bookkeeping, and the shared-memory file's life cycle."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage.arena import Arena, ExtentAllocator
from transfer_queue.host import FreeLog

PAGE = 16
PAGES = 64


def _check(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    """Live extents never overlap each other or the free list; together they tile the space."""
    spans = sorted((off, alloc.rounded(n)) for off, n in live.items() if n)
    spans += alloc.extents()
    spans.sort()
    pos = 0
    for off, size in spans:
        assert off == pos, f"gap or overlap at {off} (expected {pos}): {spans}"
        assert size > 0
        pos = off + size
    assert pos == alloc.capacity
    assert alloc.used == sum(alloc.rounded(n) for n in live.values())
    free = alloc.extents()
    for (a, na), (b, _) in zip(free, free[1:]):
        assert a + na < b, "adjacent free extents were not coalesced"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(0, PAGE * PAGES // 3)),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_alloc_free_never_overlaps_and_coalesces(seq: list[tuple[str, int]]) -> None:
    alloc = ExtentAllocator(PAGE * PAGES, PAGE)
    live: dict[int, int] = {}  # offset -> requested bytes (non-empty extents only)
    for op, arg in seq:
        if op == "alloc":
            off = alloc.alloc(arg)
            if off is None:
                assert alloc.largest_free < alloc.rounded(arg), "best fit missed a free extent that fits"
            elif arg:
                assert off % PAGE == 0 and off not in live
                live[off] = arg
        elif live:
            off = sorted(live)[arg % len(live)]
            alloc.free(off, live.pop(off))
        _check(alloc, live)
    for off, n in list(live.items()):
        alloc.free(off, n)
    assert alloc.used == 0
    assert alloc.extents() == [(0, PAGE * PAGES)]


def test_best_fit_takes_the_smallest_hole_and_keeps_large_ones_whole() -> None:
    alloc = ExtentAllocator(PAGE * 16, PAGE)
    a, b, c, d, e = (alloc.alloc(n * PAGE) for n in (1, 4, 1, 2, 1))
    assert (a, b, c, d, e) == (0, PAGE, 5 * PAGE, 6 * PAGE, 8 * PAGE)
    alloc.free(b, 4 * PAGE)
    alloc.free(d, 2 * PAGE)
    assert alloc.alloc(1) == d  # the 2-grain hole, not the lowest (4) nor the tail (7)
    assert alloc.alloc(PAGE * 5) == 9 * PAGE  # only the tail holds 5
    assert alloc.alloc(PAGE * 4) == b
    assert alloc.alloc(PAGE * 3) is None  # 1 + 2 grains free, never 3 in one piece
    assert alloc.used == alloc.capacity - 3 * PAGE and alloc.largest_free == 2 * PAGE


def test_zero_bytes_cost_nothing_and_bad_frees_are_refused() -> None:
    alloc = ExtentAllocator(PAGE * 4, PAGE)
    assert alloc.alloc(0) == 0 and alloc.used == 0
    alloc.free(0, 0)
    off = alloc.alloc(PAGE + 1)
    assert alloc.used == 2 * PAGE
    with pytest.raises(ValueError):
        alloc.free(off + 1, PAGE)  # misaligned
    with pytest.raises(ValueError):
        alloc.free(2 * PAGE, PAGE)  # already free
    with pytest.raises(ValueError):
        alloc.free(off, PAGE)  # of another size
    alloc.free(off, PAGE + 1)
    with pytest.raises(ValueError):
        alloc.free(off, PAGE + 1)  # double free
    with pytest.raises(ValueError):
        ExtentAllocator(PAGE - 1, PAGE)
    with pytest.raises(ValueError):
        ExtentAllocator(1000, 24)


def test_chunks_free_their_extent_with_the_last_reference() -> None:
    with Arena(f"/dev/shm/sluice-test-{uuid.uuid4().hex[:8]}-u0", 1 << 20) as arena:
        chunk = arena.new_chunk(100_000)
        assert chunk is not None and arena.used == 100_000  # a multiple of the alignment
        chunk.refs += 2  # two rows
        assert not arena.unref(chunk)  # the creator lets go
        assert not arena.unref(chunk)
        assert arena.unref(chunk) and arena.used == 0
        with pytest.raises(ValueError):
            arena.unref(chunk)


def test_arena_file_is_exclusive_prefaulted_and_unlinked() -> None:
    path = f"/dev/shm/sluice-test-{uuid.uuid4().hex[:8]}-u1"
    arena = Arena(path, (4 << 20) + 100)
    try:
        assert arena.capacity == (4 << 20) + 96  # whole aligned extents only
        # then the free log, from the next page
        assert os.path.getsize(path) == (4 << 20) + 4096 + FreeLog.nbytes()
        with pytest.raises(FileExistsError):
            Arena(path, 1 << 20)  # another unit with the same name must not clobber this one
        arena.array[:4] = [1, 2, 3, 4]
        with open(path, "rb") as f:
            assert f.read(4) == b"\x01\x02\x03\x04"  # the file is the memory
        arena.start_prefault()
        assert arena.wait_prefault(30)
        assert arena.prefaulted in (0, arena.size)  # 0 only where the kernel lacks the advice
    finally:
        arena.close()
    assert not os.path.exists(path)
    arena.close()  # idempotent


@contextlib.contextmanager
def _arena_and_its_log() -> Iterator[tuple[Arena, FreeLog]]:
    """A 1 MiB arena of a fresh cluster's unit 0, and a reader's view of its free log."""
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/sluice-{cluster}-u0"
    with Arena(path, 1 << 20) as arena:
        log = FreeLog.open(cluster, 0, path, arena.capacity)
        assert log is not None
        try:
            yield arena, log
        finally:
            log.close()


def test_freed_extents_are_logged_for_readers_of_the_file() -> None:
    """A reader that noted the epoch before asking for runs learns whether an extent freed since
    overlapped them, and only then (a neighbour's free is no alarm)."""
    with _arena_and_its_log() as (arena, log):
        a, b, c = (arena.new_chunk(n) for n in (5000, 100, 8192))
        assert a is not None and b is not None and c is not None
        assert (a.offset, b.offset, c.offset) == (0, 5008, 5120)
        since = log.epoch()
        assert log.intact([(5008, 100)], since)  # nothing freed: one word read
        arena.unref(b)
        assert log.epoch() == since + 1
        assert not log.intact([(5008, 100)], since)  # b itself
        assert not log.intact([(0, 16), (5000, 16)], since)  # a run that reaches into b
        assert log.intact([(0, 5008), (5120, 8192)], since)  # its neighbours
        assert log.intact([(5008, 100)], log.epoch())  # freed before the epoch noted
        assert log.intact([(5008, 0)], since)  # an empty run holds no bytes
        arena.unref(a)
        arena.unref(c)
        assert not log.intact([(6000, 10)], since) and not log.intact([(6000, 10)], since + 1)
        assert log.intact([(6000, 10)], since + 3)
        log.close()
        log.close()  # idempotent


def test_a_reader_cannot_vouch_for_runs_after_more_frees_than_the_log_holds() -> None:
    with _arena_and_its_log() as (arena, log):
        since = log.epoch()
        for _ in range(FreeLog.RING):
            chunk = arena.new_chunk(16)
            assert chunk is not None and chunk.offset == 0
            arena.unref(chunk)
        assert log.intact([(4096, 16)], since)  # every free since is still in the ring
        assert not log.intact([(4096, 16), (8, 16)], since)  # and each overlaps this run
        chunk = arena.new_chunk(16)
        assert chunk is not None
        arena.unref(chunk)
        assert not log.intact([(4096, 16)], since)  # one too many: the first was overwritten
        assert log.intact([(4096, 16)], since + 1)


def test_a_reader_finds_no_log_in_a_file_without_one() -> None:
    """An arena file of a unit before the free log (nothing after the arena), or another file:
    the reader reads that unit with frames."""
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/sluice-{cluster}-u0"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        assert FreeLog.open(cluster, 0, path, 1 << 20) is None  # too short
        os.ftruncate(fd, FreeLog.offset(1 << 20) + FreeLog.nbytes())
        assert FreeLog.open(cluster, 0, path, 1 << 20) is None  # long enough, no ring size
        assert FreeLog.open(cluster, 0, path + "x", 1 << 20) is None  # not the unit's name
    finally:
        os.close(fd)
        os.unlink(path)
