"""Recipe configs: every shipped YAML loads, overrides apply, bad input is a typed error, and
verl's async knobs land on the right staleness settings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import transfer_queue as tq
from recipes.config import CONFIG_DIR, load

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_the_contract_configs_ship():
    assert {"sync", "one_step_off", "fully_async"} <= set(SHIPPED)
    assert {f"fully_async_eta{e}" for e in (0, 1, 4, 8)} <= set(SHIPPED)
    assert {"fully_async_no_partial", "eta8_ppo", "eta8_decoupled", "colocated_sync"} <= set(SHIPPED)
    assert {"verl_threshold_01", "verl_threshold_03", "verl_threshold_05"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_config_loads_and_is_named_after_its_file(name):
    cfg = load([name])
    assert cfg.name == name
    assert cfg.staleness().consumer_batch_size == cfg.samples_per_step * cfg.async_training.trigger_parameter_sync_step


def test_overrides_use_verl_keys_and_sluice_eta():
    cfg = load(
        ["fully_async"],
        [
            "trainer.total_steps=7",
            "seed=3",
            "async_training.trigger_parameter_sync_step=2",
            "async_training.require_batches=2",
            "max_staleness=4",
        ],
    )
    assert (cfg.trainer.total_steps, cfg.seed, cfg.max_staleness) == (7, 3, 4)
    s = cfg.staleness()
    assert cfg.samples_per_step == 32 * 8 * 2
    assert s.consumer_batch_size == 32 * 8 * 2 * 2  # samples per version
    assert (s.max_staleness, s.admission_staleness, s.partial_rollout) == (4, 4, True)


def test_verl_threshold_sets_the_admission_budget_like_verl():
    cfg = load(["verl_threshold_03"])
    s = cfg.staleness()
    verl = tq.StalenessConfig.from_verl(ppo_mini_batch_size=32 * 8, staleness_threshold=0.3, partial_rollout=True)
    assert s.max_samples_per_version == verl.max_samples_per_version == int(1.3 * 256)
    assert s.max_staleness is None  # verl drops nothing


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["trainer.no_such_knob=1"], "no_such_knob"),
        (["trainer.total_steps=many"], "total_steps"),
        (["trainer.total_steps=0"], "total_steps"),
        (["rollout.engine=hf"], "model.family=qwen2"),
        (["trainer.loss=reinforce"], "trainer.loss"),
        (["model.device=tpu"], "model.device='tpu'"),
        (["model.device=meta"], "choose cpu, cuda or cuda:N"),
    ],
)
def test_bad_overrides_are_schema_errors_that_name_the_key(override, fragment):
    with pytest.raises(tq.SchemaError, match=fragment):
        load(["sync"], override)


def test_a_missing_config_file_is_a_schema_error():
    with pytest.raises(tq.SchemaError, match="no config file"):
        load(["no_such_config"])


def test_cuda_on_a_machine_without_it_is_a_schema_error_that_says_so():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(tq.SchemaError, match=r"model\.device='cuda': this machine has no CUDA device"):
        load(["fully_async"], ["model.device=cuda"])


def test_the_weight_transport_follows_the_device():
    """`rollout.transport=auto` publishes over cuda_ipc from a CUDA policy, over the host
    transports from a CPU one; a named transport serves both sides."""
    cpu = load(["fully_async"], ["model.device=cpu"])
    assert cpu.device == torch.device("cpu") and cpu.publisher_transport == "auto"
    gpu = replace(cpu, model=replace(cpu.model, device="cuda:0"))  # not loaded: no CUDA check
    assert gpu.publisher_transport == "cuda_ipc"
    named = replace(gpu, rollout=replace(gpu.rollout, transport="shm"))
    assert named.publisher_transport == "shm"
