"""The version clock and version events over a real cluster; version spans of partial rollouts."""

from __future__ import annotations

import asyncio
import threading

import pytest

import transfer_queue as tq
from tests.helpers import eventually, rows

SEQUENCE = [1, 2, 3, 5, 8, 9, 10, 20, 21, 22]
"""Versions a trainer sets in the tests, with jumps (a version may skip numbers)."""


def test_set_version_is_monotone_and_refuses_to_go_backwards(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as client:
        assert client.version == 0
        assert client.set_version(3) == 3
        assert client.set_version(3) == 3  # the current version again: a no-op
        with pytest.raises(tq.VersionError, match="older"):
            client.set_version(2)
        assert client.get_version() == 3


def test_wait_version_returns_at_once_when_reached_and_otherwise_waits_for_it(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as worker, cluster.connect() as trainer:
        trainer.set_version(2)
        assert worker.wait_version(1, timeout=5) == 2
        assert worker.wait_version(2, timeout=5) == 2
        with pytest.raises(tq.TimeoutError):
            worker.wait_version(3, timeout=0.2)
        got: dict[str, int] = {}
        thread = threading.Thread(target=lambda: got.setdefault("v", worker.wait_version(4, timeout=30)))
        thread.start()
        trainer.set_version(3)  # not enough
        trainer.set_version(5)  # jumps past 4
        thread.join(30)
        assert got == {"v": 5}


def test_sync_versions_iterator_yields_every_version_in_order(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as worker, cluster.connect() as trainer:
        events = worker.versions(timeout=30)  # "from now on" starts here, not at the first next()
        trainer.set_version(SEQUENCE[0])
        trainer.set_version(SEQUENCE[1])
        seen: list[int] = []

        def read() -> None:
            for version in events:
                seen.append(version)
                if len(seen) == len(SEQUENCE):
                    return

        reader = threading.Thread(target=read)
        reader.start()
        for version in SEQUENCE[2:]:
            trainer.set_version(version)
        reader.join(30)
        assert seen == SEQUENCE


def test_versions_iterator_resumes_after_a_known_version(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as client:
        for version in (1, 2, 4, 7):
            client.set_version(version)
        events = client.versions(after=2, timeout=5)
        assert [next(events) for _ in range(2)] == [4, 7]
        with pytest.raises(tq.TimeoutError):
            next(client.versions(timeout=0.2))  # nothing newer than 7


def test_every_listener_gets_every_version(make_cluster):
    cluster = make_cluster()
    listeners = [cluster.connect() for _ in range(3)]
    iterators = [c.versions(timeout=30) for c in listeners]
    seen: list[list[int]] = [[] for _ in listeners]

    def read(k: int) -> None:
        for version in iterators[k]:
            seen[k].append(version)
            if len(seen[k]) == len(SEQUENCE):
                return

    threads = [threading.Thread(target=read, args=(k,)) for k in range(len(listeners))]
    for t in threads:
        t.start()
    with cluster.connect() as trainer:
        for version in SEQUENCE:
            trainer.set_version(version)
    for t in threads:
        t.join(30)
    for c in listeners:
        c.close()
    assert seen == [SEQUENCE] * len(listeners)


def test_async_versions_iterator_yields_every_version_in_order(make_cluster):
    cluster = make_cluster()

    async def scenario() -> tuple[list[int], int]:
        worker = await tq.connect_async(cluster.address)
        trainer = await tq.connect_async(cluster.address)
        try:
            start = await worker.get_version()
            seen: list[int] = []

            async def follow() -> None:
                async for version in worker.versions(after=start, timeout=30):
                    seen.append(version)
                    if len(seen) == len(SEQUENCE):
                        return

            task = asyncio.ensure_future(follow())
            for version in SEQUENCE:
                await trainer.set_version(version)
                await asyncio.sleep(0)  # interleave with the follower sometimes
            await asyncio.wait_for(task, 30)
            waited = await worker.wait_version(SEQUENCE[-1], timeout=5)
            return seen, waited
        finally:
            await worker.close()
            await trainer.close()

    seen, waited = asyncio.run(scenario())
    assert seen == SEQUENCE
    assert waited == SEQUENCE[-1]


def test_a_rollout_worker_pauses_swaps_and_resumes_on_a_version_event(make_cluster):
    """The partial-rollout hook: generate under v, wait for v+1, finish under it, record the span."""
    cluster = make_cluster(max_staleness=2, consumer_batch_size=4)
    with cluster.connect() as worker, cluster.connect() as trainer:
        result: dict[str, tq.BatchMeta] = {}

        def rollout() -> None:
            with worker.acquire(4, timeout=10) as grant:
                swapped_to = worker.wait_version(grant.version + 1, timeout=30)  # pause here
                result["meta"] = worker.put(rows(4), policy_version=(grant.version, swapped_to))

        thread = threading.Thread(target=rollout)
        thread.start()
        eventually(lambda: trainer.status()["admission"]["running"] == 4)  # generating under version 0
        trainer.set_version(1)
        thread.join(30)
        assert result["meta"].version_spans == [(0, 1)] * 4
        got = trainer.get_meta(["x"], 4, task="train", timeout=10)
        assert got.version_spans == [(0, 1)] * 4
        assert trainer.status()["staleness"]["histogram"] == {"1": 4}  # measured from version 0


def test_a_version_span_is_recorded_and_staleness_counts_from_its_oldest_version(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as client:
        old = client.put(rows(2), policy_version=(1, 3))
        fresh = client.put(rows(3, 10), policy_version=(2, 3))
        assert old.policy_versions == [1, 1] and old.version_last == [3, 3]
        assert old.version_spans == [(1, 3), (1, 3)]
        per_sample = client.put(rows(2, 20), policy_version=[3, 2])
        assert per_sample.version_spans == [(3, 3), (2, 2)]
        with pytest.raises(tq.SchemaError, match="first <= last"):
            client.put(rows(1, 30), policy_version=(3, 1))
        client.set_version(3)
        meta = client.get_meta(["x"], 7, task="train", timeout=0.5, allow_partial=True)
        # (1, 3) is 2 versions old by its oldest version: never served with η = 1, though its last is 3
        assert sorted(meta.indexes) == sorted(fresh.indexes + per_sample.indexes)
        spans = dict(zip(meta.indexes, meta.version_spans))
        assert all(spans[i] == (2, 3) for i in fresh.indexes)
        status = client.status()
        assert status["staleness"]["dropped"] == 2
        assert status["staleness"]["histogram"] == {"0": 1, "1": 4}
