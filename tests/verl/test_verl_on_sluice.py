"""verl 0.9.1's own TransferQueue code (replay buffers, tqbridge, padding, DataProto) on Sluice.

Runs in the verl environment (`make verl-test`); skipped where verl is not installed. Every test
drives verl's real modules against a real Sluice cluster started from verl's own
`transfer_queue` config; nothing of verl or Sluice is mocked.

Needs a GPU, so not here: verl's Ray worker groups (they request GPUs), its rollout servers
(vLLM/SGLang/TRT-LLM) and therefore `AgentLoopManagerTQ`; the trajectories below are written
with the calls and the key/tag layout its `AgentLoopWorkerTQ` uses.
"""

from __future__ import annotations

import asyncio
import threading
from importlib import resources

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

from omegaconf import OmegaConf  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size  # noqa: E402
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer, ReplayBufferAsync  # noqa: E402
from verl.utils import transferqueue_utils  # noqa: E402
from verl.utils.tensordict_utils import list_of_dict_to_tensordict  # noqa: E402

import transfer_queue as tq  # noqa: E402


def verl_tq_config():
    """verl's own `transfer_queue` config node, as `main_ppo` hands it to `tq.init`."""
    conf = OmegaConf.load(resources.files("verl.trainer.config") / "transfer_queue" / "transfer_queue.yaml")
    conf.enable = True
    return conf


@pytest.fixture(scope="module")
def sluice():
    conf = tq.init(verl_tq_config())
    try:
        yield conf
    finally:
        tq.close()


def submit_prompts(partition: str, uids: list[str], global_steps: int) -> None:
    """What verl's trainer does when it hands prompts to rollout: pending prompt groups."""
    tags = [{"is_prompt": True, "status": "pending", "global_steps": global_steps} for _ in uids]
    prompts = list_of_dict_to_tensordict(
        [{"raw_prompt_ids": torch.arange(3 + i), "uid": u} for i, u in enumerate(uids)]
    )
    tq.kv_batch_put(keys=uids, partition_id=partition, fields=prompts, tags=tags)


async def run_group(partition: str, uid: str, global_steps: int, n: int, prompt_len: int, finish: bool = True) -> None:
    """What verl's `AgentLoopWorkerTQ` does for one prompt: running, n sessions, then finished."""
    await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "running"})
    for session in range(n):
        prompts = torch.arange(prompt_len) + 10
        responses = torch.arange(session + 2) + 100
        input_ids = torch.cat([prompts, responses])
        field = {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(len(input_ids)),
            "response_mask": torch.ones_like(responses),
            "loss_mask": torch.ones_like(responses),
            "rm_scores": torch.zeros(len(responses)),
            "uid": uid,
            "session_id": session,
            "global_steps": global_steps,
            "data_source": "digits",
            "reward_model": {"ground_truth": "42", "style": "rule"},
            "multi_modal_inputs": {},
            "extra_fields": {"min_global_steps": global_steps, "max_global_steps": global_steps, "turns": [1, 2]},
        }
        tag = {
            "status": "success",
            "prompt_len": prompt_len,
            "response_len": len(responses),
            "seq_len": len(input_ids),
            "global_steps": global_steps,
            "min_global_steps": global_steps,
            "max_global_steps": global_steps,
        }
        await tq.async_kv_batch_put(
            keys=[f"{uid}_{session}_0"], fields=list_of_dict_to_tensordict([field]), tags=[tag], partition_id=partition
        )
    if finish:
        await tq.async_kv_put(key=uid, partition_id=partition, tag={"status": "finished"})


def test_verl_config_starts_sluice(sluice):
    assert sluice.sluice.address.startswith("tcp://")
    with tq.connect(sluice.sluice.address) as client:
        assert len(client.units) == verl_tq_config().backend.SimpleStorage.num_data_storage_units
    assert isinstance(tq.get_client(), tq.TransferQueueClient)


def test_replay_buffer_async_drops_stale_groups_and_refills(sluice):
    for uid, steps in (("s1", 1), ("f3", 3), ("f4", 4)):
        submit_prompts("train", [uid], global_steps=steps)
        asyncio.run(run_group("train", uid, steps, n=2, prompt_len=4 + steps))
    refills: list[int] = []
    buffer = ReplayBufferAsync(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=2,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({}),
        poll_interval=0.01,
        refill_fn=refills.append,
    )
    batch, metrics = buffer.sample(global_steps=4, partition_id="train", batch_size=2)
    assert sorted(batch.keys) == ["f3_0_0", "f3_1_0", "f4_0_0", "f4_1_0"]
    assert metrics["training/off_policy/evicted_samples"] == 1 and refills == [1]
    assert tq.kv_list("train")["train"].keys() == set(batch.keys)  # stale group and sampled prompts cleared
    data = tq.kv_batch_get(batch.keys, batch.partition_id, ["input_ids", "uid"])  # as verl reads
    assert [row[:1].item() for row in data["input_ids"].unbind()] == [10] * 4
    assert sorted(set(data["uid"])) == ["f3", "f4"]
    tq.kv_clear(batch.keys, "train")


def test_replay_buffer_async_wait_strategy_waits_for_the_oldest_group(sluice):
    submit_prompts("wait", ["old"], global_steps=3)
    submit_prompts("wait", ["new"], global_steps=4)
    asyncio.run(run_group("wait", "new", 4, n=1, prompt_len=3))
    asyncio.run(run_group("wait", "old", 3, n=1, prompt_len=3, finish=False))  # in flight at the threshold
    buffer = ReplayBufferAsync(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=2,
        max_off_policy_strategy="wait",
        sampler_kwargs=OmegaConf.create({}),
        poll_interval=0.01,
    )
    result = {}
    sampler = threading.Thread(target=lambda: result.update(out=buffer.sample(4, "wait", 1)))
    sampler.start()
    tq.kv_put(key="old", partition_id="wait", tag={"status": "finished"})
    sampler.join(timeout=60)
    batch, _ = result["out"]
    assert batch.keys == ["old_0_0"]  # the group at the threshold is trained on, not dropped


def test_sync_replay_buffer_samples_finished_groups(sluice):
    submit_prompts("val", ["v0", "v1"], global_steps=2)
    for uid in ("v0", "v1"):
        asyncio.run(run_group("val", uid, 2, n=3, prompt_len=5))
    buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({}),
        poll_interval=0.01,
    )
    batch, _ = buffer.sample(global_steps=2, partition_id="val", batch_size=2)
    assert len(batch) == 6 and {k.split("_")[0] for k in batch.keys} == {"v0", "v1"}
    assert all(tag["status"] == "success" for tag in batch.tags)


def test_tqbridge_moves_kv_meta_through_batch_meta_and_tensordict(sluice):
    keys = [f"br_{i}_0" for i in range(4)]
    meta = tq.kv_batch_put(
        keys,
        "bridge",
        TensorDict({"x": torch.arange(8.0).view(4, 2)}, batch_size=[4]),
        tags=[{"i": i} for i in range(4)],
    )
    meta.extra_info = {"temperature": 0.5}
    seen = {}

    @transferqueue_utils.tqbridge()
    def double(data: TensorDict) -> TensorDict:
        seen["temperature"] = data["temperature"]
        return TensorDict({"doubled": data["x"] * 2}, batch_size=data.batch_size)

    @transferqueue_utils.tqbridge()
    async def negate(data: TensorDict) -> TensorDict:
        return TensorDict({"negated": -data["doubled"]}, batch_size=data.batch_size)

    out = double(meta)
    assert isinstance(out, tq.KVBatchMeta) and out.keys == keys and "doubled" in out.fields
    assert out.tags == [{"i": i} for i in range(4)] and seen["temperature"] == 0.5
    out = asyncio.run(negate(out.select_keys(keys[::-1])))
    got = tq.kv_batch_get(keys, "bridge", ["doubled", "negated"])
    got = got.to_padded_tensor()  # read back jagged, as from TransferQueue
    assert torch.equal(got["doubled"], torch.arange(8.0).view(4, 2) * 2)
    assert torch.equal(got["negated"], -got["doubled"])
    batch_meta = transferqueue_utils.kv_batch_meta2batch_meta(out)
    assert isinstance(batch_meta, tq.BatchMeta) and batch_meta.partition_ids == ["bridge"] * 4
    assert transferqueue_utils.batch_meta2kv_batch_meta(batch_meta).keys == keys[::-1]


def test_data_proto_round_trips_through_sluice(sluice):
    proto = DataProto.from_dict(
        tensors={"input_ids": torch.randint(0, 50, (3, 6)), "old_log_prob": torch.randn(3, 6)},
        non_tensors={
            "uid": np.array(["a", "b", "c"], dtype=object),
            "reward_model": np.array([{"ground_truth": str(i)} for i in range(3)], dtype=object),
        },
        meta_info={"global_steps": 3, "temperature": 1.0},
    )
    keys = ["dp0", "dp1", "dp2"]
    tq.kv_batch_put(keys, "proto", proto.to_tensordict())
    # read back jagged, as from TransferQueue; verl pads before building a DataProto
    back = DataProto.from_tensordict(tq.kv_batch_get(keys, "proto").to_padded_tensor())
    for name in ("input_ids", "old_log_prob"):
        assert torch.equal(back.batch[name], proto.batch[name])
    assert list(back.non_tensor_batch["uid"]) == ["a", "b", "c"]
    assert list(back.non_tensor_batch["reward_model"]) == [{"ground_truth": str(i)} for i in range(3)]
    assert back.meta_info == proto.meta_info


def test_padding_upsamples_a_kv_batch_in_sluice(sluice):
    submit_prompts("pad", ["p0"], global_steps=1)
    asyncio.run(run_group("pad", "p0", 1, n=3, prompt_len=4))
    batch = tq.KVBatchMeta(keys=[f"p0_{s}_0" for s in range(3)], tags=[{"status": "success"}] * 3, partition_id="pad")
    padded = upsample_batch_to_divisible_size(batch, batch_multiple=4, eos_token_id=2)
    assert len(padded) == 4 and padded.tags[-1]["is_padding"] is True
    data = tq.kv_batch_get(padded.keys, padded.partition_id, ["responses", "rm_scores", "uid"])
    assert data["responses"].is_nested  # the padding row's length differs from the real rows'
    assert data["responses"].unbind()[-1].tolist() == [2] and float(data["rm_scores"].unbind()[-1].sum()) == 0.0
    assert data["uid"][-1].startswith("pad")


def test_checkpoint_survives_a_restart(sluice, tmp_path):
    submit_prompts("ckpt", ["c0", "c1"], global_steps=5)
    asyncio.run(run_group("ckpt", "c0", 5, n=2, prompt_len=3))
    before = tq.kv_list("ckpt")
    tq.save_checkpoint(tmp_path / "transfer_queue", metadata={"global_steps": 5})
    tq.close()
    tq.init(verl_tq_config())  # a new cluster, as a resumed run starts one
    assert tq.kv_list("ckpt") == {}
    tq.load_checkpoint(tmp_path / "transfer_queue")
    assert tq.kv_list("ckpt") == before
    buffer = ReplayBufferAsync(
        trainer_mode="separate_async",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=2,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({}),
        poll_interval=0.01,
    )
    batch, _ = buffer.sample(global_steps=6, partition_id="ckpt", batch_size=1)
    assert sorted(batch.keys) == ["c0_0_0", "c0_1_0"]
    assert tq.kv_batch_get(batch.keys, "ckpt", "prompts")["prompts"][0].tolist() == [10, 11, 12]
