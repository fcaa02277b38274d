"""The ucx transport's own promises, over real processes: it waits for peers without spinning a
core, spreads its subscribers over several UCX workers, and the last transport of a process to
close takes ucxx's threads with it (a new one starts them again)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.helpers import eventually
from transfer_queue import WeightSyncError
from weight_sync import UcxTransport, WeightPublisher, WeightSubscriber
from weight_sync.transports import ucx

from .harness import Subscribers, check, counted
from .workers import BUCKET, sparse_weights, weights, zeros

pytestmark = pytest.mark.skipif(not UcxTransport.is_available(), reason="ucxx is not installed")

UCX_THREADS = {"sluice-ws-ucx", "UCX-Py Async Notifier Thread"}


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_a_publisher_waiting_for_requests_spends_no_cpu():
    """A subscriber holds its endpoint open and sends no request (nothing newer is published):
    the publisher's handler waits on a future, not by polling its receive (ucxx's default, a
    busy core for as long as any subscriber stays connected)."""
    pub = WeightPublisher(None, transport="ucx", bucket_bytes=BUCKET)
    subs = Subscribers(1, pub.endpoint, "ucx")
    try:
        pub.publish(weights(1), 1)
        subs.wait_applied(1)
        cpu, wall = time.process_time(), time.monotonic()
        threading.Event().wait(1.0)  # the window whose CPU time is measured, not a wait for state
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert cpu < 0.2 * wall, f"the publisher's process used {cpu:.2f} s of CPU in {wall:.2f} s idle"
        (summary,) = subs.finish().values()
        check(summary, 1)
    finally:
        pub.close()


def test_two_subscribers_pull_identical_exact_weights_through_different_workers():
    """The second subscriber is moved to another worker's listener (one per core here, at most
    `MAX_WORKERS`); both take every version exact and in place."""
    served = UcxTransport()
    pub = WeightPublisher(None, transport=served, bucket_bytes=BUCKET)
    subs = Subscribers(2, pub.endpoint, "ucx")
    try:
        for version in (1, 2, 3):
            pub.publish(weights(version), version)
            subs.wait_applied(version)
        assert len(served._listeners) == min(2, ucx._runtime.workers), "a listener per worker serving"
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()


def test_sparse_versions_cross_ucx_as_deltas_and_land_exact():
    """Two validating subscribers take versions 1..4 over ucx: 1 whole, 2..4 as delta frames
    of a few percent of the bytes, received a message at a time; every apply is exact."""
    pub = WeightPublisher(None, transport="ucx", bucket_bytes=BUCKET, delta="auto", validate=True)
    subs = Subscribers(2, pub.endpoint, "ucx", sparse=True, validate=True)
    try:
        for version in range(1, 5):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = counted(pub, 4, 2)
        for version in (2, 3, 4):
            assert stats[version].delta_pulls == 2 and stats[version].whole_pulls == 0, stats[version]
            assert stats[version].sent * 5 < stats[version].requested, stats[version]
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4]
            assert 0 < summary["received"][0] * 5 < stats[4].requested / 2, summary["received"]
            check(summary, 4)
    finally:
        pub.close()


def test_a_ucx_delta_on_a_damaged_base_is_refused_then_the_whole_version_lands():
    """The subscriber's receive buffer (its base) is damaged after version 1: the delta for 2
    is refused (`WeightSyncError`; the endpoint is dropped, whatever of the stream was left),
    the tensors stay exactly 1, and 2 then comes whole over a new endpoint."""
    expected = {v: sparse_weights(v) for v in (1, 2)}
    with (
        WeightPublisher(None, transport="ucx", bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport="ucx", publisher=pub.endpoint) as sub,
    ):
        pub.publish(expected[1], 1)
        sub.wait(1)
        (buffer,) = sub._receiver.table.slots  # fault injection: the memory under the base
        buffer.mapped.tensor.bitwise_not_()
        pub.publish(expected[2], 2)
        with pytest.raises(WeightSyncError, match="differs from the publisher's"):
            sub.wait(2, timeout=30)
        assert sub.version == 1 and all(torch.equal(mine[n], expected[1][n]) for n in mine)
        sub.wait(2, timeout=30)
        assert all(torch.equal(mine[n], expected[2][n]) for n in mine)
        stats = counted(pub, 2, 2)[2]
        assert stats.delta_pulls == 1 and stats.whole_pulls == 1, stats


def test_the_last_transport_to_close_ends_the_ucx_threads_and_a_new_one_restarts_them():
    for version in (1, 2):  # the second round runs on a freshly initialised ucxx
        pub = WeightPublisher(None, transport="ucx", bucket_bytes=BUCKET)
        subs = Subscribers(1, pub.endpoint, "ucx")
        try:
            pub.publish(weights(version), version)
            subs.wait_applied(version)
            assert _threads() >= UCX_THREADS
            (summary,) = subs.finish().values()
            check(summary, version)
        finally:
            pub.close()
        eventually(lambda: not UCX_THREADS & _threads(), 10, "ucx threads gone")
