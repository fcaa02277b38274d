"""What one request may cost and what it may wait for: timeouts that are numbers, frame windows
released as soon as a put's frames are stored, and a wait for a window never blamed on storage."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch

import transfer_queue as tq
from controllers.intake import MAX_OPEN_PUTS_PER_PEER, MAX_PUT_ROWS
from controllers.service import Controller
from tests.faults import eventually
from tests.helpers import eventually_async
from tests.peers import ask, peer
from transfer_queue.wire.messages import (
    BeginPut,
    ClusterConfig,
    ControllerRequest,
    Lookup,
    LookupReply,
    PutPlan,
    SetVersion,
    Status,
    WaitVersion,
    Write,
)
from transfer_queue.wire.meta import FieldSpec
from transfer_queue.wire.rpc import Codec

SPEC = {"x": FieldSpec("uint8", (256 << 10,))}  # 4 rows: 1 MiB, the frame window of a 32 MiB unit


@pytest.mark.parametrize("timeout", [math.nan, -1.0, math.inf])
def test_a_timeout_must_be_a_number_of_seconds(client, timeout):
    for call in (
        lambda: client.lookup("k", timeout=timeout),
        lambda: client.wait_version(1, timeout=timeout),
        lambda: client.get_meta(["x"], 1, task="t", timeout=timeout),
        lambda: client.put({"x": np.zeros(1)}, timeout=timeout),
        lambda: client.acquire(1, timeout=timeout),
    ):
        with pytest.raises(tq.SchemaError, match="timeout must be"):
            call()
    # a peer that skips the client's check is refused when its message is decoded
    body = msgspec.msgpack.encode({"op": "lookup", "key": "k", "timeout": timeout})
    frames = Codec(ControllerRequest).encode(7, Lookup("k"))
    with pytest.raises(tq.ProtocolError, match="timeout"):
        Codec(ControllerRequest).decode([frames[0], body])
    assert WaitVersion(1, 1e9).timeout == 1e9, "'forever' is a number too"


def _in_flight(controller, unit: int) -> int:
    return controller.call(Status()).status["units"][str(unit)]["frames_in_flight"]


def test_a_lookup_or_version_wait_that_gives_up_leaves_nothing_parked():
    """A worker polling `lookup(key, timeout)` for a key not yet announced, or `wait_version`,
    must not grow the controller with every try (its handlers, called in process)."""

    async def poll() -> None:
        ctl = Controller(ClusterConfig(), "tcp://127.0.0.1:*")
        try:
            for _ in range(3):
                assert await ctl.on_lookup(Lookup("weights", 0.001), []) == LookupReply(None)
                with pytest.raises(tq.TimeoutError):
                    await ctl.on_wait_version(WaitVersion(0, 0.001), [])
            assert ctl._announce_waiters == {} and not ctl.clock._waiters
            waiting = asyncio.ensure_future(ctl.on_wait_version(WaitVersion(0, 5), []))
            await eventually_async(lambda: ctl.clock._waiters, what="the wait parked")
            ctl.on_set_version(SetVersion(1), [])
            assert (await waiting).history == [1] and not ctl.clock._waiters
        finally:
            ctl.sock.close(linger=0)

    asyncio.run(poll())


def test_a_puts_frames_leave_the_window_once_stored_though_it_never_commits(make_cluster):
    """A producer that dies after its writes landed but before its commit holds no frame window:
    the next put on that unit is placed at once."""
    cluster = make_cluster(num_storage_units=1, storage_capacity="32MiB")
    controller = peer(cluster.address)
    first = controller.call(BeginPut("train", SPEC, 4, 256 << 10, timeout=20.0))
    assert _in_flight(controller, 0) == 1 << 20
    unit = peer(controller.call(Status()).status["units"]["0"]["address"])
    write = Write("train", first.indexes, SPEC, put=first.indexes[0], ticket=first.tickets[0])
    unit.post(write, [np.zeros(1 << 20, np.uint8)])
    eventually(lambda: _in_flight(controller, 0) == 0, 10, "the stored frames left the window")
    second = ask(controller, BeginPut("train", SPEC, 4, 256 << 10, timeout=0.0))
    assert isinstance(second, PutPlan), second
    unit.close()
    controller.close()


def test_a_put_waiting_for_a_frame_window_says_so(make_cluster):
    """An open put whose frames never came (its producer stalled) fills the window; a put behind
    it times out naming the window, not as storage being full: the unit has room."""
    cluster = make_cluster(num_storage_units=1, storage_capacity="32MiB")
    controller = peer(cluster.address)
    controller.call(BeginPut("train", SPEC, 4, 256 << 10, timeout=20.0))
    with pytest.raises(tq.TimeoutError, match="frame window") as refused:
        controller.call(BeginPut("train", SPEC, 1, 256 << 10, timeout=0.3))
    assert not isinstance(refused.value, tq.CapacityError)
    assert "unit 0: 1048576 of 1048576" in str(refused.value)
    controller.close()


def _anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


def test_one_put_costs_the_controller_a_bounded_amount(make_cluster):
    """A put of a million empty rows is refused at once, naming the limit; the largest put that
    is taken (MAX_PUT_ROWS empty rows) costs the controller under 16 MiB."""
    cluster = make_cluster(num_storage_units=1, storage_capacity="64MiB")
    controller = peer(cluster.address)
    with pytest.raises(tq.CapacityError, match="MAX_PUT_ROWS"):
        controller.call(BeginPut("train", {"x": FieldSpec("uint8", ())}, 1_000_000, 0))
    pid = cluster.services[0]["pid"]
    before = _anon_mib(pid)
    plan = controller.call(BeginPut("train", {"x": FieldSpec("uint8", ())}, MAX_PUT_ROWS, 1), timeout=30)
    assert len(plan.indexes) == MAX_PUT_ROWS
    assert _anon_mib(pid) - before < 16
    controller.close()


def test_one_connection_holds_a_bounded_number_of_open_puts(make_cluster):
    cluster = make_cluster(num_storage_units=1, storage_capacity="32MiB")
    greedy, other = peer(cluster.address), peer(cluster.address)
    spec = {"x": FieldSpec("uint8", ())}
    rids = [greedy.send(BeginPut("train", spec, 1, 1)) for _ in range(MAX_OPEN_PUTS_PER_PEER)]
    for rid in rids:
        assert isinstance(greedy.reply(rid, 30)[0], PutPlan)
    with pytest.raises(tq.CapacityError, match="MAX_OPEN_PUTS_PER_PEER"):
        greedy.call(BeginPut("train", spec, 1, 1))
    assert isinstance(other.call(BeginPut("train", spec, 1, 1)), PutPlan), "another connection is not held up"
    greedy.close()
    other.close()


OPENER = r"""
import sys
from tests.peers import peer
from transfer_queue.wire.messages import BeginPut
from transfer_queue.wire.meta import FieldSpec

controller = peer(sys.argv[1])
controller.call(BeginPut("train", {"x": FieldSpec("uint8", (256 << 10,))}, 4, 256 << 10, timeout=20.0))
print("OPEN", flush=True)
sys.stdin.read()
"""


def test_a_producer_killed_mid_put_holds_up_no_other(make_cluster):
    """A producer killed between its BeginPut and its writes: its put fills the unit's frame
    window, and ends (rows and window freed) as soon as its connection closes, not at its
    expiry 45 s later; the next producer's put goes through."""
    cluster = make_cluster(num_storage_units=1, storage_capacity="32MiB")
    dead = subprocess.Popen(
        [sys.executable, "-c", OPENER, cluster.address], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert dead.stdout.readline().strip() == "OPEN"
    with cluster.connect(use_shm=False) as client:
        big = {"x": torch.zeros(4, 256 << 10, dtype=torch.uint8)}
        with pytest.raises(tq.TimeoutError, match="frame window"):
            client.put(big, timeout=0.3)  # the dead-to-be producer's put holds the window
        dead.kill()
        dead.wait()
        eventually(lambda: client.status()["counters"]["open_puts"] == 0, 10, "the killed producer's put ended")
        assert client.status()["units"]["0"]["frames_in_flight"] == 0
        client.put(big, timeout=5)
        assert client.status()["partitions"]["train"]["committed"] == 4
