"""Backpressure on a 1 MiB unit: waiting, timeouts, FIFO, expiry; fields split over scattered free extents."""

from __future__ import annotations

import time

import numpy as np
import pytest
from storage_harness import UnitClient, raise_for

from transfer_queue.wire.errors import CapacityError, SchemaError, TimeoutError
from transfer_queue.wire.messages import Cancel, CommitWrite, Free, Read, UnitStatus, Write, WriteReply
from transfer_queue.wire.meta import FieldSpec

KIB = 1 << 10
CAPACITY = 1 << 20


def _write(client: UnitClient, partition: str, index: int, nbytes: int, timeout: float = 10.0, fill: int = 1) -> int:
    """Send (do not wait for) a one-row write of `nbytes` bytes."""
    msg = Write(partition, [index], {"x": FieldSpec("uint8", (nbytes,))}, timeout=timeout)
    return client.send(msg, [np.full(nbytes, fill, np.uint8)])


def _status(client: UnitClient) -> dict:
    return client.ok(UnitStatus())[0].status


def _wait_for(client: UnitClient, key: str, value: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _status(client)[key] != value:
        assert time.monotonic() < deadline, f"{key} never became {value}: {_status(client)}"
        time.sleep(0.02)


def test_a_write_waits_until_free_makes_room(small_client: UnitClient) -> None:
    assert _status(small_client)["capacity"] == CAPACITY
    raise_for(*small_client.recv(_write(small_client, "a", 0, 768 * KIB)))
    waiting = _write(small_client, "b", 0, 512 * KIB, fill=2)
    assert small_client.pending(waiting, wait=0.3)
    assert _status(small_client)["pending_writes"] == 1
    small_client.ok(Free("a"))
    assert raise_for(*small_client.recv(waiting))[0] == WriteReply()
    _reply, frames = small_client.ok(Read("b", [0], ["x"]))
    assert frames[0].bytes == b"\x02" * (512 * KIB)
    assert _status(small_client)["used"] == 512 * KIB


def test_a_write_that_times_out_stores_nothing(small_client: UnitClient) -> None:
    raise_for(*small_client.recv(_write(small_client, "a", 0, 768 * KIB)))
    start = time.monotonic()
    with pytest.raises(CapacityError, match=r"storage unit 3 is full: 786432 of 1048576 bytes used.*clear consumed"):
        raise_for(*small_client.recv(_write(small_client, "c", 0, 512 * KIB, timeout=0.3)))
    assert 0.25 < time.monotonic() - start < 5
    status = _status(small_client)
    assert status["used"] == 768 * KIB and status["pending_writes"] == 0 and "c" not in status["rows"]
    with pytest.raises(SchemaError):
        small_client.ok(Read("c", [0], ["x"]))


def test_a_write_larger_than_the_unit_fails_at_once(small_client: UnitClient) -> None:
    start = time.monotonic()
    with pytest.raises(CapacityError, match="can never fit"):
        small_client.ok(Write("huge", [0], {"x": FieldSpec("uint8", (2 * CAPACITY,))}, via="shm", timeout=30))
    two = {"x": FieldSpec("uint8", (600 * KIB,)), "y": FieldSpec("uint8", (600 * KIB,))}
    with pytest.raises(CapacityError, match="can never fit"):
        small_client.ok(Write("huge", [0], two, timeout=30), [np.zeros(600 * KIB, np.uint8)] * 2)
    assert time.monotonic() - start < 3
    assert _status(small_client)["used"] == 0


def test_waiting_writes_are_served_first_come_first_served(small_client: UnitClient) -> None:
    raise_for(*small_client.recv(_write(small_client, "a", 0, 768 * KIB)))
    big = _write(small_client, "d", 0, 512 * KIB)
    # would fit now, but must not overtake (a shm write: no more frames may wait than `big`'s)
    small = small_client.send(Write("e", [0], {"x": FieldSpec("uint8", (128 * KIB,))}, via="shm", timeout=10.0))
    assert small_client.pending(small, wait=0.3) and small_client.pending(big)
    assert _status(small_client)["pending_writes"] == 2
    small_client.ok(Free("a"))
    replies = [small_client.recv_any() for _ in range(2)]
    assert [rid for rid, _, _ in replies] == [big, small]
    assert _status(small_client)["used"] == 640 * KIB
    small_client.ok(CommitWrite(replies[1][1].token))


def test_an_uncommitted_reservation_expires_and_wakes_waiters(small_client: UnitClient) -> None:
    reply, _ = small_client.ok(Write("r", [0], {"x": FieldSpec("uint8", (768 * KIB,))}, via="shm", timeout=0.5))
    status = _status(small_client)
    assert status["reservations"] == 1 and status["used"] == 768 * KIB
    waiting = _write(small_client, "w", 0, 512 * KIB, timeout=10)
    assert small_client.pending(waiting, wait=0.2)
    # the producer died mid-batch: its reservation goes, and the waiting write gets the space
    assert raise_for(*small_client.recv(waiting, timeout=5))[0] == WriteReply()
    status = _status(small_client)
    assert status["reservations"] == 0 and status["used"] == 512 * KIB
    with pytest.raises(TimeoutError, match="expired"):
        small_client.ok(CommitWrite(reply.token))
    small_client.ok(CommitWrite(reply.token, abort=True))  # aborting stays harmless
    with pytest.raises(SchemaError):
        small_client.ok(Read("r", [0], ["x"]))


def test_aborting_a_reservation_lets_a_waiter_in(small_client: UnitClient) -> None:
    reply, _ = small_client.ok(Write("r", [0], {"x": FieldSpec("uint8", (768 * KIB,))}, via="shm"))
    waiting = _write(small_client, "w", 0, 512 * KIB)
    assert small_client.pending(waiting, wait=0.2)
    small_client.ok(CommitWrite(reply.token, abort=True))
    assert raise_for(*small_client.recv(waiting))[0] == WriteReply()
    _wait_for(small_client, "used", 512 * KIB)


def test_a_cancelled_waiting_write_leaves_the_queue(small_client: UnitClient) -> None:
    raise_for(*small_client.recv(_write(small_client, "a", 0, 768 * KIB)))
    withdrawn = _write(small_client, "gone", 0, 512 * KIB)
    behind = small_client.send(Write("b", [0], {"x": FieldSpec("uint8", (256 * KIB,))}, via="shm", timeout=10.0))
    assert small_client.pending(behind, wait=0.2), _status(small_client)
    small_client.ok(Cancel(withdrawn))  # the client gave up (its own timeout, or interrupted)
    reserved = raise_for(*small_client.recv(behind))[0]  # no longer stuck behind it
    small_client.ok(CommitWrite(reserved.token))
    assert small_client.pending(withdrawn, wait=0.1)  # a withdrawn request gets no answer
    status = _status(small_client)
    assert status["pending_writes"] == 0 and "gone" not in status["rows"] and status["used"] == CAPACITY


def test_a_frame_larger_than_the_unit_is_cut_off_and_the_unit_keeps_serving(units, small_client: UnitClient) -> None:
    """Frames are bounded by the capacity (ZeroMQ drops such a peer before anything is read)."""
    rogue = UnitClient(units.small.address)
    try:
        rid = _write(rogue, "rogue", 0, 2 * CAPACITY)
        assert rogue.pending(rid, wait=0.3)
    finally:
        rogue.close()
    status = _status(small_client)
    assert status["used"] == 0 and "rogue" not in status["rows"]


def test_a_field_no_free_extent_holds_is_split_between_rows(small_client: UnitClient) -> None:
    """Eight 128 KiB writes fill the unit; freeing every other one leaves four separate holes.
    A write of 4 rows of 100,000 bytes (ragged ids alongside) then takes one hole per row, reads
    back whole and in order, and frees to one extent again. A row larger than every hole waits."""
    for i in range(8):
        raise_for(*small_client.recv(_write(small_client, "fill", i, 128 * KIB)))
    small_client.ok(Free("fill", [0, 2, 4, 6]))
    before = _status(small_client)
    spec = {"x": FieldSpec("uint8", (100_000,)), "ids": FieldSpec("int64", (-1,))}
    rows = (np.arange(4 * 100_000) % 251).astype(np.uint8)
    ids = np.arange(10, dtype=np.int64)
    msg = Write("split", [10, 11, 12, 13], spec, lengths={"ids": [1, 2, 3, 4]})
    small_client.ok(msg, [rows, ids])
    status = _status(small_client)
    assert status["fields_split"] == before["fields_split"] + 1  # x; ids fit a hole whole
    assert status["writes_waited"] == before["writes_waited"]
    reply, frames = small_client.ok(Read("split", [13, 10, 11, 12], ["x", "ids"]))
    n = len(reply.runs["x"])
    assert n == 4  # one run per hole: no two rows of x are adjacent
    assert b"".join(f.bytes for f in frames[:n]) == rows.reshape(4, -1)[[3, 0, 1, 2]].tobytes()
    got = np.frombuffer(b"".join(f.bytes for f in frames[n:]), np.int64).tolist()
    assert got == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5] and reply.lengths["ids"] == [4, 1, 2, 3]
    too_big = _write(small_client, "big", 0, 200 * KIB, timeout=0.3)
    with pytest.raises(CapacityError, match="largest free extent is"):
        raise_for(*small_client.recv(too_big))
    small_client.ok(Free("split"))
    small_client.ok(Free("fill"))
    status = _status(small_client)
    assert status["used"] == 0 and status["free_extents"] == 1
