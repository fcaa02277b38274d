"""The verl recipe (`recipes/verl`): its config composes over verl's `ppo_trainer`, verl's async
knobs reach a real Sluice cluster, and the `sluice` checkpoint engine moves weights exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl")

from hydra import compose, initialize_config_dir  # noqa: E402
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402

import transfer_queue as tq  # noqa: E402
from recipes.verl import knobs  # noqa: E402
from recipes.verl.checkpoint_engine import SluiceCheckpointEngine  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "recipes" / "verl" / "config")
SMALL = [
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
    "transfer_queue.sluice.storage_capacity=64MiB",
]


def recipe_config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose("sluice_ppo", overrides=[*SMALL, *overrides])


def test_config_extends_verl_ppo_trainer():
    config = recipe_config()
    assert config.algorithm.gamma == 1.0 and config.trainer.use_v1  # verl's ppo_trainer defaults
    engine = config.actor_rollout_ref.rollout.checkpoint_engine
    assert engine.backend == "sluice" and engine.custom_backend_module == "recipes.verl.checkpoint_engine"
    assert config.transfer_queue.enable and config.trainer.v1.trainer_mode == "separate_async"


@pytest.mark.parametrize("strategy, policy, budget", [("drop", "drop", 0.5), ("wait", "keep", 0.5)])
def test_async_knobs_reach_sluice(strategy, policy, budget):
    config = recipe_config(
        "data.train_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "trainer.v1.sampler.max_off_policy_threshold=3",
        f"trainer.v1.sampler.max_off_policy_strategy={strategy}",
        "async_training.staleness_threshold=0.5",
    )
    knobs.apply(config)
    tq.init(config.transfer_queue)
    try:
        with tq.connect(tq.get_client().address) as client:
            got = client.config
            assert (got.consumer_batch_size, got.max_staleness, got.budget_staleness, got.stale_policy) == (
                64,
                1,
                budget,
                policy,
            )
            grant = client.acquire(96, timeout=5.0)  # (budget + version 0 + 1) x 64 samples may be in flight
            with pytest.raises(tq.TimeoutError):
                client.acquire(1, timeout=0.2)  # not one more until the trainer's version moves
            client.release(grant)
    finally:
        tq.close()


def test_main_composes_the_recipe_config():
    """`python -m recipes.verl.main` resolves its Hydra config (printed, not run: a run needs GPUs)."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.verl.main",
            "--cfg",
            "job",
            "--resolve",
            "trainer.v1.sampler.max_off_policy_threshold=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(CONFIG_DIR).parents[2],
    )
    assert out.returncode == 0, out.stderr
    assert "backend: sluice" in out.stdout and "max_off_policy_threshold: 3" in out.stdout


def test_sync_mode_is_on_policy():
    settings = knobs.sluice_settings(recipe_config("trainer.v1.trainer_mode=sync"))
    assert settings["max_staleness"] == 0


def test_sluice_is_a_registered_checkpoint_engine():
    assert CheckpointEngineRegistry.get("sluice") is SluiceCheckpointEngine


def tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def test_checkpoint_engine_moves_weights_exactly():
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}, "sluice": {"storage_capacity": "16MiB"}})
    sender = SluiceCheckpointEngine(bucket_size=1 << 20, is_master=True, transport="tcp")
    receiver = SluiceCheckpointEngine(bucket_size=1 << 20, transport="tcp", timeout=60.0)
    model = tiny_qwen2()

    async def sync_version(step: int) -> tuple[dict, dict[str, torch.Tensor]]:
        metrics = await sender.send_weights(((n, p.detach()) for n, p in model.state_dict().items()), global_steps=step)
        return metrics, {name: tensor.clone() async for name, tensor in receiver.receive_weights(global_steps=step)}

    try:
        for step in (1, 2, 3):
            with torch.no_grad():
                if step == 1:
                    for p in model.parameters():
                        p.add_(step)
                else:  # a few values of one tensor: versions 2 and 3 go as deltas over tcp
                    next(model.parameters()).view(-1)[:10] += step
            metrics, got = asyncio.run(sync_version(step))
            want = model.state_dict()
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n], want[n]) for n in want)
            if step == 1:
                assert "sluice/weight_sync/wire_bytes" not in metrics  # nothing pulled before it
            elif step == 2:  # version 1's pull: whole, nothing to compare it with
                assert metrics["sluice/weight_sync/wire_bytes"] == metrics["sluice/weight_sync/bytes"]
                assert metrics["sluice/weight_sync/density"] == 1.0
            else:  # version 2's pull: a delta of 10 values
                assert metrics["sluice/weight_sync/wire_bytes"] * 5 < metrics["sluice/weight_sync/bytes"]
                assert 0 < metrics["sluice/weight_sync/density"] < 0.05
        with tq.connect(sender.address) as client:
            assert client.version == 3  # the publisher moved Sluice's version clock
    finally:
        sender.close()
        receiver.close()
        tq.close()


def test_checkpoint_engine_carries_a_verl_fsdp2_engine_on_cpu(tmp_path):
    """A real verl FSDP2 trainer process (fsdp_cpu_trainer.py) publishes; this process receives."""
    import os
    import subprocess
    import sys

    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "qwen2")
    want = {n: t.clone() for n, t in model.state_dict().items()}
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}, "sluice": {"storage_capacity": "16MiB"}})
    receiver = SluiceCheckpointEngine(bucket_size=1 << 20, transport="tcp", timeout=120.0)
    trainer = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("fsdp_cpu_trainer.py")), str(tmp_path / "qwen2")],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )

    async def receive(step: int) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() async for name, tensor in receiver.receive_weights(global_steps=step)}

    try:
        first = asyncio.run(receive(1))
        assert first.keys() == want.keys()
        assert [n for n in want if not torch.equal(first[n], want[n])] == []  # the HF weights the engine loaded
        with tq.connect(receiver.address) as client:
            client.announce("recipes.verl.test/got-1", b"1")
        second = asyncio.run(receive(2))
        assert [n for n in want if not torch.equal(second[n], want[n] + 1.0)] == []  # after the update
        with tq.connect(receiver.address) as client:
            client.announce("recipes.verl.test/done", b"1")
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
        receiver.close()
        tq.close()
