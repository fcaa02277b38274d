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
