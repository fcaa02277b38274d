"""Acks and nacks end their own lease only: a consumer whose lease expired never touches the
samples another consumer of the task was handed since (real controller and storage processes).

Each test leases with a tiny `lease_timeout` and waits on `status()` until the lease is gone."""

from __future__ import annotations

import msgspec
import pytest

import transfer_queue as tq
from tests.helpers import eventually, rows
from transfer_queue.wire.messages import Ack, Nack

TINY = 0.05
"""A lease that expires while the test looks on."""
LONG = 60.0
"""A lease that outlives the test."""


def _task(client: tq.Client, task: str = "t") -> dict:
    return client.status()["partitions"]["train"]["tasks"][task]


def _expired(client: tq.Client) -> None:
    """Wait until no lease is open on the cluster (the tiny ones expired)."""
    eventually(lambda: client.status()["counters"]["open_leases"] == 0, 10, "the leases expired")


def test_a_late_ack_leaves_samples_leased_again_to_their_new_holder(cluster, client):
    client.put(rows(4))
    late = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=TINY)
    _expired(client)
    with cluster.connect() as b:
        held = b.get_meta(["x"], 2, task="t", timeout=5, lease_timeout=LONG)
        assert held.indexes == late.indexes[:2] and held.lease_id != late.lease_id
        with pytest.raises(tq.LeaseExpiredError, match=r"2 of its 4 samples .* task 't'.*lease_timeout") as err:
            client.ack(late)
        assert isinstance(err.value, tq.TimeoutError)
        # the two nobody took were acked; B's two are still B's, its lease whole
        assert _task(client) == {"consumed": 2, "leased": 2, "pending": 0}
        counters = client.status()["counters"]
        assert counters["open_leases"] == 1 and counters["samples_ack_refused"] == 2
        b.ack(held)
    assert _task(client) == {"consumed": 4, "leased": 0, "pending": 0}
    with pytest.raises(tq.LeaseExpiredError, match="2 of its 4"):  # B acked them: still not the late one's
        client.ack(late)
    counters = client.status()["counters"]
    assert counters["samples_acked"] == 4 and counters["samples_ack_refused"] == 4 and counters["open_leases"] == 0
    with pytest.raises(tq.TimeoutError):  # each sample consumed once: nothing left for the task
        client.get_meta(["x"], 1, task="t", timeout=0)


def test_a_late_nack_gives_back_nothing_another_consumer_holds(cluster, client):
    client.put(rows(4))
    late = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=TINY)
    _expired(client)
    with cluster.connect() as b, cluster.connect() as c:
        held = b.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=LONG)
        client.nack(late)  # nothing of its own to give back: a no-op, no error
        assert _task(client) == {"consumed": 0, "leased": 4, "pending": 0}
        assert client.status()["counters"]["open_leases"] == 1
        with pytest.raises(tq.TimeoutError):  # B still holds them all
            c.get_meta(["x"], 1, task="t", timeout=0)
        b.nack(held)  # B's own nack does give them back
        again = c.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=LONG)
        assert again.indexes == held.indexes
        c.ack(again)
    assert _task(client) == {"consumed": 4, "leased": 0, "pending": 0}


def test_a_late_ack_of_samples_nobody_took_since_is_accepted(client):
    client.put(rows(4))
    late = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=TINY)
    _expired(client)
    assert _task(client) == {"consumed": 0, "leased": 0, "pending": 4}
    client.nack(late)  # they are in the pool already: nothing changes
    assert _task(client) == {"consumed": 0, "leased": 0, "pending": 4}
    client.ack(late)
    client.ack(late)  # a repeated ack is a no-op
    assert _task(client) == {"consumed": 4, "leased": 0, "pending": 0}
    counters = client.status()["counters"]
    assert counters["samples_acked"] == 4 and counters["samples_ack_refused"] == 0
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x"], 1, task="t", timeout=0)


def test_without_a_lease_id_acks_and_nacks_end_whatever_lease_holds_the_samples(cluster, client):
    """`lease_id=0` (a meta built or merged by hand, an older client): the behaviour from before
    acks carried their lease."""
    client.put(rows(4))
    late = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=TINY)
    _expired(client)
    unknown = msgspec.structs.replace(late, lease_id=0)
    with cluster.connect() as b:
        held = b.get_meta(["x"], 2, task="t", timeout=5, lease_timeout=LONG)
        client.nack(unknown.select([0]))  # takes B's lease off the first sample
        assert _task(client) == {"consumed": 0, "leased": 1, "pending": 3}
        client.ack(unknown)  # and this one ends B's lease: consumed, B's lease closed
        assert _task(client) == {"consumed": 4, "leased": 0, "pending": 0}
        assert client.status()["counters"]["open_leases"] == 0
        b.ack(held)  # consumed under B's lease already: a no-op, no error
    counters = client.status()["counters"]
    assert counters["samples_acked"] == 4 and counters["samples_ack_refused"] == 0


def test_a_stream_raises_a_late_ack_at_the_batch_after(cluster, client):
    """The stream acks a batch when the next is taken and collects the answer at the batch after:
    the `LeaseExpiredError` of a batch whose samples went to another consumer comes from there."""
    client.put(rows(4))
    taken = []
    with cluster.connect() as b, pytest.raises(tq.LeaseExpiredError, match="2 of its 2 samples"):
        for _batch, meta in client.stream(["x"], 2, task="t", timeout=10, lease_timeout=TINY):
            taken.append(meta.indexes)
            if len(taken) == 1:  # both leases (this batch's, the prefetched one's) run out
                _expired(client)
                held = b.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=LONG)
            else:  # B finishes first; the partition then drains
                b.ack(held)
                client.seal()
    assert taken == [held.indexes[:2], held.indexes[2:]]
    assert _task(client) == {"consumed": 4, "leased": 0, "pending": 0}
    counters = client.status()["counters"]
    assert counters["samples_acked"] == 4 and counters["samples_ack_refused"] == 4


def test_merged_batches_keep_a_lease_only_when_they_share_it(client):
    client.put(rows(6))
    one = client.get_meta(["x"], 4, task="t", timeout=5)
    other = client.get_meta(["x"], 2, task="t", timeout=5)
    first, second = one.chunk(2)
    assert first.lease_id == second.lease_id == one.lease_id != 0
    assert tq.BatchMeta.concat([first, second]).lease_id == one.lease_id
    mixed = tq.BatchMeta.concat([one, other])
    assert mixed.lease_id == 0  # two leases: acked whatever lease its samples are under
    assert first.union(msgspec.structs.replace(first, lease_id=0)).lease_id == one.lease_id
    assert first.union(msgspec.structs.replace(first, lease_id=other.lease_id)).lease_id == 0
    client.ack(mixed)
    assert _task(client) == {"consumed": 6, "leased": 0, "pending": 0}
    assert client.status()["counters"]["open_leases"] == 0


def test_an_ack_or_nack_from_an_older_client_decodes_without_a_lease():
    for kind, cls in (("ack", Ack), ("nack", Nack)):
        old = msgspec.msgpack.encode({"op": kind, "partition": "train", "task": "t", "indexes": [3]})
        assert msgspec.msgpack.decode(old, type=cls) == cls("train", "t", [3], 0)


def test_a_late_ack_after_the_samples_were_cleared_and_compacted(cluster, client):
    """Another consumer acks and clears most of the samples, the table compacts them away: the
    late ack is refused for those still held and takes the rest (no `InternalError`)."""
    client.put(rows(3000))
    late = client.get_meta(["x"], 3000, task="t", timeout=5, lease_timeout=TINY)
    _expired(client)
    with cluster.connect() as b:
        took = b.get_meta(["x"], 2000, task="t", timeout=5, lease_timeout=LONG)
        b.ack(took)
        b.clear(took)  # 2000 of 3000 rows freed: the controller compacts its table
        held = b.get_meta(["x"], 500, task="t", timeout=5, lease_timeout=LONG)
        with pytest.raises(tq.LeaseExpiredError, match=r"500 of its 3000 samples .*\(500 acked\)"):
            client.ack(late)
        assert _task(client) == {"consumed": 500, "leased": 500, "pending": 0}
        b.ack(held)  # its lease was whole
    counters = client.status()["counters"]
    assert counters["samples_ack_refused"] == 500 and counters["open_leases"] == 0


def test_a_lease_id_past_int64_is_refused_and_acks_nothing(client):
    client.put(rows(2))
    meta = client.get_meta(["x"], 2, task="t", timeout=5, lease_timeout=LONG)
    with pytest.raises(tq.SchemaError, match="lease_id"):
        client.ack(msgspec.structs.replace(meta, lease_id=2**64 - 1))
    assert _task(client) == {"consumed": 0, "leased": 2, "pending": 0}
    client.ack(meta)
    assert _task(client) == {"consumed": 2, "leased": 0, "pending": 0}
    for kind, cls in (("ack", Ack), ("nack", Nack)):  # what a service decodes: a ProtocolError there
        wire = msgspec.msgpack.encode(
            {"op": kind, "partition": "train", "task": "t", "indexes": [0], "lease_id": 2**64 - 1}
        )
        with pytest.raises(msgspec.ValidationError, match="lease_id"):
            msgspec.msgpack.decode(wire, type=cls)


# -- a stream whose acks come late gives back every lease it holds ----------------------------


def _leased(client: tq.Client) -> int:
    return _task(client)["leased"]


def _back_to_the_pool(other: tq.Client, put: tq.BatchMeta, indexes: list[int]) -> None:
    """End the stream's leases on `indexes` without waiting for them to expire: a nack without a
    lease id (a hand-built meta) gives the samples back whatever lease holds them."""
    meta = msgspec.structs.replace(put, task="t", lease_id=0)
    other.nack(meta.select([meta.indexes.index(i) for i in indexes]))


def test_a_stream_with_two_late_acks_in_a_row_withdraws_its_prefetched_batch(cluster, client):
    put = client.put(rows(8))
    n = 0
    with cluster.connect() as b, cluster.connect() as c:
        with pytest.raises(tq.LeaseExpiredError, match="2 of its 2"):
            for _batch, _meta in client.stream(["x"], 2, task="t", timeout=10, lease_timeout=LONG):
                n += 1
                if n == 1:  # this batch and the prefetched one go to B
                    eventually(lambda: _leased(client) == 4, 10, "batch 2 prefetched")
                    _back_to_the_pool(c, put, put.indexes[:4])
                    assert b.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=LONG).indexes == put.indexes[:4]
                else:
                    eventually(lambda: _leased(client) == 6, 10, "batch 3 prefetched")
        assert n == 2
        assert _leased(client) == 4  # B's: the prefetched batch 3 was withdrawn
        counters = client.status()["counters"]
        assert counters["open_leases"] == 1 and counters["samples_ack_refused"] == 4


def test_leaving_a_stream_after_a_late_ack_gives_back_both_batches(cluster, client):
    put = client.put(rows(8))
    with cluster.connect() as b, cluster.connect() as c:
        batches = iter(client.stream(["x"], 2, task="t", timeout=10, lease_timeout=LONG))
        _batch, meta = next(batches)
        eventually(lambda: _leased(client) == 4, 10, "batch 2 prefetched")
        _back_to_the_pool(c, put, meta.indexes)
        assert b.get_meta(["x"], 2, task="t", timeout=5, lease_timeout=LONG).indexes == meta.indexes
        next(batches)  # batch 1's ack goes out
        eventually(lambda: _leased(client) == 6, 10, "batch 3 prefetched")
        with pytest.raises(tq.LeaseExpiredError, match="2 of its 2"):  # batch 1's, raised on leaving
            batches.close()
        assert _leased(client) == 2  # B's only: batch 2 nacked, batch 3 withdrawn
        assert client.status()["counters"]["open_leases"] == 1


async def _until_leased(client: tq.AsyncClient, n: int) -> None:
    for _ in range(10_000):  # each status() awaits a round trip, while the stream's flows go on
        if (await client.status())["partitions"]["train"]["tasks"]["t"]["leased"] == n:
            return
    raise AssertionError(f"{n} samples never leased")


async def test_an_async_stream_with_two_late_acks_in_a_row_withdraws_its_prefetched_batch(cluster):
    client = await tq.connect_async(cluster.address)
    put = await client.put(rows(8))
    n = 0
    with cluster.connect() as b, cluster.connect() as c:
        with pytest.raises(tq.LeaseExpiredError, match="2 of its 2"):
            async for _batch, _meta in client.stream(["x"], 2, task="t", timeout=10, lease_timeout=LONG):
                n += 1
                if n == 1:
                    await _until_leased(client, 4)
                    _back_to_the_pool(c, put, put.indexes[:4])
                    assert b.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=LONG).indexes == put.indexes[:4]
                else:
                    await _until_leased(client, 6)
        assert n == 2
        assert _leased(c) == 4
        assert c.status()["counters"]["open_leases"] == 1
    await client.close()


async def test_leaving_an_async_stream_after_a_late_ack_gives_back_both_batches(cluster):
    client = await tq.connect_async(cluster.address)
    put = await client.put(rows(8))
    with cluster.connect() as b, cluster.connect() as c:
        batches = client.stream(["x"], 2, task="t", timeout=10, lease_timeout=LONG)
        _batch, meta = await anext(batches)
        await _until_leased(client, 4)
        _back_to_the_pool(c, put, meta.indexes)
        assert b.get_meta(["x"], 2, task="t", timeout=5, lease_timeout=LONG).indexes == meta.indexes
        await anext(batches)
        await _until_leased(client, 6)
        with pytest.raises(tq.LeaseExpiredError, match="2 of its 2"):
            await batches.aclose()
        assert _leased(c) == 2
        assert c.status()["counters"]["open_leases"] == 1
    await client.close()
