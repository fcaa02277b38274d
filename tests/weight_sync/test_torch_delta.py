"""Deltas over the torch transport (gloo), through real process groups: sparse versions are
broadcast as deltas and land exact (validated) at a fraction of the bytes; a member whose base
is damaged refuses the delta, keeps its version, and the next version comes whole; a version
the pusher skipped makes the next broadcast whole; a dense update goes whole."""

from __future__ import annotations

import threading

import pytest
import torch

from transfer_queue import WeightSyncError
from weight_sync import TorchTransport, WeightPublisher, WeightSubscriber

from .harness import Subscribers, check
from .workers import BUCKET, sparse_weights, weights, zeros


def _exact(tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensors[n], expected[n]) for n in expected)


def _stats(pub: WeightPublisher) -> dict:
    return {s.version: s for s in pub.stats()}


def test_auto_turns_deltas_on_for_gloo():
    with WeightPublisher(None, transport=TorchTransport(world_size=1), delta="auto") as pub:
        assert pub.delta


def test_sparse_versions_are_broadcast_as_deltas_and_land_exact():
    """Two subscriber processes, validating, take versions 1..5: 1 whole, 2..5 as deltas of a
    few percent of the bytes; every apply is exact."""
    pub = WeightPublisher(
        None, transport=TorchTransport(world_size=3), bucket_bytes=BUCKET, delta="auto", validate=True
    )
    subs = Subscribers(2, pub.endpoint, "torch", sparse=True, validate=True)
    try:
        for version in range(1, 6):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = _stats(pub)
        assert stats[1].whole_pulls == 2 and stats[1].delta_pulls == 0, stats[1]
        assert stats[1].sent >= stats[1].staged
        for version in range(2, 6):
            assert stats[version].delta_pulls == 2 and stats[version].whole_pulls == 0, stats[version]
            assert stats[version].sent * 5 < stats[version].requested, stats[version]
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4, 5]
            assert 0 < summary["received"][0] * 5 < stats[5].requested, summary["received"]
            check(summary, 5)
    finally:
        pub.close()


def test_a_member_whose_base_is_damaged_refuses_the_delta_then_gets_the_next_version_whole():
    """Of two members, one has its receive buffers damaged after version 1: it refuses the
    delta for 2 (`WeightSyncError`, tensors exactly 1) while the other applies it; 3 comes
    whole to both and 4 is a delta again."""
    with (
        WeightPublisher(None, transport=TorchTransport(world_size=3), bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport=TorchTransport(), publisher=pub.endpoint) as sub,
    ):
        other = Subscribers(1, pub.endpoint, "torch", sparse=True)
        pub.publish(sparse_weights(1), 1)
        sub.wait(1, timeout=30)
        other.wait_applied(1)
        for buffer in sub._receiver.table.slots:  # fault injection: the memory under the base
            if buffer.segment is not None:
                buffer.mapped.tensor.bitwise_not_()
        pub.publish(sparse_weights(2), 2)
        with pytest.raises(WeightSyncError, match="differs from the publisher's"):
            sub.wait(2, timeout=30)
        assert sub.version == 1 and _exact(mine, sparse_weights(1))
        other.wait_applied(2)
        for version in (3, 4):
            pub.publish(sparse_weights(version), version)
            sub.wait(version, timeout=30)
            assert _exact(mine, sparse_weights(version))
            other.wait_applied(version)
        stats = _stats(pub)
        assert stats[2].delta_pulls == 2, stats[2]
        assert stats[3].whole_pulls == 2 and stats[3].delta_pulls == 0, stats[3]
        assert stats[4].delta_pulls == 2 and stats[4].sent * 5 < stats[4].requested, stats[4]
        (summary,) = other.finish().values()
        assert summary["applied"] == [1, 2, 3, 4]
        check(summary, 4)


def test_a_skipped_version_makes_the_next_broadcast_whole(monkeypatch):
    """The pusher is held on version 2 while 3 and 4 are published: 3 is superseded, so 4
    (compared against 3, which no member got) is broadcast whole; 5 is a delta again."""
    real, held, go = TorchTransport._push, threading.Event(), threading.Event()

    def holding(self, slot, version):  # noqa: ANN001, ANN202 - fault injection: a slow broadcast
        if version == 2:
            held.set()
            go.wait(30)
        real(self, slot, version)

    monkeypatch.setattr(TorchTransport, "_push", holding)
    with (
        WeightPublisher(
            None, transport=TorchTransport(world_size=2), bucket_bytes=BUCKET, delta="auto", slots=3
        ) as pub,
        WeightSubscriber(None, mine := zeros(), transport=TorchTransport(), publisher=pub.endpoint) as sub,
    ):
        pub.publish(sparse_weights(1), 1)
        sub.wait(1, timeout=30)
        pub.publish(sparse_weights(2), 2)
        assert held.wait(30)
        pub.publish(sparse_weights(3), 3)
        pub.publish(sparse_weights(4), 4)
        go.set()
        sub.wait(4, timeout=30)
        assert _exact(mine, sparse_weights(4))
        pub.publish(sparse_weights(5), 5)
        sub.wait(5, timeout=30)
        assert _exact(mine, sparse_weights(5))
        stats = _stats(pub)
        assert stats[2].delta_pulls == 1, stats[2]
        assert stats[3].delta_pulls == stats[3].whole_pulls == 0, stats[3]
        assert stats[4].base == 3 and stats[4].whole_pulls == 1 and stats[4].delta_pulls == 0, stats[4]
        assert stats[5].delta_pulls == 1, stats[5]


def test_a_dense_update_goes_whole():
    """Versions of fresh random weights: every bucket is dense, so each version is broadcast
    whole (no gaps frame), and lands exact."""
    with (
        WeightPublisher(None, transport=TorchTransport(world_size=2), bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport=TorchTransport(), publisher=pub.endpoint) as sub,
    ):
        for version in (1, 2, 3):
            pub.publish(weights(version), version)
            sub.wait(version, timeout=30)
            assert _exact(mine, weights(version))
        for stats in pub.stats():
            assert stats.whole_pulls == 1 and stats.delta_pulls == 0, stats
            assert stats.sent >= stats.staged
