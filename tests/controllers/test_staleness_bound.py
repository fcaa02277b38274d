"""The staleness bound as an invariant: producer processes under random timing, a trainer that
bumps versions at random moments, and no consumed sample ever staler than η."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transfer_queue as tq
from tests.helpers import rows

BATCH = 4
GRANTED_QUOTA = 24
"""Samples each granted producer makes."""
FREE_QUOTA = 12
"""Samples the producer without grants makes, with versions picked to be stale now and then."""


# -- producers (run in spawned processes) ------------------------------------------------


def _granted_producer(address: str, seed: int, quota: int, delay: float, spans: bool) -> int:
    """Acquire slots, "generate" for a random while, put under the grant; sometimes the rollout
    is resumed under newer weights and records its span."""
    rng = random.Random(seed)
    made = 0
    with tq.connect(address) as client:
        while made < quota:
            n = min(rng.randint(1, BATCH), quota - made)
            with client.acquire(n, timeout=60) as grant:
                time.sleep(rng.random() * delay)
                version: int | tuple[int, int] = grant.version
                if spans and rng.random() < 0.5:
                    version = (grant.version, max(grant.version, client.get_version()))
                client.put(rows(n, seed * 1000 + made), partition="p", policy_version=version, grant=grant)
            made += n
    return made


def _free_producer(address: str, seed: int, quota: int, eta: int, delay: float) -> int:
    """Put without admission: first a pair already η + 1 versions stale (the trainer must never
    see it), then pairs claiming versions up to η + 2 behind the trainer."""
    rng = random.Random(seed)
    with tq.connect(address) as client:
        client.wait_version(eta + 1, timeout=60)
        client.put(rows(2, seed * 1000), partition="p", policy_version=client.get_version() - eta - 1)
        made = 2
        while made < quota:
            n = min(2, quota - made)
            version = max(0, client.get_version() - rng.randint(0, eta + 2))
            client.put(rows(n, seed * 1000 + made), partition="p", policy_version=version)
            made += n
            time.sleep(rng.random() * delay)
    return made


@pytest.fixture(scope="module")
def pool() -> Iterator[mp.pool.Pool]:
    """Producer processes (spawned once per module: importing torch is the slow part)."""
    with mp.get_context("spawn").Pool(3) as p:
        yield p


# -- the invariant ------------------------------------------------------------------------


def _run_bounded(pool, eta: int, delay: float, trainer_delay: float, bump_p: float, spans: bool, seed: int) -> None:
    rng = random.Random(seed)
    with tq.init(
        num_storage_units=1, storage_capacity="64MiB", max_staleness=eta, consumer_batch_size=BATCH
    ) as cluster:
        jobs = [
            pool.apply_async(_granted_producer, (cluster.address, seed + 1, GRANTED_QUOTA, delay, spans)),
            pool.apply_async(_granted_producer, (cluster.address, seed + 2, GRANTED_QUOTA, delay, spans)),
            pool.apply_async(_free_producer, (cluster.address, seed + 3, FREE_QUOTA, eta, delay)),
        ]
        sealed = threading.Event()

        def seal_when_done() -> None:
            try:
                for job in jobs:
                    job.wait(120)
            finally:
                with cluster.connect() as c:
                    c.seal("p")
                sealed.set()

        sealer = threading.Thread(target=seal_when_done)
        sealer.start()
        version, since_bump = 0, 0
        consumed: list[int] = []
        with cluster.connect() as trainer:
            while True:
                was_sealed = sealed.is_set()  # every sample was committed before the seal
                meta = trainer.get_meta(["x"], BATCH, task="train", partition="p", timeout=0.3, allow_partial=True)
                if not len(meta) and was_sealed:
                    break
                if len(meta):
                    staleness = [version - v for v in meta.policy_versions]
                    assert max(staleness) <= eta, (version, meta.version_spans)
                    assert all(last >= first for first, last in meta.version_spans)
                    consumed.extend(meta.indexes)
                    since_bump += len(meta)
                    time.sleep(rng.random() * trainer_delay)
                    trainer.ack(meta)
                if since_bump >= BATCH or not len(meta) or rng.random() < bump_p:
                    version += 2 if rng.random() < 0.2 else 1
                    trainer.set_version(version)
                    since_bump = 0
            sealer.join(30)
            made = [job.get(30) for job in jobs]
            status = trainer.status()
    assert made == [GRANTED_QUOTA, GRANTED_QUOTA, FREE_QUOTA]
    assert len(consumed) == len(set(consumed))  # each sample once
    stale = status["staleness"]
    assert len(consumed) + stale["dropped"] == sum(made)  # consumed or dropped (counted), nothing lost
    assert stale["dropped"] >= 2  # at least the pair put η + 1 versions stale
    assert max(int(k) for k in stale["histogram"]) <= eta
    assert sum(stale["histogram"].values()) == len(consumed)
    assert status["admission"]["running"] == 0 and status["admission"]["open_grants"] == 0


_timings = dict(
    delay=st.floats(0.001, 0.03),
    trainer_delay=st.floats(0.0, 0.03),
    bump_p=st.floats(0.05, 0.6),
    spans=st.booleans(),
    seed=st.integers(0, 2**16),
)


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_timings)
def test_no_consumed_sample_is_ever_staler_than_eta(pool, eta, delay, trainer_delay, bump_p, spans, seed):
    _run_bounded(pool, eta, delay, trainer_delay, bump_p, spans, seed)


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**_timings)
def test_no_consumed_sample_is_ever_staler_than_eta_many_timings(pool, eta, delay, trainer_delay, bump_p, spans, seed):
    _run_bounded(pool, eta, delay, trainer_delay, bump_p, spans, seed)


# -- η = 0 is synchronous on-policy RL ----------------------------------------------------


def test_eta_zero_is_synchronous_on_policy_training(make_cluster):
    steps, per_grant = 6, 2
    cluster = make_cluster(max_staleness=0, consumer_batch_size=BATCH)
    errors: list[BaseException] = []
    grant_versions: list[int] = []

    def producer(k: int) -> None:
        try:
            with cluster.connect() as client:
                for i in range(steps * BATCH // per_grant // 2):
                    with client.acquire(per_grant, timeout=60) as grant:
                        grant_versions.append(grant.version)
                        client.put(rows(per_grant, 1000 * k + per_grant * i), policy_version=grant.version)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    per_step = []
    with cluster.connect() as trainer:
        for version in range(steps):
            meta = trainer.get_meta(["x"], BATCH, task="train", timeout=60)
            adm = trainer.status()["admission"]
            # every sample of the step was generated by the current weights, and nobody runs ahead
            per_step.append((sorted(set(meta.policy_versions)), adm["accepted"], adm["running"], adm["budget"]))
            trainer.ack(meta)
            trainer.set_version(version + 1)
        for t in threads:
            t.join(30)
        status = trainer.status()
    assert not errors
    assert per_step == [([v], BATCH * (v + 1), 0, 0) for v in range(steps)]
    assert sorted(grant_versions) == [v for v in range(steps) for _ in range(BATCH // per_grant)]
    assert status["staleness"]["histogram"] == {"0": steps * BATCH}
    assert status["staleness"]["dropped"] == status["staleness"]["kept"] == 0


# -- the bound's defaults -------------------------------------------------------------------


def test_a_cluster_without_eta_is_unbounded(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as client:
        client.put(rows(3), policy_version=0)
        client.set_version(100)
        assert client.acquire(1000, timeout=5).n == 1000  # no admission budget either
        meta = client.get_meta(["x"], 3, task="train", timeout=5)
        assert meta.policy_versions == [0, 0, 0]
        status = client.status()
        assert status["staleness"]["histogram"] == {"100": 3}
        assert status["admission"]["budget"] is None


def test_get_meta_max_staleness_overrides_the_cluster_bound(make_cluster):
    cluster = make_cluster(max_staleness=3, consumer_batch_size=BATCH)
    with cluster.connect() as client:
        for v in range(4):
            client.put(rows(1, v), policy_version=v)
        client.set_version(3)
        strict = client.get_meta(["x"], 4, task="strict", max_staleness=1, timeout=0.3, allow_partial=True)
        assert sorted(strict.policy_versions) == [2, 3]
        assert client.status()["staleness"]["dropped"] == 0  # the cluster's policy applies beyond its bound only
        default = client.get_meta(["x"], 4, task="default", timeout=0.3, allow_partial=True)
        assert sorted(default.policy_versions) == [0, 1, 2, 3]


def test_samples_without_a_policy_version_are_never_stale(make_cluster):
    cluster = make_cluster(max_staleness=0, consumer_batch_size=BATCH)
    with cluster.connect() as client:
        prompts = client.put(rows(4))  # prompts: no grant, no policy version
        client.set_version(10)
        meta = client.get_meta(["x"], 4, task="rollout", timeout=5)
        assert sorted(meta.indexes) == prompts.indexes
        status = client.status()
        assert status["staleness"]["dropped"] == 0
        assert status["staleness"]["histogram"] == {}  # not samples of a policy
