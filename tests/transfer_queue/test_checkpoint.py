"""`client.save_checkpoint(path)` and `tq.init(restore=path)`: samples (all their ready fields,
dense and ragged), policy versions, groups, consumer progress (leased samples come back), seals
and the version survive, onto a different number of storage units."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq


def _batch(start: int, n: int) -> TensorDict:
    ids = torch.arange(start, start + n)
    tokens = torch.nested.nested_tensor([torch.full((1 + i % 5,), int(i)) for i in ids], layout=torch.jagged)
    return TensorDict({"id": ids, "x": ids.float().unsqueeze(1).repeat(1, 3), "tokens": tokens}, batch_size=[n])


def _rows(client: tq.Client, partition: str, fields: list[str]) -> dict[int, tuple]:
    meta = client.get_meta(fields, 1 << 16, task="check", partition=partition, timeout=2, allow_partial=True)
    data = client.get_data(meta)
    client.nack(meta)
    out = {}
    for k, sample_id in enumerate(data["id"].tolist()):
        extra = tuple(data[f][k].tolist() for f in fields if f != "id")
        out[sample_id] = (meta.policy_versions[k], meta.groups[k], *extra)
    return out


def test_checkpoint_restores_samples_progress_and_leases_onto_other_units(tmp_path):
    with tq.init(num_storage_units=2, storage_capacity="64MiB") as first, first.connect() as client:
        client.put(_batch(0, 16), policy_version=1, groups=[i // 4 for i in range(16)])
        client.put(_batch(16, 16), policy_version=2, groups=[4 + i // 4 for i in range(16)])
        done = client.get_meta(["id"], 8, task="train", timeout=5)
        done_ids = set(client.get_data(done)["id"].tolist())
        client.ack(done)
        leased = client.get_meta(["id"], 8, task="train", timeout=5, lease_timeout=600)  # in flight
        scored = client.get_meta(["id"], 4, task="reward", timeout=5)
        client.put(TensorDict({"score": torch.arange(4.0)}, batch_size=[4]), meta=scored)  # a later column
        client.put(TensorDict({"id": torch.arange(100, 104)}, batch_size=[4]), partition="prompts")
        client.seal("prompts")
        client.set_version(3)
        before = _rows(client, "train", ["id", "x", "tokens"])
        before_scores = _rows(client, "train", ["id", "score"])
        assert client.save_checkpoint(tmp_path / "ckpt") == 36
        assert len(leased) == 8
    with (
        tq.init(num_storage_units=3, storage_capacity="96MiB", restore=tmp_path / "ckpt") as second,
        second.connect() as client,
    ):
        status = client.status()
        assert status["version"] == 3 and sorted(status["units"]) == ["0", "1", "2"]
        train = status["partitions"]["train"]
        assert train["samples"] == 32
        assert train["tasks"]["train"] == {"consumed": 8, "leased": 0, "pending": 24}  # the leased 8 come back
        assert "reward" not in train["tasks"]  # it had consumed nothing (its 4 samples were only leased)
        assert status["partitions"]["prompts"]["sealed"] and not train["sealed"]
        assert _rows(client, "train", ["id", "x", "tokens"]) == before
        assert _rows(client, "train", ["id", "score"]) == before_scores
        left = client.get_meta(["id"], 32, task="train", timeout=2, allow_partial=True)
        assert set(client.get_data(left)["id"].tolist()) == set(range(32)) - done_ids


def test_restore_of_a_non_checkpoint_is_a_schema_error(tmp_path):
    with pytest.raises(tq.SchemaError, match="no Sluice checkpoint"):
        tq.init(num_storage_units=1, storage_capacity="16MiB", restore=tmp_path)


def _spans(client: tq.Client) -> dict[int, tuple[int, int]]:
    meta = client.get_meta(["id"], 8, task="look", timeout=5)
    ids = client.get_data(meta)["id"].tolist()
    client.nack(meta)
    return {i: (v0, v1) for i, v0, v1 in zip(ids, meta.policy_versions, meta.version_last)}


def test_checkpoint_keeps_version_spans_versionless_prompts_and_requeue_sources(tmp_path):
    """A partial rollout's (first, last) span, prompts without a version (never stale) and the
    prompt each sample came from survive; after the restore a stale sample still requeues its
    prompt to the rollout task (`stale_policy="requeue"`)."""
    config = dict(max_staleness=1, stale_policy="requeue")
    with tq.init(num_storage_units=1, storage_capacity="16MiB", **config) as first, first.connect() as client:
        client.put(TensorDict({"id": torch.arange(100, 108)}, batch_size=[8]), partition="prompts")
        prompts = client.get_meta(["id"], 8, task="rollout", partition="prompts", timeout=5)
        client.ack(prompts)
        client.put(_batch(0, 4), policy_version=(1, 3), source=prompts.select(range(4)))  # partial rollouts
        client.put(_batch(4, 4), policy_version=2, source=prompts.select(range(4, 8)))
        client.set_version(2)
        spans = _spans(client)
        assert spans[0] == (1, 3) and spans[4] == (2, 2)
        client.save_checkpoint(tmp_path / "ckpt")
    with (
        tq.init(num_storage_units=2, storage_capacity="32MiB", restore=tmp_path / "ckpt", **config) as second,
        second.connect() as client,
    ):
        assert _spans(client) == spans
        assert client.status()["partitions"]["prompts"]["tasks"]["rollout"]["consumed"] == 8
        client.set_version(5)  # every train sample is now stale: their prompts go back to the rollout task
        assert len(client.get_meta(["id"], 8, task="train", timeout=0.5, allow_partial=True)) == 0
        again = client.get_meta(["id"], 8, task="rollout", partition="prompts", timeout=5)
        assert sorted(client.get_data(again)["id"].tolist()) == list(range(100, 108))
        fresh = client.get_meta(["id"], 8, task="other", partition="prompts", timeout=5)
        assert len(fresh) == 8, "prompts carry no version, so they are never too stale"
