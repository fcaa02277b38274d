"""Several producer and consumer processes under random timing: each task sees each sample once."""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import transfer_queue as tq


def _produce(address: str, producer: int, batches: list[int], delay: float, seed: int) -> None:
    rng = random.Random(seed)
    with tq.connect(address) as client:
        start = producer * 1_000_000
        for n in batches:
            client.put(TensorDict({"id": torch.arange(start, start + n)}, batch_size=[n]), partition="p")
            start += n
            time.sleep(rng.random() * delay)


def _consume(address: str, task: str, batch_size: int, delay: float, seed: int, out) -> None:
    rng = random.Random(seed)
    seen = []
    with tq.connect(address) as client:
        for batch, _meta in client.stream(["id"], batch_size, task=task, partition="p", timeout=30):
            seen.extend(batch["id"].tolist())
            time.sleep(rng.random() * delay)
    out.put((task, seen))


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # 5 spawned processes an example
@given(
    batches=st.lists(st.lists(st.integers(1, 13), min_size=1, max_size=5), min_size=2, max_size=2),
    consumer_batch=st.integers(1, 9),
    delay=st.floats(0.0, 0.02),
    seed=st.integers(0, 2**16),
)
def test_each_task_gets_every_sample_exactly_once(batches, consumer_batch, delay, seed):
    ctx = mp.get_context("spawn")
    with tq.init(num_storage_units=2, storage_capacity="64MiB") as cluster:
        out = ctx.Queue()
        producers = [
            ctx.Process(target=_produce, args=(cluster.address, i, b, delay, seed + i)) for i, b in enumerate(batches)
        ]
        # two consumers share task "train" (competing), one more task reads everything on its own
        consumers = [
            ctx.Process(target=_consume, args=(cluster.address, task, consumer_batch, delay, seed + 10 + k, out))
            for k, task in enumerate(["train", "train", "ref"])
        ]
        for p in producers + consumers:
            p.start()
        for p in producers:
            p.join(60)
            assert p.exitcode == 0
        with cluster.connect() as client:
            client.seal("p")
        results = [out.get(timeout=60) for _ in consumers]
        for p in consumers:
            p.join(30)
            assert p.exitcode == 0
    expected = sorted(i * 1_000_000 + k for i, b in enumerate(batches) for k in range(sum(b)))
    per_task: dict[str, list[int]] = {}
    for task, seen in results:
        per_task.setdefault(task, []).extend(seen)
    assert sorted(per_task["train"]) == expected
    assert sorted(per_task["ref"]) == expected
