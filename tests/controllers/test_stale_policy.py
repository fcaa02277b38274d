"""What happens to a sample that is already too stale when a consumer asks: drop, keep, requeue."""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import eventually, rows


def _take(client: tq.Client, task: str, n: int, partition: str = "train", **kwargs) -> tq.BatchMeta:
    """What `task` can get right now (a short wait, partial batches allowed)."""
    return client.get_meta(["x"], n, task=task, partition=partition, timeout=0.3, allow_partial=True, **kwargs)


def test_drop_clears_and_counts_stale_samples_for_every_task(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4, stale_policy="drop")
    with cluster.connect() as client:
        with client.acquire(4, timeout=5):
            stale = client.put(rows(4), policy_version=0)
        fresh = client.put(rows(4, 10), policy_version=1)
        bytes_before = client.status()["bytes"]
        client.set_version(2)
        meta = _take(client, "train", 8)
        assert sorted(meta.indexes) == fresh.indexes
        status = client.status()
        assert status["staleness"]["dropped"] == 4
        assert status["staleness"]["kept"] == status["staleness"]["requeued"] == 0
        assert status["partitions"]["train"]["samples"] == 4  # the stale ones are gone
        assert status["bytes"] < bytes_before
        assert status["admission"]["accepted"] == 0  # they must be generated again
        # gone for a lenient task too
        lenient = _take(client, "lenient", 8, max_staleness=10)
        assert not set(lenient.indexes) & set(stale.indexes)
        assert client.status()["staleness"]["dropped"] == 4  # counted once


def test_a_tighter_bound_drops_nothing_and_a_leased_sample_is_never_dropped(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=8, stale_policy="drop")
    with cluster.connect() as client:
        put = client.put(rows(8), policy_version=0)
        held = client.get_meta(["x"], 4, task="critic", timeout=5)
        client.set_version(1)  # one version old: within the cluster's bound
        assert _take(client, "ref", 8, max_staleness=0).indexes == []  # too stale for this call only
        assert client.status()["staleness"]["dropped"] == 0
        actor = client.get_meta(["x"], 8, task="actor", timeout=5)
        assert sorted(actor.indexes) == put.indexes
        client.ack(actor)
        client.set_version(2)  # now beyond the cluster's bound: dropped, but not those critic leases
        assert _take(client, "late", 8).indexes == []
        status = client.status()
        assert status["staleness"]["dropped"] == 4
        assert status["partitions"]["train"]["samples"] == 4
        assert client.get_data(held)["x"].tolist() == held.indexes
        client.ack(held)
        assert _take(client, "late", 8).indexes == []
        assert client.status()["staleness"]["dropped"] == 8


def test_keep_counts_stale_samples_once_and_serves_them_to_tasks_that_accept_them(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4, stale_policy="keep")
    with cluster.connect() as client:
        stale = client.put(rows(4), policy_version=0)
        fresh = client.put(rows(2, 10), policy_version=2)
        client.set_version(2)
        assert sorted(_take(client, "train", 6).indexes) == fresh.indexes
        assert _take(client, "train", 6).indexes == []  # still never served to the bounded task
        status = client.status()
        assert status["staleness"]["kept"] == 4  # counted once, though seen twice
        assert status["staleness"]["dropped"] == 0
        assert status["partitions"]["train"]["samples"] == 6
        lenient = client.get_meta(["x"], 6, task="lenient", max_staleness=2, timeout=5)
        assert sorted(lenient.indexes) == sorted(stale.indexes + fresh.indexes)
        strict = _take(client, "strict", 6, max_staleness=0)
        assert sorted(strict.indexes) == fresh.indexes


def test_requeue_drops_the_stale_sample_and_offers_its_prompt_to_rollout_again(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4, stale_policy="requeue")
    prompts = TensorDict({"prompt": torch.arange(100, 104)}, batch_size=[4])
    with cluster.connect() as rollout, cluster.connect() as trainer:
        trainer.put(prompts, partition="prompts")
        # a rollout worker takes the prompts and produces one response each
        taken = rollout.get_meta(["prompt"], 4, task="rollout", partition="prompts", timeout=5)
        rollout.ack(taken)
        with rollout.acquire(4, timeout=5) as grant:
            response = TensorDict({"response": rollout.get_data(taken)["prompt"] * 10}, batch_size=[4])
            rollout.put(response, partition="train", source=taken)
        assert grant.version == 0
        # nothing left for rollout: it parks, waiting for prompts
        again: dict[str, tq.BatchMeta] = {}
        waiter = threading.Thread(
            target=lambda: again.setdefault(
                "meta", rollout.get_meta(["prompt"], 4, task="rollout", partition="prompts", timeout=30)
            )
        )
        waiter.start()
        eventually(lambda: trainer.status()["counters"]["parked_get_meta"] == 1, 10, "rollout parked")
        trainer.set_version(2)  # the responses are now 2 versions old (> η = 1)
        meta = trainer.get_meta(["response"], 4, task="train", partition="train", timeout=0.3, allow_partial=True)
        assert len(meta) == 0
        waiter.join(20)
        status = trainer.status()
        assert status["staleness"]["requeued"] == 4 and status["staleness"]["dropped"] == 0
        assert status["partitions"]["train"]["samples"] == 0
        assert status["admission"]["accepted"] == 0
        # the same prompts came back to rollout, and the regenerated responses are served
        requeued = again["meta"]
        assert sorted(requeued.indexes) == sorted(taken.indexes)
        assert sorted(rollout.get_data(requeued)["prompt"].tolist()) == [100, 101, 102, 103]
        rollout.ack(requeued)
        with rollout.acquire(4, timeout=5) as grant:
            rollout.put(TensorDict({"response": torch.arange(4)}, batch_size=[4]), partition="train", source=requeued)
        assert grant.version == 2
        served = trainer.get_meta(["response"], 4, task="train", partition="train", timeout=5)
        assert served.policy_versions == [2] * 4
        assert (
            trainer.get_meta(
                ["prompt"], 4, task="rollout", partition="prompts", timeout=0.3, allow_partial=True
            ).indexes
            == []
        )
