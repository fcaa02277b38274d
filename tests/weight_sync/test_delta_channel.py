"""Delta pulls over real processes and sockets (tcp): sparse versions cross as deltas and land
exact (validated); a subscriber that missed versions, or whose base the publisher evicted, gets
the whole version; a publisher killed mid-delta, a corrupt delta frame and a subscriber whose
copy of the base differs each end in a `WeightSyncError` with the tensors on their previous
version, then a correct version, and never a torn apply."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import weight_sync.publisher as publisher_module
import weight_sync.transports.base as job_module  # where a Job applies its delta stream
import weight_sync.transports.stream as stream_module
from tests.helpers import eventually
from transfer_queue import SchemaError, WeightSyncError
from weight_sync import LLAMA, TPShard, WeightPublisher, WeightSubscriber
from weight_sync.transports.tcp import TcpTransport

from .harness import Subscribers, check, counted, publisher_killed_mid_version
from .workers import BUCKET, local_targets, sparse_weights, weights, zeros


def _exact(tensors: dict[str, torch.Tensor], version: int) -> bool:
    expected = sparse_weights(version)
    return all(torch.equal(tensors[n], expected[n]) for n in expected)


def test_sparse_versions_cross_as_deltas_and_land_exact():
    """Two subscribers, validating, take versions 1..5: 1 whole, 2..5 as deltas of a few
    percent of the bytes; every apply is exact."""
    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto", validate=True)
    subs = Subscribers(2, pub.endpoint, "tcp", sparse=True, validate=True)
    try:
        for version in range(1, 6):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = counted(pub, 5, 2)
        assert stats[1].whole_pulls == 2 and stats[1].delta_pulls == 0
        for version in range(2, 6):
            assert stats[version].delta_pulls == 2 and stats[version].whole_pulls == 0, stats[version]
            assert stats[version].sent * 5 < stats[version].requested, stats[version]
            assert 0 < stats[version].density < 0.1
            assert stats[version].compared_on == "cpu"
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4, 5]
            check(summary, 5)
    finally:
        pub.close()


def test_a_tensor_parallel_subscriber_takes_deltas_exact():
    """TP rank 1 of 2 with the Llama mapping (fused qkv and gate_up; row-parallel slices are
    strided in the trainer's tensors, so they cross as WHOLE frames inside the delta stream)
    takes versions 2..4 as deltas, each exact and validated."""
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto", validate=True) as pub,
        WeightSubscriber(
            None,
            mine := local_targets(1, 2),
            transport="tcp",
            publisher=pub.endpoint,
            shard=TPShard(1, 2),
            mapping=LLAMA,
            validate=True,
        ) as sub,
    ):
        for version in (1, 2, 3, 4):
            pub.publish(sparse_weights(version), version)
            sub.wait(version)
            expected = local_targets(1, 2, version, sparse_weights)
            assert all(torch.equal(mine[n].view(torch.int16), expected[n].view(torch.int16)) for n in expected)
        stats = counted(pub, 4, 1)
    for version in (2, 3, 4):
        assert stats[version].delta_pulls == 1 and stats[version].sent * 3 < stats[version].requested, stats[version]


def test_relays_forward_deltas_down_a_chain():
    """fanout 1: the first subscriber pulls deltas from the rank, the second from the first and
    the third from the second, each relay forwarding the frames it received; only the first
    pulls from the trainer, every stream carries a fifth of the bytes or less, and every apply
    is exact (validated)."""
    pub = WeightPublisher(None, transport=TcpTransport(fanout=1), bucket_bytes=BUCKET, delta="auto", validate=True)
    subs = Subscribers(3, pub.endpoint, "tcp", sparse=True, validate=True)
    try:
        for version in range(1, 5):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = counted(pub, 4, 1)
        for version in (2, 3, 4):
            assert stats[version].delta_pulls == 1 and stats[version].whole_pulls == 0, stats[version]
        summaries = subs.finish().values()
        sources = sorted(s["sources"][0] for s in summaries)
        assert sources[0] == "" and all(source.startswith("127.0.0.1:") for source in sources[1:]), sources
        for summary in summaries:
            assert summary["applied"] == [1, 2, 3, 4]
            assert 0 < summary["received"][0] * 5 < stats[4].requested, (summary["received"], stats[4])
            check(summary, 4)
    finally:
        pub.close()


def test_a_subscriber_that_missed_versions_gets_the_whole_version():
    """The subscriber is stopped while versions 2..4 are published: the publisher no longer
    holds its base (1), so 4 comes whole; 5 is a delta again."""
    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto")
    subs = Subscribers(1, pub.endpoint, "tcp", sparse=True)
    (proc,) = subs.procs
    try:
        pub.publish(sparse_weights(1), 1)
        subs.wait_applied(1)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            for version in (2, 3, 4):
                pub.publish(sparse_weights(version), version)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        subs.wait_applied(4)
        pub.publish(sparse_weights(5), 5)
        subs.wait_applied(5)
        stats = counted(pub, 5, 1)
        assert stats[4].whole_pulls >= 1 and stats[4].delta_pulls == 0, stats[4]
        assert stats[5].delta_pulls == 1 and stats[5].whole_pulls == 0, stats[5]
        (summary,) = subs.finish().values()
        check(summary, 5)
    finally:
        pub.close()


def test_publisher_killed_mid_delta_leaves_the_previous_version():
    """The trainer dies while version 2, a delta against 1, is half staged and half sent."""
    publisher_killed_mid_version("tcp", {"bucket_bytes": BUCKET, "sparse": True, "delta": "auto"}, "tcp", sparse=True)


def test_a_subscriber_whose_base_differs_refuses_the_delta_then_takes_the_whole_version():
    """Its receive buffer (the base of its next delta) is damaged after version 1: the delta
    for 2 is refused (`WeightSyncError`), the tensors stay exactly 1, and 2 then comes whole."""
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport="tcp", publisher=pub.endpoint) as sub,
    ):
        pub.publish(sparse_weights(1), 1)
        sub.wait(1)
        (buffer,) = sub._receiver.table.slots  # fault injection: the memory under the base
        buffer.mapped.tensor.bitwise_not_()
        pub.publish(sparse_weights(2), 2)
        with pytest.raises(WeightSyncError, match="differs from the publisher's"):
            sub.wait(2, timeout=30)
        assert sub.version == 1 and _exact(mine, 1)
        sub.wait(2, timeout=30)
        assert _exact(mine, 2)
        stats = counted(pub, 2, 2)[2]
        assert stats.delta_pulls == 1 and stats.whole_pulls == 1


def test_a_delta_corrupted_in_transit_is_refused_then_the_whole_version_lands(monkeypatch):
    """One payload byte of the first delta frame flips on the way (a faulty NIC or relay)."""
    real = job_module.receive_frames
    flipped = []

    def flipping(recv, *rest):  # noqa: ANN001, ANN002, ANN202
        def corrupting(view: memoryview) -> None:
            recv(view)
            if len(view) > 64 and not flipped:  # a payload, not a header
                view[len(view) - 1] ^= 0x01
                flipped.append(len(view))

        return real(corrupting, *rest)

    monkeypatch.setattr(job_module, "receive_frames", flipping)
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport="tcp", publisher=pub.endpoint) as sub,
    ):
        pub.publish(sparse_weights(1), 1)
        sub.wait(1)
        pub.publish(sparse_weights(2), 2)
        with pytest.raises(WeightSyncError, match="corrupt"):
            sub.wait(2, timeout=30)
        assert flipped and sub.version == 1 and _exact(mine, 1)
        sub.wait(2, timeout=30)
        assert _exact(mine, 2)


def test_deltas_compared_encoded_and_applied_on_pools_land_exact(monkeypatch):
    """Three threads compare, encode and apply (every frame through the pools): versions
    2..4 cross as deltas, exact; version 5's third payload flips on the way: refused, the
    tensors stay on version 4, then version 5 lands whole; closing leaves no delta thread."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", "3")
    monkeypatch.setattr(stream_module, "_INLINE", 0)
    seen = _passes_seen(monkeypatch)
    real = job_module.receive_frames
    payloads = []

    def flipping(recv, *rest):  # noqa: ANN001, ANN002, ANN202
        def corrupting(view: memoryview) -> None:
            recv(view)
            if len(view) > 64 and flip:  # a payload, not a header
                payloads.append(len(view))
                if len(payloads) == 3:
                    view[0] ^= 0x01

        return real(corrupting, *rest)

    monkeypatch.setattr(job_module, "receive_frames", flipping)
    flip = False
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto", validate=True) as pub,
        WeightSubscriber(None, mine := zeros(), transport="tcp", publisher=pub.endpoint, validate=True) as sub,
    ):
        for version in (1, 2, 3, 4):
            pub.publish(sparse_weights(version), version)
            sub.wait(version, timeout=30)
            assert _exact(mine, version)
        flip = True
        pub.publish(sparse_weights(5), 5)
        with pytest.raises(WeightSyncError, match="corrupt"):
            sub.wait(5, timeout=30)
        assert len(payloads) >= 3 and sub.version == 4 and _exact(mine, 4)
        sub.wait(5, timeout=30)
        assert _exact(mine, 5)
        stats = counted(pub, 5, 1)
        assert all(stats[v].delta_pulls == 1 for v in (2, 3, 4)), stats
    left = [t.name for t in threading.enumerate() if t.name.startswith(("sluice-ws-compare", "sluice-ws-encode"))]
    assert not left and not [t for t in threading.enumerate() if t.name.startswith("sluice-ws-apply")]
    assert all(any(name.startswith(f"sluice-ws-{kind}") for name in seen[kind]) for kind in seen), seen


def test_a_relay_forwards_deltas_applied_on_pools_in_order(monkeypatch):
    """fanout 1, both subscribers in this process with three-thread pools and every frame
    applied on them: the first pulls deltas from the rank, the second from the first, which
    forwards the frames as its applies end; both land every version exactly (validated), and
    only the first pulls from the trainer."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", "3")
    monkeypatch.setattr(stream_module, "_INLINE", 0)
    with (
        WeightPublisher(
            None, transport=TcpTransport(fanout=1), bucket_bytes=BUCKET, delta="auto", validate=True
        ) as pub,
        WeightSubscriber(None, first := zeros(), transport="tcp", publisher=pub.endpoint, validate=True) as near,
        WeightSubscriber(None, second := zeros(), transport="tcp", publisher=pub.endpoint, validate=True) as far,
    ):
        for version in (1, 2, 3, 4):
            pub.publish(sparse_weights(version), version)
            near.wait(version, timeout=30)
            far.wait(version, timeout=30)
            assert _exact(first, version) and _exact(second, version)
        stats = counted(pub, 4, 1)
        for version in (2, 3, 4):
            assert stats[version].delta_pulls == 1 and stats[version].whole_pulls == 0, stats[version]
        assert all(0 < sub.last_received[0] * 5 < stats[4].requested for sub in (near, far))


@pytest.mark.parametrize("threads", ["1", "4"])
def test_dense_updates_stop_the_compare_until_the_next_probe(monkeypatch, threads):
    """Versions that change most bytes go whole: in a probed version, its first two buckets
    found dense end the compares (the rest go whole); after it the next seven versions are not
    compared (nobody waits for a compare), the eighth is probed again. With four compare
    threads too: the buckets past the first two wait for them, so no more are compared."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", threads)
    compared = []
    real = publisher_module.compare
    monkeypatch.setattr(publisher_module, "compare", lambda *a, **k: compared.append(1) or real(*a, **k))
    # staging made up front: without the model, version 2 may find only version 1's slot ready
    # delta=True: with no subscriber, "auto" would never turn on
    with WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=True, model=weights(0)) as pub:
        for version in range(1, 11):
            pub.publish(weights(version), version)
        # version 10's compares have run (close would cancel them)
        eventually(lambda: [s for s in pub.stats() if s.version == 10 and s.compared_on], 60, "version 10 compared")
        bases = {s.version: s.base for s in pub.stats()}
    assert bases == {1: -1, 2: 1, **{v: -1 for v in range(3, 10)}, 10: 9}
    assert len(compared) == 2 * 2, "two compares in each of the two probed versions"


def _passes_seen(monkeypatch) -> dict[str, set[str]]:  # noqa: ANN001
    """The names of the threads that compare buckets, encode frames and apply them, as they run."""
    seen: dict[str, set[str]] = {"compare": set(), "encode": set(), "apply": set()}

    def noting(kind: str, real):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen[kind].add(threading.current_thread().name)
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(publisher_module, "compare", noting("compare", publisher_module.compare))
    monkeypatch.setattr(stream_module, "encode_span", noting("encode", stream_module.encode_span))
    monkeypatch.setattr(stream_module, "apply", noting("apply", stream_module.apply))
    return seen


def test_a_stream_broken_off_by_any_error_is_not_read_as_the_next_reply(monkeypatch):
    """Something other than a `WeightSyncError` (an apply thread that could not start, say)
    breaks off version 2's delta stream after its first frame: the tcp connection, whose unread
    frames would be taken for the retry's reply, is dropped; the pull fails with
    `WeightSyncError`, the tensors stay on version 1, and the retry lands version 2 exact."""
    real = job_module.receive_frames
    broken = []

    def breaking(recv, *rest):  # noqa: ANN001, ANN002, ANN202
        def failing(view: memoryview) -> None:
            if len(view) > 64 and not broken:  # the first payload
                broken.append(len(view))
                raise RuntimeError("can't start new thread")
            recv(view)

        return real(failing, *rest)

    monkeypatch.setattr(job_module, "receive_frames", breaking)
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto") as pub,
        WeightSubscriber(None, mine := zeros(), transport="tcp", publisher=pub.endpoint) as sub,
    ):
        pub.publish(weights(1), 1)
        sub.wait(1, timeout=30)
        pub.publish(weights(2), 2)  # dense: its delta stream is WHOLE frames, bucket after bucket
        with pytest.raises(WeightSyncError, match="can't start new thread"):
            sub.wait(2, timeout=30)
        assert broken and sub.version == 1
        sub.wait(2, timeout=30)
        expected = weights(2)
        assert all(torch.equal(mine[n], expected[n]) for n in expected)


def test_a_bad_thread_count_fails_the_construction_with_deltas_on_only(monkeypatch):
    """A malformed `SLUICE_DELTA_THREADS` is a `SchemaError` when a publisher whose deltas are
    on or may turn on ("auto" over tcp, before any lease) or a subscriber whose transport takes
    deltas is built, not at its first pull; without deltas (False, or "auto" serving only shm)
    it is not read."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", "abc")
    with pytest.raises(SchemaError, match="SLUICE_DELTA_THREADS"):
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta="auto")
    with pytest.raises(SchemaError, match="SLUICE_DELTA_THREADS"):
        WeightSubscriber(None, zeros(), transport="tcp", publisher="127.0.0.1:1")
    with WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=False) as pub:
        assert not pub.delta
    with WeightPublisher(None, transport="shm", bucket_bytes=BUCKET) as pub:
        assert not pub.delta
