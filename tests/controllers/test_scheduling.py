"""Readiness, waiting without blocking others, leases, samplers: over real processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import eventually


def _td(n: int, start: int = 0, **extra) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n), **extra}, batch_size=[n])


def test_a_field_is_served_only_once_it_is_ready(client):
    meta = client.put(_td(4))
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x", "score"], 4, task="train", timeout=0.3)
    prompt_meta = client.get_meta(["x"], 4, task="reward", timeout=5)
    client.put(TensorDict({"score": torch.ones(4)}, batch_size=[4]), meta=prompt_meta)
    got = client.get_meta(["x", "score"], 4, task="train", timeout=5)
    assert got.indexes == meta.indexes


def test_a_put_completes_a_waiting_get_meta_at_once_without_blocking_others(cluster):
    waiting_client = tq.connect(cluster.address)
    other = tq.connect(cluster.address)
    result = {}

    def wait() -> None:
        result["meta"] = waiting_client.get_meta(["x"], 8, task="t", timeout=20)
        result["at"] = time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    eventually(lambda: other.status()["counters"]["parked_get_meta"] == 1, 10, "get_meta parked")
    # the parked request delays nobody: other requests are answered meanwhile
    started = time.monotonic()
    other.status()
    other.put(_td(4), partition="elsewhere")
    assert time.monotonic() - started < 2.0
    assert thread.is_alive()
    other.put(_td(8))
    put_done = time.monotonic()
    thread.join(10)
    assert len(result["meta"]) == 8
    assert result["at"] - put_done < 1.0
    waiting_client.close()
    other.close()


def test_allow_partial_returns_what_is_ready(client):
    client.put(_td(3))
    meta = client.get_meta(["x"], 8, task="t", timeout=0.2, allow_partial=True)
    assert len(meta) == 3


def test_nack_and_lease_expiry_return_samples(client):
    client.put(_td(4))
    meta = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=0.5)
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x"], 4, task="t", timeout=0.1)
    client.nack(meta)
    again = client.get_meta(["x"], 4, task="t", timeout=5, lease_timeout=0.3)
    assert again.indexes == meta.indexes
    # not acked: the lease expires and the samples come back
    third = client.get_meta(["x"], 4, task="t", timeout=5)
    assert third.indexes == meta.indexes
    client.ack(third)
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x"], 1, task="t", timeout=0.3)


def _lease_and_hang(address: str, ready) -> None:
    client = tq.connect(address)
    client.get_meta(["x"], 6, task="train", timeout=10, lease_timeout=1.0)
    ready.set()
    time.sleep(60)


def test_an_ack_or_nack_naming_no_task_is_refused(client):
    """A put's meta names no task: acked, it made a task named "" consume the samples."""
    meta = client.put(_td(4))
    for give in (client.ack, client.nack):
        with pytest.raises(tq.SchemaError, match="needs the task the samples were handed to"):
            give(meta)
    assert client.status()["partitions"]["train"]["tasks"] == {}
    assert client.get_meta(["x"], 4, task="train", timeout=5).indexes == meta.indexes


def test_samples_of_a_killed_consumer_are_redelivered(cluster, client):
    client.put(_td(6))
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_lease_and_hang, args=(cluster.address, ready))
    proc.start()
    assert ready.wait(30)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    meta = client.get_meta(["x"], 6, task="train", timeout=10)
    assert sorted(client.get_data(meta)["x"].tolist()) == list(range(6))


def test_each_task_consumes_independently(client):
    client.put(_td(4))
    a = client.get_meta(["x"], 4, task="a", timeout=5)
    b = client.get_meta(["x"], 4, task="b", timeout=5)
    assert a.indexes == b.indexes
    client.ack(a)
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x"], 1, task="a", timeout=0.2)


def test_grpo_group_sampler_serves_whole_groups_only(client):
    # group 1 is incomplete (3 of 4), groups 0 and 2 complete
    groups = [0, 0, 1, 2, 0, 1, 2, 2, 0, 2, 1]
    client.put(_td(len(groups)), groups=groups)
    meta = client.get_meta(["x"], 8, task="t", sampler="grpo_group", group_size=4, timeout=5)
    assert sorted(meta.groups) == [0] * 4 + [2] * 4
    with pytest.raises(tq.TimeoutError):
        client.get_meta(["x"], 4, task="t", sampler="grpo_group", group_size=4, timeout=0.2)
    client.put(_td(1), groups=[1])
    meta = client.get_meta(["x"], 4, task="t", sampler="grpo_group", group_size=4, timeout=5)
    assert meta.groups == [1, 1, 1, 1]
    with pytest.raises(tq.SchemaError):
        client.get_meta(["x"], 6, task="u", sampler="grpo_group", group_size=4, timeout=1)


def test_seqlen_balanced_sampler_balances_tokens_across_ranks(client):
    lengths = [1000, 10, 900, 20, 800, 30, 700, 40]
    rows = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    client.put(TensorDict({"tokens": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[8]))
    meta = client.get_meta(["tokens"], 8, task="t", sampler="seqlen_balanced", dp_size=2, timeout=5)
    loads = []
    for part in meta.chunk(2):
        batch = client.get_data(part)
        loads.append(sum(t.numel() for t in batch["tokens"].unbind()))
    assert len(meta.chunk(2)[0]) == 4
    assert abs(loads[0] - loads[1]) <= 100, loads


def test_unknown_sampler_is_a_schema_error(client):
    client.put(_td(2))
    with pytest.raises(tq.SchemaError, match="unknown sampler"):
        client.get_meta(["x"], 2, task="t", sampler="nope", timeout=1)


def test_custom_sampler_loaded_by_import_path():
    with (
        tq.init(num_storage_units=1, storage_capacity="16MiB", samplers=["tests.samplers_fixture:NewestFirst"]) as c,
        c.connect() as client,
    ):
        client.put(_td(5))
        meta = client.get_meta(["x"], 3, task="t", sampler="newest_first", timeout=5)
        assert client.get_data(meta)["x"].tolist() == [4, 3, 2]
