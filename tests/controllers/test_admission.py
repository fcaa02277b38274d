"""Admission control (AReaL's rule) over a real cluster: budget, waiting, FIFO, grants, expiry.

accepted + running <= (η + version + 1) × consumer_batch_size, where `accepted` counts samples
put under a grant and `running` the granted slots not yet put.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest

import transfer_queue as tq
from tests.helpers import eventually, rows


def admission(client: tq.Client) -> dict:
    return client.status()["admission"]


def budget_limit(status: dict, eta: float, batch: int) -> int:
    """AReaL's cap on accepted + running at the status's version."""
    return int((eta + status["version"] + 1) * batch + 1e-9)


def test_grants_exactly_eta_plus_one_batches_at_version_zero(make_cluster):
    cluster = make_cluster(max_staleness=2, consumer_batch_size=4)
    with cluster.connect() as client:
        grants = [client.acquire(4, timeout=5) for _ in range(3)]
        assert [g.n for g in grants] == [4, 4, 4]
        assert all(g.version == 0 for g in grants)
        with pytest.raises(tq.TimeoutError):
            client.acquire(1, timeout=0.3)
        adm = admission(client)
        assert adm["running"] == 12 and adm["budget"] == 0 and adm["open_grants"] == 3


def test_a_request_a_pinned_budget_can_never_fit_is_refused_at_once(make_cluster):
    cluster = make_cluster(staleness=tq.StalenessConfig(4, 1, follow_consumers=False))
    with cluster.connect() as client:
        with pytest.raises(tq.UnsatisfiableError, match=r"can never fit.* = 8 slots.*consumer_batch_size >= 5"):
            client.acquire(9, timeout=30)
        with pytest.raises(tq.SchemaError):
            client.acquire(0)
        assert client.acquire(8, timeout=5).n == 8
        assert admission(client)["consumer_batch_size"] == 4


def test_a_producer_batch_above_a_following_budget_grows_it_to_fit(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as client:
        assert client.acquire(9, timeout=5).n == 9
        adm = admission(client)
    assert adm["consumer_batch_size"] == 5 and adm["configured_consumer_batch_size"] == 4
    assert adm["grown_by"] == "a producer acquires 9 slots at once" and adm["budget"] == 10 - 9


def test_acquire_waits_for_a_version_bump_and_gets_the_new_version(make_cluster):
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)
    with cluster.connect() as producer, cluster.connect() as trainer:
        first = producer.acquire(4, timeout=5)
        producer.put(rows(4), partition="train")
        assert first.version == 0
        result: dict[str, object] = {}

        def wait() -> None:
            result["grant"] = producer.acquire(4, timeout=60)

        thread = threading.Thread(target=wait)
        thread.start()
        eventually(lambda: admission(trainer)["waiting"] == 1)
        assert thread.is_alive()
        trainer.set_version(1)
        thread.join(30)
        assert not thread.is_alive()
        grant = result["grant"]
        assert isinstance(grant, tq.Grant) and grant.version == 1 and grant.n == 4
        adm = admission(trainer)
        assert adm["waits"] == 1 and adm["accepted"] == 4 and adm["running"] == 4


def test_waiting_producers_are_served_in_arrival_order(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)  # 8 slots at version 0

    async def scenario() -> tuple[tq.Grant, tq.Grant, dict, dict]:
        holder = await tq.connect_async(cluster.address)
        big = await tq.connect_async(cluster.address)
        small = await tq.connect_async(cluster.address)
        try:
            held = await holder.acquire(6, timeout=5)  # 2 slots left
            big_task = asyncio.ensure_future(big.acquire(4, timeout=30))
            await _until_async(lambda s: s["admission"]["waiting"] == 1, holder)
            # 2 slots would fit, but the older request for 4 goes first
            small_task = asyncio.ensure_future(small.acquire(2, timeout=30))
            parked = await _until_async(lambda s: s["admission"]["waiting"] == 2, holder)
            await held.release()  # 8 slots free: both fit now, the big one first
            g_big, g_small = await asyncio.gather(big_task, small_task)
            return g_big, g_small, parked["admission"], (await holder.status())["admission"]
        finally:
            for c in (holder, big, small):
                await c.close()

    g_big, g_small, parked, after = asyncio.run(scenario())
    assert parked["running"] == 6 and parked["budget"] == 2  # the small one did not jump the queue
    assert g_big.grant_id < g_small.grant_id
    assert after["running"] == 6 and after["waiting"] == 0


def test_a_waiter_that_times_out_at_the_head_lets_the_next_one_through(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as holder, cluster.connect() as big, cluster.connect() as small:
        holder.acquire(6, timeout=5)  # 2 slots left
        errors: list[BaseException] = []

        def ask_big() -> None:
            try:
                big.acquire(4, timeout=1.0)
            except tq.TimeoutError as exc:
                errors.append(exc)

        thread = threading.Thread(target=ask_big)
        thread.start()
        eventually(lambda: admission(holder)["waiting"] == 1)
        result: dict[str, tq.Grant] = {}

        def ask_small() -> None:
            try:
                result["g"] = small.acquire(2, timeout=15)
            except tq.TimeoutError as exc:
                errors.append(exc)

        small_thread = threading.Thread(target=ask_small)
        small_thread.start()
        thread.join(30)
        small_thread.join(30)
        assert len(errors) == 1  # the head timed out; the small request did not
        assert "g" in result, "the request behind a timed-out head stayed parked"
        assert result["g"].n == 2


def test_a_grant_used_as_context_manager_returns_unused_slots(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as client:
        with client.acquire(5, timeout=5) as grant:
            meta = client.put(rows(3), partition="train")
            assert meta.policy_versions == [grant.version] * 3
            assert admission(client)["running"] == 2
        adm = admission(client)
        assert adm["accepted"] == 3 and adm["running"] == 0 and adm["open_grants"] == 0
        assert adm["budget"] == 8 - 3


def test_a_put_beyond_its_grant_is_refused_and_leaves_the_grant_whole(make_cluster):
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)
    with cluster.connect() as client:
        grant = client.acquire(4, timeout=5)
        with pytest.raises(tq.SchemaError, match=r"64 samples under grant .* 4 slots left"):
            client.put(rows(64), grant=grant)
        assert client.status()["bytes"] == 0  # nothing stored
        adm = admission(client)
        assert adm["accepted"] == 0 and adm["running"] == 4 and adm["open_grants"] == 1
        assert client.put(rows(4), grant=grant).policy_versions == [0] * 4
        adm = admission(client)
        assert adm["accepted"] == 4 and adm["running"] == 0 and adm["budget"] == 0


def test_admission_is_opt_in_puts_without_a_grant_are_not_limited(make_cluster):
    cluster = make_cluster(max_staleness=0, consumer_batch_size=2)
    with cluster.connect() as free_producer, cluster.connect() as granted:
        for k in range(5):  # far beyond the 2-slot budget
            free_producer.put(rows(4, 4 * k), partition="train")
        assert admission(free_producer)["accepted"] == 0
        grant = granted.acquire(2, timeout=5)  # the free puts took nothing from the budget
        assert grant.n == 2
        assert client_samples(granted, "train") == 20


def test_dropping_stale_samples_opens_budget_for_a_waiting_producer(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as producer, cluster.connect() as trainer, cluster.connect() as waiter:
        with producer.acquire(4, timeout=5):
            producer.put(rows(4), partition="train")  # version 0
        trainer.set_version(2)  # budget (1 + 2 + 1) * 4 = 16, 4 accepted
        held = [producer.acquire(8, timeout=5), producer.acquire(4, timeout=5)]  # budget now 0
        result: dict[str, tq.Grant] = {}
        thread = threading.Thread(target=lambda: result.setdefault("g", waiter.acquire(4, timeout=30)))
        thread.start()
        eventually(lambda: admission(trainer)["waiting"] == 1)
        # the version-0 samples are 2 versions old: dropped when the trainer asks, to be generated again
        meta = trainer.get_meta(["x"], 4, task="train", partition="train", timeout=0.3, allow_partial=True)
        assert len(meta) == 0
        thread.join(20)
        assert "g" in result, "budget freed by dropped samples did not reach the waiting producer"
        assert admission(trainer)["accepted"] == 0
        assert trainer.status()["staleness"]["dropped"] == 4
        for grant in held:
            grant.release()


def test_dropping_samples_put_without_a_grant_leaves_the_budget_alone(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)
    with cluster.connect() as free_producer, cluster.connect() as producer, cluster.connect() as trainer:
        trainer.set_version(2)
        with producer.acquire(4, timeout=5):
            producer.put(rows(4), partition="train")  # version 2: fresh, counted
        free_producer.put(rows(8, 100), partition="train", policy_version=0)  # stale, never counted
        meta = trainer.get_meta(["x"], 12, task="train", partition="train", timeout=0.3, allow_partial=True)
        assert meta.policy_versions == [2] * 4
        status = trainer.status()
        assert status["staleness"]["dropped"] == 8
        assert status["admission"]["accepted"] == 4  # the 4 granted samples still count


def test_concurrent_acquirers_never_exceed_the_budget(make_cluster):
    eta, batch = 1, 8
    cluster = make_cluster(max_staleness=eta, consumer_batch_size=batch)
    stop = threading.Event()
    violations: list[dict] = []
    errors: list[BaseException] = []
    snapshots = [0]

    def producer(seed: int) -> None:
        rng = random.Random(seed)
        try:
            with cluster.connect() as client:
                while not stop.is_set():
                    try:
                        grant = client.acquire(rng.randint(1, 6), timeout=0.5)
                    except tq.TimeoutError:
                        continue
                    with grant:
                        time.sleep(rng.random() * 0.01)
                        used = rng.randint(0, grant.n)
                        if used:
                            client.put(rows(used), partition="train", grant=grant)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def watch() -> None:
        with cluster.connect() as client:
            while not stop.is_set():
                status = client.status()
                adm = status["admission"]
                snapshots[0] += 1
                time.sleep(0.005)
                if adm["accepted"] + adm["running"] > budget_limit(status, eta, batch) or adm["budget"] < 0:
                    violations.append({"version": status["version"], **adm})

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(4)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    with cluster.connect() as trainer:
        for version in range(1, 9):
            time.sleep(0.15)
            trainer.set_version(version)
        time.sleep(0.15)
        stop.set()
        for t in threads:
            t.join(30)
        final = trainer.status()
    assert not errors
    assert not violations, violations[:3]
    adm = final["admission"]
    assert snapshots[0] > 0
    assert adm["waits"] > 0, "the producers never hit the budget, so the test proved nothing"
    assert adm["running"] == 0 and adm["open_grants"] == 0
    assert adm["accepted"] <= budget_limit(final, eta, batch)


def _hold_a_grant(address: str, n: int, put: int, ready) -> None:
    with tq.connect(address) as client:
        grant = client.acquire(n, timeout=30)
        if put:
            client.put(rows(put), partition="train", grant=grant)
        ready.put(grant.grant_id)
        time.sleep(600)


@pytest.mark.parametrize("put", [0, 3], ids=["never-put", "put-some"])
def test_a_killed_producer_s_slots_come_back_after_grant_timeout(make_cluster, put):
    grant_timeout = 3.0
    cluster = make_cluster(max_staleness=0, consumer_batch_size=8, grant_timeout=grant_timeout)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_hold_a_grant, args=(cluster.address, 8, put, ready))
    proc.start()
    try:
        ready.get(timeout=120)
        with cluster.connect() as client:
            adm = admission(client)
            assert adm["running"] == 8 - put and adm["accepted"] == put and adm["open_grants"] == 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(30)
            started = time.monotonic()
            grant = client.acquire(8 - put, timeout=30)  # parks until the dead grant expires
            waited = time.monotonic() - started
            adm = admission(client)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert grant.n == 8 - put
    assert waited < grant_timeout + 15  # generous: the slots come back at expiry, not at our timeout
    assert adm["expired_grants"] == 1
    assert adm["accepted"] == put and adm["running"] == 8 - put and adm["open_grants"] == 1


# -- helpers -----------------------------------------------------------------------------


def client_samples(client: tq.Client, partition: str) -> int:
    return client.status()["partitions"][partition]["samples"]


async def _until_async(cond, client: tq.AsyncClient, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = await client.status()
        if cond(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def test_a_grant_from_before_a_controller_restart_is_not_one_made_after_it(make_cluster, tmp_path):
    """Grants are not journaled, so a restarted controller knows none of its predecessor's: a put
    under an old grant counts as accepted and must not use up a new grant that happens to carry
    the same id (ids that restarted at 1 did, and admission then granted slots still held)."""
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4, journal=tmp_path / "controller.journal")
    with cluster.connect() as client:
        old = client.acquire(4, timeout=5)
    cluster.backend.procs[0].send_signal(signal.SIGKILL)
    cluster.backend.procs[0].wait()
    cluster.restart_controller()
    with cluster.connect() as client:
        new = client.acquire(4, timeout=5)
        assert new.grant_id != old.grant_id
        client.put(rows(4), partition="train", grant=old)
        adm = admission(client)
        assert adm["running"] == 4 and adm["open_grants"] == 1, adm  # the new grant keeps its slots
        assert adm["accepted"] == 4 and adm["budget"] == 0, adm
