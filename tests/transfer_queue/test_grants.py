"""Generation slots on the client: a put spends its grant's slots only once it is committed, so a
failed put leaves them to the grant (for a retry, or `release`), and a restore draws on no grant."""

from __future__ import annotations

import asyncio
import signal

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.conftest import MakeCluster
from transfer_queue.wire.messages import CommitPut


def _batch(n: int, width: int = 4) -> TensorDict:
    return TensorDict({"x": torch.zeros(n, width)}, batch_size=[n])


def test_a_failed_put_leaves_its_slots_to_the_grant(make_cluster: MakeCluster):
    cluster = make_cluster(max_staleness=0, consumer_batch_size=8)
    with cluster.connect() as client:
        client.seal("train")
        with client.acquire(8, timeout=5) as grant:
            try:
                client.put(_batch(8), partition="train", grant=grant)
            except tq.SealedError:
                pass
            assert grant.remaining == 8
        assert client.status()["admission"]["running"] == 0  # released when the block ended
        client.acquire(8, timeout=5).release()  # the whole budget is free again


def test_a_put_retried_after_a_failure_carries_the_grants_version(make_cluster: MakeCluster):
    cluster = make_cluster(storage_capacity="16MiB", max_staleness=1, consumer_batch_size=8)
    with cluster.connect() as client:
        client.set_version(5)
        grant = client.acquire(8, timeout=5)
        try:
            client.put(_batch(8, 1 << 20), timeout=2)  # 32 MiB: more than the unit holds
        except tq.CapacityError:
            pass
        meta = client.put(_batch(8), timeout=5)  # the retry draws on the same open grant
        assert meta.policy_versions == [grant.version] * 8
        assert grant.remaining == 0 and client.status()["admission"]["running"] == 0


async def test_a_grant_outlives_its_last_slots_while_a_put_holding_some_is_in_flight(make_cluster: MakeCluster):
    """Two puts share a grant of 8: B commits its 4 while A still holds the other 4, waiting for
    room it never gets. The grant stays open for A's slots, which come back when A fails: the
    retry without `grant=` draws on them (versioned), and no slot stays running."""
    cluster = make_cluster(storage_capacity="16MiB", max_staleness=1, consumer_batch_size=8)
    client = await tq.connect_async(cluster.address)
    await client.set_version(5)
    await client.put(_batch(1, 2 << 20), partition="fill")  # 8 MiB of 16, under no grant
    grant = await client.acquire(8, timeout=5)
    a = asyncio.ensure_future(client.put(_batch(4, 1 << 20), partition="big", timeout=3))  # 16 MiB: no room
    b = await client.put(_batch(4), partition="small", timeout=5)
    assert b.policy_versions == [5] * 4 and not a.done()
    with pytest.raises(tq.CapacityError):
        await a
    assert grant.remaining == 4
    retry = await client.put(_batch(4), partition="small", timeout=5)
    assert retry.policy_versions == [5] * 4
    assert grant.remaining == 0 and (await client.status())["admission"]["running"] == 0
    await client.close()


def test_a_put_without_grant_draws_on_the_oldest_grant_it_fits(make_cluster: MakeCluster):
    """g1 has 2 slots left, g2 8: a put of 4 draws on g2; one of 8 fits neither and is refused
    before anything is sent (under no grant its samples would carry no version)."""
    cluster = make_cluster(max_staleness=4, consumer_batch_size=100)
    with cluster.connect() as client:
        g1 = client.acquire(4, timeout=5)
        client.put(_batch(2))
        g2 = client.acquire(8, timeout=5)
        meta = client.put(_batch(4))
        assert (g1.remaining, g2.remaining) == (2, 4) and meta.policy_versions == [g2.version] * 4
        with pytest.raises(tq.SchemaError, match="no open grant of this client has 8 slots left"):
            client.put(_batch(8))
        assert client.status()["partitions"]["train"]["samples"] == 6


@pytest.mark.parametrize("use_shm", [True, False])
async def test_a_put_cancelled_once_its_commit_was_applied_spends_its_slots(make_cluster: MakeCluster, use_shm):
    """The put is cancelled as its commit's answer comes, the commit applied: its slots do not
    go back to the grant, where a put without `grant=` would draw on them (8 samples accepted
    under a grant of 4), and `release` returns none of them."""
    cluster = make_cluster(max_staleness=4, consumer_batch_size=100)
    client = await tq.connect_async(cluster.address, use_shm=use_shm)
    grant = await client.acquire(4, timeout=5)
    call = client._call

    async def cancel_once_committed(c):
        reply = await call(c)
        if isinstance(c.msg, CommitPut):
            put.cancel()  # before the put's flow sees the answer
        return reply

    client._call = cancel_once_committed
    put = asyncio.ensure_future(client.put(_batch(4), grant=grant))
    with pytest.raises(asyncio.CancelledError):
        await put
    client._call = call
    assert grant.remaining == 0 and (await client.status())["partitions"]["train"]["samples"] == 4
    await grant.release()
    admission = (await client.status())["admission"]
    assert admission["accepted"] == 4 and admission["running"] == 0
    await client.close()


async def test_a_put_cancelled_while_its_commit_waits_leaves_its_slots_to_release(make_cluster: MakeCluster):
    """The unit is stopped, so the commit waits for its write: cancelled then, the commit is
    withdrawn and the put aborted, and the client cannot tell that from an applied commit. Its
    slots are not drawn on again, and `release` returns them (the controller still holds them)."""
    cluster = make_cluster(max_staleness=4, consumer_batch_size=100)
    unit = cluster.backend.procs[1]
    client = await tq.connect_async(cluster.address, use_shm=False)
    grant = await client.acquire(4, timeout=5)
    committing = asyncio.Event()
    call = client._call

    async def tell_commit(c):
        if isinstance(c.msg, CommitPut):
            committing.set()
        return await call(c)

    client._call = tell_commit
    unit.send_signal(signal.SIGSTOP)
    try:
        put = asyncio.ensure_future(client.put(_batch(4), grant=grant))
        await committing.wait()
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
    finally:
        unit.send_signal(signal.SIGCONT)
    client._call = call
    assert grant.remaining == 0
    await grant.release()
    admission = (await client.status())["admission"]
    assert admission["accepted"] == 0 and admission["running"] == 0
    await client.close()


def test_a_restore_draws_on_no_open_grant(make_cluster: MakeCluster, tmp_path):
    with make_cluster().connect() as client:
        client.put(_batch(8), partition="prompts")  # unversioned: never too stale
        client.save_checkpoint(tmp_path / "ckpt")
    with make_cluster(max_staleness=0, consumer_batch_size=8).connect() as client:
        grant = client.acquire(8, timeout=5)  # open while the checkpoint is restored
        assert client.restore_checkpoint(tmp_path / "ckpt") == 8
        assert grant.remaining == 8
        client.set_version(grant.version + 3)  # samples of the grant's version would now be too stale
        meta = client.get_meta(["x"], 8, task="t", partition="prompts", timeout=5)
        assert len(meta) == 8
        grant.release()
