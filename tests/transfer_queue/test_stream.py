"""Streaming micro-batches with the sync and the async client."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

import transfer_queue as tq
from tests.helpers import eventually, rows
from transfer_queue.wire.messages import MetaReply


def test_sync_stream_ends_when_the_sealed_partition_is_drained(cluster, client):
    def produce():
        with tq.connect(cluster.address) as producer:
            for start in range(0, 50, 10):
                producer.put(rows(10, start))
                time.sleep(0.02)
            producer.seal()

    thread = threading.Thread(target=produce)
    thread.start()
    seen, sizes = [], []
    for batch, meta in client.stream(["x"], 8, task="train", timeout=20):
        seen.extend(batch["x"].tolist())
        sizes.append(len(meta))
    thread.join()
    assert sorted(seen) == list(range(50))
    assert sizes[:-1] == [8] * (len(sizes) - 1) and sizes[-1] == 50 % 8
    status = client.status()["partitions"]["train"]["tasks"]["train"]
    assert status["consumed"] == 50 and status["leased"] == 0


def test_a_partial_stream_ends_only_when_the_sealed_partition_is_drained(cluster, client):
    """With `allow_partial`, a batch is what was ready within `timeout` (here the 2 samples put
    while the stream waited for a whole batch), and the stream goes on until the partition is
    sealed and drained."""
    client.put(rows(4))
    sizes = []
    with tq.connect(cluster.address) as producer:
        for _batch, meta in client.stream(["x"], 4, task="train", timeout=2.0, allow_partial=True):
            sizes.append(len(meta))
            if len(sizes) == 1:
                producer.put(rows(2, 4))
            elif len(sizes) == 2:
                producer.put(rows(4, 6))
                producer.seal()
    assert sizes == [4, 2, 4]
    status = client.status()["partitions"]["train"]["tasks"]["train"]
    assert status["consumed"] == 10 and status["leased"] == 0


async def _stream_until_it_ends(client, fields: list[str], timeout: float) -> list[int]:
    """The sizes of the batches a partial stream hands out, raising what it raises; bounded
    (asyncio's TimeoutError, not Sluice's) so that a stream that never ends fails the test."""
    sizes: list[int] = []

    async def consume() -> None:
        async for _batch, meta in client.stream(fields, 4, task="train", timeout=timeout, allow_partial=True):
            sizes.append(len(meta))

    await asyncio.wait_for(consume(), 10)
    return sizes


@pytest.mark.parametrize("timeout", [0.0, 0.5])
async def test_a_partial_stream_raises_when_nothing_came_within_timeout(cluster, timeout):
    """The producer is gone, the partition not sealed: once nothing came within `timeout` the
    stream raises Sluice's `TimeoutError` (with 0, at once: it does not ask again and again),
    the batch it handed out acked and nothing left leased."""
    client = await tq.connect_async(cluster.address)
    await client.put(rows(4))
    with pytest.raises(tq.TimeoutError, match="too few ready samples"):
        await _stream_until_it_ends(client, ["x"], timeout)
    task = (await client.status())["partitions"]["train"]["tasks"]["train"]
    assert task["consumed"] == 4 and task["leased"] == 0
    await client.close()


async def test_a_partial_stream_names_a_field_no_put_brought(cluster):
    """A misspelled field on a sealed partition that still has samples: the stream raises the
    controller's `TimeoutError` naming it, as a stream without `allow_partial` does."""
    client = await tq.connect_async(cluster.address)
    await client.put(rows(4))
    await client.seal()
    with pytest.raises(tq.TimeoutError, match=r"field\(s\) \['x_typo'\] that no put has brought"):
        await _stream_until_it_ends(client, ["x_typo"], 0.5)
    assert await _stream_until_it_ends(client, ["x"], 0.5) == [4]  # and the real name drains it
    await client.close()


def test_leaving_a_stream_early_gives_back_what_was_not_consumed(client):
    client.put(rows(32))
    for _batch, meta in client.stream(["x"], 8, task="train", timeout=5):
        client.ack(meta)  # finished this one, then stop
        break
    status = client.status()["partitions"]["train"]["tasks"]["train"]
    assert status["consumed"] == 8 and status["leased"] == 0
    rest = client.get_meta(["x"], 24, task="train", timeout=5)
    assert sorted(client.get_data(rest)["x"].tolist()) == list(range(8, 32))


def test_sync_stream_reads_the_next_batch_before_it_is_taken(make_cluster):
    """The batch after the one in hand is leased and read while the caller works (here its work
    is a status call, which lets the prefetch advance): taking it then needs nothing from the
    storage unit, which is stopped meanwhile; leaving early gives the prefetched lease back."""
    cluster = make_cluster()
    unit_proc = cluster.backend.procs[1]
    with tq.connect(cluster.address, use_shm=False) as client:
        client.put(rows(32))
        client.seal()
        batches = client.stream(["x"], 8, task="train", timeout=10)
        batch, _meta = next(batches)
        assert batch["x"].tolist() == list(range(8))
        task = lambda: client.status()["partitions"]["train"]["tasks"]["train"]  # noqa: E731
        # each status call lets the prefetch advance, until nothing the stream launched is in flight
        read_ahead = lambda: task() and not client._ahead  # noqa: E731
        eventually(read_ahead, 10, "the next batch's data requested before it is taken")
        assert task()["leased"] == 16
        unit_proc.send_signal(signal.SIGSTOP)
        try:
            batch, _meta = next(batches)  # the unit cannot answer: its data is already here
        finally:
            unit_proc.send_signal(signal.SIGCONT)
        assert batch["x"].tolist() == list(range(8, 16))
        eventually(read_ahead, 10, "batch 3's data requested while batch 2 is in hand")
        batches.close()  # leave early: batch 2 nacked, the prefetched batch 3 given back
        assert task()["leased"] == 0 and task()["consumed"] == 8
        rest = client.get_meta(["x"], 24, task="train", timeout=5)
        assert sorted(client.get_data(rest)["x"].tolist()) == list(range(8, 32))


async def test_async_stream_prefetches_and_drains(cluster):
    client = await tq.connect_async(cluster.address)
    for start in range(0, 40, 8):
        await client.put(rows(8, start))
    await client.seal()
    seen = []
    async for batch, _meta in client.stream(["x"], 16, task="train", timeout=10):
        seen.extend(batch["x"].tolist())
    assert sorted(seen) == list(range(40))
    await client.close()


async def test_async_stream_left_early_gives_back_the_prefetched_batch(cluster):
    client = await tq.connect_async(cluster.address)
    await client.put(rows(32))
    await client.seal()
    batches = client.stream(["x"], 8, task="train", timeout=10)
    batch, _meta = await anext(batches)
    assert batch["x"].tolist() == list(range(8))
    while (await client.status())["partitions"]["train"]["tasks"]["train"]["leased"] < 16:
        pass  # each status() awaits a round trip, while the next batch is leased (and read)
    await batches.aclose()
    task = (await client.status())["partitions"]["train"]["tasks"]["train"]
    assert task["leased"] == 0 and task["consumed"] == 0
    await client.close()


async def test_async_stream_left_as_the_prefetched_lease_arrives_gives_it_back(cluster):
    """The stream is left in the instant after the prefetch's lease came, before its flow
    resumed to see it (the race behind a flaky test): the driver gives that lease back."""
    client = await tq.connect_async(cluster.address)
    await client.put(rows(16))
    batches = client.stream(["x"], 8, task="train", timeout=10)
    batch, _meta = await anext(batches)
    assert batch["x"].tolist() == list(range(8))
    # wait for the prefetch's lease from inside the driver: this wakes before its flow does
    leased = asyncio.Event()
    call = client._call

    async def call_and_tell(c):
        reply = await call(c)
        if isinstance(reply[0], MetaReply) and len(reply[0].meta):
            leased.set()
        return reply

    client._call = call_and_tell
    await leased.wait()
    await batches.aclose()
    task = (await client.status())["partitions"]["train"]["tasks"]["train"]
    assert task["leased"] == 0 and task["consumed"] == 0
    await client.close()


async def test_async_client_serves_concurrent_coroutines(cluster):
    client = await tq.connect_async(cluster.address)
    waiter = asyncio.ensure_future(client.get_meta(["x"], 4, task="t", timeout=10))
    while (await client.status())["counters"]["parked_get_meta"] < 1:
        pass  # each status() is a round trip to the controller: this waits for the request to park
    assert not waiter.done()
    await client.put(rows(4))  # same client, while its other request is parked
    meta = await asyncio.wait_for(waiter, 5)
    assert len(meta) == 4
    batch = await client.get_data(meta)
    assert batch["x"].tolist() == [0, 1, 2, 3]
    # a cancelled, parked get_meta is withdrawn: it takes nothing when samples arrive later
    pending = asyncio.ensure_future(client.get_meta(["x"], 8, task="u", timeout=10, lease_timeout=60))
    while (await client.status())["counters"]["parked_get_meta"] < 1:
        pass
    pending.cancel()
    while (await client.status())["counters"]["parked_get_meta"] > 0:
        pass  # the cancel is withdrawn at the controller
    await client.put(rows(4, 4))
    again = await client.get_meta(["x"], 8, task="u", timeout=5)
    assert sorted((await client.get_data(again))["x"].tolist()) == list(range(8))
    with pytest.raises(tq.SchemaError):
        await client.get_meta(["x"], -1, task="t")
    await client.close()
