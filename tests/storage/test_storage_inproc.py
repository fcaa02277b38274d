"""In-process checks of the unit's handlers where timing must be exact: frame pins, the write queue."""

from __future__ import annotations

import asyncio
import gc
import inspect
import uuid

import numpy as np
import pytest

from storage import StorageUnit
from storage.space import Ticket
from transfer_queue.wire.errors import CapacityError
from transfer_queue.wire.messages import CommitWrite, Free, Read, Write, WriteReply
from transfer_queue.wire.meta import FieldSpec

ROW = 256 << 10  # above ZeroMQ's copy threshold: reads of it are zero-copy frames


async def test_frames_in_flight_keep_their_bytes_until_released() -> None:
    unit = StorageUnit(0, 1 << 20, f"test-{uuid.uuid4().hex[:8]}")
    try:
        spec = {"x": FieldSpec("uint8", (ROW,))}
        assert unit._on_write(Write("p", [0, 1], spec), [np.full(2 * ROW, 7, np.uint8)]) == WriteReply()
        reply, frames = unit._on_read(Read("p", [0, 1], ["x"]), [])
        assert len(frames) == 1 and isinstance(frames[0], np.ndarray)
        unit._on_free(Free("p"), [])
        assert unit.status()["rows"] == {}
        assert unit.arena.used == 2 * ROW  # still pinned by the frame ZeroMQ would be sending
        # new writes go elsewhere; the frame's bytes stay intact
        assert unit._on_write(Write("q", [0], spec), [np.full(ROW, 9, np.uint8)]) == WriteReply()
        assert (frames[0] == 7).all()
        del frames, reply
        gc.collect()
        await asyncio.sleep(0)  # the release is posted to the loop (it may come from pyzmq's thread)
        assert unit.arena.used == ROW
        assert unit.arena.alloc(2 * ROW) == 0  # the pinned extent is free again
    finally:
        unit.close()


async def test_small_runs_are_not_pinned() -> None:
    unit = StorageUnit(0, 1 << 20, f"test-{uuid.uuid4().hex[:8]}")
    try:
        spec = {"x": FieldSpec("int32", (4,))}
        unit._on_write(Write("p", [0, 1], spec), [np.arange(8, dtype=np.int32)])
        _reply, frames = unit._on_read(Read("p", [1], ["x"]), [])
        assert isinstance(frames[0], memoryview) and bytes(frames[0]) == np.arange(4, 8, dtype=np.int32).tobytes()
        unit._on_free(Free("p"), [])
        assert unit.arena.used == 0
    finally:
        unit.close()


async def _fill(unit: StorageUnit, partition: str, nbytes: int) -> None:
    spec = {"x": FieldSpec("uint8", (nbytes,))}
    reply = unit._on_write(Write(partition, [0], spec), [np.zeros(nbytes, np.uint8)])
    assert (await reply if inspect.isawaitable(reply) else reply) == WriteReply()


def _waiting_write(unit: StorageUnit, partition: str, nbytes: int, timeout: float = 10.0, via: str = "frames"):
    """A write that waits for space; a second waiter must be a shm write (no frames held)."""
    frames = [np.ones(nbytes, np.uint8)] if via == "frames" else []
    result = unit._on_write(
        Write(partition, [0], {"x": FieldSpec("uint8", (nbytes,))}, via=via, timeout=timeout), frames
    )
    assert isinstance(result, Ticket), "expected the write to wait for space"
    return result


async def test_a_later_write_never_overtakes_a_waiting_one() -> None:
    unit = StorageUnit(0, 1 << 20, f"test-{uuid.uuid4().hex[:8]}")
    try:
        await _fill(unit, "a", 768 << 10)
        big = _waiting_write(unit, "big", 512 << 10)
        small = _waiting_write(unit, "small", 64 << 10, via="shm")  # fits, but queues: its place is taken at once
        assert len(unit.space) == 2
        unit._on_free(Free("a"), [])
        assert await big == WriteReply()
        unit._on_commit(CommitWrite((await small).token), [])
        assert unit.status()["rows"] == {"big": 1, "small": 1}
    finally:
        unit.close()


async def test_a_dropped_ticket_frees_its_place_and_its_chunks() -> None:
    unit = StorageUnit(0, 1 << 20, f"test-{uuid.uuid4().hex[:8]}")
    try:
        await _fill(unit, "a", 768 << 10)
        ticket = _waiting_write(unit, "gone", 512 << 10)  # its task is cancelled before it ever runs
        behind = _waiting_write(unit, "b", 256 << 10, via="shm")
        del ticket
        gc.collect()
        unit._on_commit(CommitWrite((await behind).token), [])  # the head of the queue was not lost
        assert len(unit.space) == 0

        # handed its chunks, then cancelled before it could store them: they come back
        unit._on_free(Free("b"), [])
        task = asyncio.ensure_future(_await(_waiting_write(unit, "late", 512 << 10)))
        await asyncio.sleep(0)
        unit._on_free(Free("a"), [])  # chunks handed over now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
        assert unit.arena.used == 0 and unit.status()["rows"] == {}
    finally:
        unit.close()


async def _await(awaitable):
    return await awaitable


async def test_waiting_frames_are_bounded_by_a_twentieth_of_the_capacity() -> None:
    """Writes parked on a full unit hold their frames outside the arena: one write, or at most
    capacity / 20 bytes of them; frames beyond that are refused at once, never buffered."""
    unit = StorageUnit(0, 1 << 20, f"test-{uuid.uuid4().hex[:8]}")
    try:
        await _fill(unit, "a", 1 << 20)
        first = _waiting_write(unit, "w1", 768 << 10)  # one write may always wait
        assert unit.status()["pending_bytes"] == 768 << 10
        with pytest.raises(CapacityError, match="already wait for space"):
            unit._on_write(Write("w3", [0], {"x": FieldSpec("uint8", (1 << 10,))}), [np.ones(1 << 10, np.uint8)])
        # shm reservations hold no frames, so they may still queue
        shm = unit._on_write(Write("w4", [0], {"x": FieldSpec("uint8", (64 << 10,))}, via="shm"), [])
        assert isinstance(shm, Ticket)
        unit._on_free(Free("a"), [])
        assert await first == WriteReply()
        assert unit.status()["pending_bytes"] == 0
        del shm
        gc.collect()
        assert len(unit.space) == 0
    finally:
        unit.close()
