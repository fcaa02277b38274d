"""Puts are atomic and self-cleaning: a producer that dies, times out or is cancelled mid-put
leaves no rows and no bytes behind, never holds a sealed stream open, and a tiny message can
never make the controller allocate a huge table."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import eventually, stalled_producer, unit_status
from tests.helpers import rows, status_bytes
from tests.peers import ask, peer, raw
from transfer_queue.wire.messages import BeginPut, CommitPut, RowInfo
from transfer_queue.wire.meta import FieldSpec


def _td(n: int, width: int = 4) -> TensorDict:
    return TensorDict({"x": torch.ones(n, width)}, batch_size=[n])


@pytest.mark.parametrize("via", ["frames", "shm"])
def test_killed_producer_mid_put_leaves_nothing(cluster, client, via):
    """SIGKILL after the data reached the units, before CommitPut: the close of its connection
    ends the put at once, freeing its rows on the controller and its bytes on the units."""
    proc = stalled_producer(cluster.address, via)
    part = client.status()["partitions"]["train"]
    assert part["samples"] == 16 and part["committed"] == 0
    units = list(client.units.values())
    eventually(lambda: sum(unit_status(u.address)["used"] for u in units) > 0, 10, "the put's bytes on the units")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    eventually(lambda: client.status()["partitions"]["train"]["samples"] == 0, 20, "the end of the dead put")
    status = client.status()
    assert status["bytes"] == 0 and status["counters"]["puts_abandoned"] == 1
    assert status["counters"]["puts_expired"] == 0, "ended by its producer's death, not its deadline"
    for unit in client.units.values():
        eventually(lambda unit=unit: unit_status(unit.address)["used"] == 0, 10, f"unit {unit.unit_id} freed")
        assert unit_status(unit.address)["reservations"] == 0


async def test_cancelled_put_is_aborted_at_once():
    """An asyncio put cancelled while its write waits for space is withdrawn from the unit and
    aborted at the controller before the cancel propagates: nothing of it is left."""
    with tq.init(num_storage_units=1, storage_capacity="8MiB") as cluster:
        client = await tq.connect_async(cluster.address)

        def big() -> TensorDict:
            return TensorDict({"x": torch.zeros(16, 65536)}, batch_size=[16])  # 4 MiB

        await client.put(big())
        await client.put(big())
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.put(big(), timeout=30), 1.0)
        status = await client.status()
        assert status["partitions"]["train"]["samples"] == 32
        assert status["bytes"] == 32 * 65536 * 4
        unit = unit_status(client.units[0].address)
        assert unit["pending_writes"] == 0 and unit["pending_bytes"] == 0
        await client.close()


def test_a_placement_whose_reservation_failed_is_given_back_at_once(make_cluster):
    """A staying put asks the controller for its plan and the unit for its space in one step.
    When the unit's answer fails after the plan was taken (here: the client's wait for it is
    interrupted), the plan the flow never saw is aborted at once, not left to its deadline;
    the put then goes the ordinary way."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        client.put(rows(8))  # whole on the one unit: the next put reserves there beside its BeginPut
        unit = client._core._ahead
        assert unit in client.units
        channel = client._channel(unit)
        reply = channel.reply

        def interrupted(*args, **kwargs):
            channel.reply = reply
            raise tq.TimeoutError("the wait for the reservation was interrupted")

        channel.reply = interrupted
        client.put(rows(8, 8))
        assert channel.reply == reply, "the step that reserved beside the BeginPut ran"
        part = client.status()["partitions"]["train"]
        assert part["samples"] == 16 and part["committed"] == 16
        assert sorted(client.get_data(client.get_meta(["x"], 16, task="t", timeout=5))["x"].tolist()) == list(range(16))


def test_open_put_never_holds_a_sealed_stream_open(cluster, client):
    """A put begun but not committed when the partition is sealed: the stream over the committed
    samples ends at once, and the late commit is refused with `SealedError`."""
    client.put(_td(4))
    # a producer begins a put of 3 samples and has not committed it yet
    channel = peer(cluster.address)
    plan = channel.call(BeginPut("train", {"x": FieldSpec("float32", (4,))}, 3, 16))
    assert client.status()["partitions"]["train"]["samples"] == 7
    client.seal("train")
    got = [len(meta) for _, meta in client.stream(["x"], 2, task="t", timeout=10)]
    assert sum(got) == 4
    reply = ask(
        channel,
        CommitPut(
            "train", plan.indexes, {"x": FieldSpec("float32", (4,))}, RowInfo([0] * 3, [0] * 3, [0, 1, 2], [1] * 3)
        ),
    )
    channel.close()
    assert reply.code == "sealed", reply
    assert client.status()["partitions"]["train"]["samples"] == 4


def test_tiny_message_cannot_make_the_controller_allocate(cluster):
    """An 87-byte BeginPut(n=2e7) is refused before anything is allocated."""
    pid = cluster.backend.procs[0].pid
    before = status_bytes(pid)
    channel = peer(cluster.address)
    frames = channel.codec.encode(1, BeginPut("train", {"x": FieldSpec("uint8", (1,))}, 20_000_000, 1))
    assert sum(len(f) for f in frames) < 128
    _, reply, _ = raw(channel, frames)
    channel.close()
    assert reply.code == "schema" and "at most" in reply.message, reply
    assert status_bytes(pid) - before < 20 << 20
    with tq.connect(cluster.address) as client:
        assert "train" not in client.status()["partitions"] or client.status()["partitions"]["train"]["samples"] == 0
