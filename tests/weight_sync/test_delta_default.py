"""The default `delta="auto"` over real processes and sockets: a publisher whose subscribers all
map its staging (shm) never compares a version and starts no compare or encode thread; the
first lease a subscriber takes over tcp turns deltas on, the next versions cross as deltas,
exact (validated); `delta=False`, or one slot, stays off with a tcp subscriber."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import weight_sync.publisher as publisher_module
from weight_sync import WeightPublisher

from .harness import Subscribers, check, counted
from .workers import BUCKET, sparse_weights


def _delta_threads() -> list[str]:
    """The publisher's compare and encode threads alive in this process."""
    return [t.name for t in threading.enumerate() if t.name.startswith(("sluice-ws-compare", "sluice-ws-encode"))]


@pytest.fixture
def compares(monkeypatch) -> list[int]:  # noqa: ANN001
    """Every bucket compare the publishers of this process run, as they run (three threads
    each: an encode pool is built too, so its threads would show)."""
    monkeypatch.setenv("SLUICE_DELTA_THREADS", "3")
    seen: list[int] = []
    real = publisher_module.compare

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(publisher_module, "compare", counting)
    return seen


def test_the_default_never_compares_for_subscribers_over_shm(compares):
    """A default publisher (shm, ucx and tcp served) with two shm subscribers, validating:
    versions 1..4 land exact, none is compared (whole versions in its stats) and no compare
    or encode thread is started."""
    pub = WeightPublisher(None, bucket_bytes=BUCKET, validate=True)
    subs = Subscribers(2, pub.endpoint, "shm", sparse=True, validate=True)
    try:
        for version in range(1, 5):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        assert not pub.delta
        assert [(s.version, s.base, s.compared_on) for s in pub.stats()] == [(v, -1, "") for v in range(1, 5)]
        assert all(s.delta_pulls == 0 for s in pub.stats())
        assert compares == [] and _delta_threads() == []
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4]
            check(summary, 4)
    finally:
        pub.close()


def test_the_default_turns_deltas_on_at_a_tcp_lease(compares, caplog):
    """A default publisher stages versions 1 and 2 with no subscriber: whole, nothing compared,
    no delta thread. A tcp subscriber (validating) then leases 2, which turns deltas on, once
    for all the leases after it: 3..5 are compared with the version before and cross as
    deltas, every apply exact."""
    caplog.set_level(logging.INFO, logger="sluice.weight_sync")
    pub = WeightPublisher(None, bucket_bytes=BUCKET, validate=True)
    try:
        for version in (1, 2):
            pub.publish(sparse_weights(version), version)
        assert not pub.delta and compares == [] and _delta_threads() == []
        subs = Subscribers(1, pub.endpoint, "tcp", sparse=True, validate=True)
        subs.wait_applied(2)
        assert pub.delta
        for version in (3, 4, 5):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = counted(pub, 5, 1)
        for version in (1, 2):
            assert stats[version].base == -1 and stats[version].delta_pulls == 0, stats[version]
        assert stats[2].whole_pulls == 1, stats[2]
        for version in (3, 4, 5):
            assert stats[version].base == version - 1, stats[version]
            assert stats[version].delta_pulls == 1 and stats[version].whole_pulls == 0, stats[version]
            assert stats[version].sent * 5 < stats[version].requested, stats[version]
            assert stats[version].compared_on == "cpu"
        assert compares
        assert sum("comparing versions" in r.getMessage() for r in caplog.records) == 1
        (summary,) = subs.finish().values()
        assert summary["applied"] == [2, 3, 4, 5]
        check(summary, 5)
    finally:
        pub.close()


@pytest.mark.parametrize("off", [{"delta": False}, {"slots": 1}], ids=["delta_false", "one_slot"])
def test_deltas_stay_off_with_a_tcp_subscriber(compares, off):
    """`delta=False`, or the default with one slot (no base to compare with): a tcp
    subscriber's leases turn nothing on; versions 1..3 land whole and exact, none compared, no
    delta thread started."""
    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, validate=True, **off)
    subs = Subscribers(1, pub.endpoint, "tcp", sparse=True, validate=True)
    try:
        for version in (1, 2, 3):
            pub.publish(sparse_weights(version), version)
            subs.wait_applied(version)
        stats = counted(pub, 3, 1)
        assert not pub.delta and compares == [] and _delta_threads() == []
        for version in (1, 2, 3):
            assert stats[version].base == -1 and stats[version].delta_pulls == 0, stats[version]
            assert stats[version].whole_pulls == 1, stats[version]
        (summary,) = subs.finish().values()
        assert summary["applied"] == [1, 2, 3]
        check(summary, 3)
    finally:
        pub.close()


@pytest.mark.cuda
def test_the_default_packs_cuda_weights_on_the_gpu_only_once_deltas_are_on():
    """CUDA weights, a default publisher: while its only subscriber reads over shm, versions 1
    and 2 take no GPU memory for packed copies. A tcp subscriber's lease turns deltas on:
    version 3 goes whole (its base was not packed on the GPU), 4 and 5 are compared on the
    GPU and cross as deltas; every apply is exact (validated)."""
    live = {n: t.cuda() for n, t in sparse_weights(0).items()}
    nbytes = sum(t.numel() * t.element_size() for t in live.values())
    pub = WeightPublisher(None, bucket_bytes=BUCKET, validate=True, model=live)
    near = Subscribers(1, pub.endpoint, "shm", sparse=True, validate=True)
    try:
        before = torch.cuda.memory_allocated()
        for version in (1, 2):
            for name, t in sparse_weights(version).items():
                live[name].copy_(t)
            pub.publish(live, version)
            near.wait_applied(version)
        assert not pub.delta and torch.cuda.memory_allocated() - before < nbytes
        far = Subscribers(1, pub.endpoint, "tcp", sparse=True, validate=True, first_id=1)
        far.wait_applied(2)
        for version in (3, 4, 5):
            for name, t in sparse_weights(version).items():
                live[name].copy_(t)
            pub.publish(live, version)
            near.wait_applied(version)
            far.wait_applied(version)
        stats = counted(pub, 5, 1)
        assert stats[3].base == -1 and stats[3].delta_pulls == 0, stats[3]
        for version in (4, 5):
            assert stats[version].compared_on.startswith("cuda"), stats[version]
            assert stats[version].delta_pulls == 1 and stats[version].sent * 5 < stats[version].requested
        for summary in [*near.finish().values(), *far.finish().values()]:
            check(summary, 5)
    finally:
        pub.close()
