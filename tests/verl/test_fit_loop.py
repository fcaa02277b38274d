"""verl 0.9.1's own `PPOTrainer.fit()` (V1 trainer, `trainer_mode=colocate_async` and
`separate_async`) for two steps with Sluice as `transfer_queue`.

Only what needs a GPU is replaced (fit_loop_parts.py: the LLM server, the reward model, the actor
worker group's model calls, the weight-sync manager). Everything else is verl's: the trainer
submits prompts (`kv_batch_put`), verl's agent loop worker writes trajectories
(`async_kv_put`/`async_kv_batch_put`), `ReplayBufferAsync.sample` picks finished groups,
`_balance_batch` pads and reorders, the worker group dispatches through
`BatchData.chunk`/`concat` and `tqbridge`, advantages are computed from what the store returns,
the actor update reads its fields by meta, and each step ends with `kv_clear`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")

from hydra import compose, initialize_config_module  # noqa: E402
from verl.trainer.ppo.v1.trainer_base import get_trainer_cls  # noqa: E402
from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode  # noqa: E402

import transfer_queue as tq  # noqa: E402

from . import fit_loop_parts as parts  # noqa: E402

PROMPTS, N, DP = 4, 2, 2  # prompts per step, responses per prompt, actor data-parallel ranks
ROWS = PROMPTS * N
UPDATES = {"colocate_async": 1, "separate_async": 2}  # actor updates per step (parameter_sync_step)


def verl_config(mode: str):
    updates = UPDATES[mode]
    overrides = [
        f"trainer.v1.trainer_mode={mode}",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console]",
        "trainer.device=cpu",
        f"data.train_batch_size={PROMPTS}",
        "algorithm.adv_estimator=grpo",  # no critic: `values` is never written
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={parts.ECHO_AGENT}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS // updates}",
        f"trainer.v1.separate_async.parameter_sync_step={updates}",
        # separate_async: rollout only on its own (standalone) replicas, synced by a non-naive engine
        "actor_rollout_ref.hybrid_engine=False",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        "actor_rollout_ref.actor.use_kl_loss=False",  # no reference model: `ref_log_prob` is never written
        "transfer_queue.enable=True",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
        "+transfer_queue.sluice.storage_capacity=64MiB",
    ]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=overrides)


@pytest.fixture(params=list(UPDATES))
def sluice(request):
    """Sluice from verl's `transfer_queue` config, then a CPU-only local Ray (verl's dispatch puts
    each rank's chunk into Ray's object store)."""
    conf = verl_config(request.param)
    tq.init(conf.transfer_queue)
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield conf
    finally:
        ray.shutdown()
        tq.close()


def test_fit_runs_two_steps_through_sluice(sluice, monkeypatch):
    config = sluice
    mode = config.trainer.v1.trainer_mode
    server, calls = parts.LLMServer(), []
    workers = [parts.AgentLoopWorker(config, server, parts.RuleReward()) for _ in range(2)]
    trainer = get_trainer_cls(mode)(config)
    # what `trainer.init()` builds on GPUs, built here on the CPU
    trainer.tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    trainer.processor = None
    trainer.train_dataloader = parts.DataLoader(parts.prompts(64), PROMPTS)
    trainer.train_dataloader_it = None
    trainer.steps_per_epoch = trainer.total_training_steps = 2
    trainer.ref_in_actor = False
    trainer.distillation_config = None
    trainer.actor_rollout_wg = parts.LocalWorkerGroup([parts.CpuActor(r, calls) for r in range(DP)])
    trainer.reward_loop_manager = SimpleNamespace(reward_loop_worker_handles=workers[0].reward_loop_worker_handles)
    trainer.checkpoint_manager = trainer.standalone_checkpoint_manager = parts.CheckpointManager(server)
    trainer.current_mode = HybridEngineMode.TRAINER  # separate_async without hybrid replicas
    trainer.resource_pool_manager = SimpleNamespace(get_n_gpus=lambda: DP)
    trainer._init_dump_executor()
    trainer._load_checkpoint()  # resume_mode=disable: step 0
    trainer.on_init_end()

    cleared: list[dict] = []  # after each step's kv_clear: what the store still holds
    consumed: list[set[str]] = []
    kv_clear = tq.kv_clear

    def spy_clear(keys, partition_id):
        kv_clear(keys=keys, partition_id=partition_id)
        if any("_" in k for k in keys):  # the step-end clear of trajectory keys
            consumed.append(set(keys))
            cleared.append(tq.kv_list(partition_id).get(partition_id, {}))

    monkeypatch.setattr(tq, "kv_clear", spy_clear)
    try:
        trainer.fit(parts.AgentLoopManager(workers))
    finally:
        for w in workers:
            w.stop()

    assert trainer.global_steps == 3 and trainer.checkpoint_manager.updates == [0, 1, 2]
    per_update = ROWS // UPDATES[mode] // DP  # rows one rank gets in one update
    updates = [c for c in calls if c.method == "update_actor"]
    log_probs = [c for c in calls if c.method == "compute_log_prob"]
    assert len(updates) == len(log_probs) == 2 * UPDATES[mode] * DP  # every update, every rank
    for call in updates:
        assert call.rows == per_update
        assert {"input_ids", "responses", "response_mask", "old_log_probs", "advantages"} <= call.fields
        assert not {"values", "ref_log_prob"} & call.fields  # never produced in this run
        assert call.info["global_batch_size"] == ROWS // UPDATES[mode]
    assert all(c.rows == per_update and "input_ids" in c.fields for c in log_probs)
    if mode == "separate_async":  # pi_old kept for the second mini-batch of each step
        assert [c.info["slot"] for c in calls if c.method == "restore_model_from_cpu" and c.rank == 0] == [0, 1] * 2
    # the store after each step: none of the step's trajectories, none of its prompt groups
    assert len(consumed) == 2 and all(len(keys) == ROWS for keys in consumed)
    for keys, left in zip(consumed, cleared, strict=True):
        uids = {k.split("_")[0] for k in keys}
        assert len(uids) == PROMPTS and not keys & set(left) and not uids & set(left)
        assert all(tag.get("is_prompt") or k.split("_")[0] not in uids for k, tag in left.items())
    assert server.generated >= 2 * ROWS
    for keys in consumed:  # verl's key layout `{uid}_{session}_{index}`, every session of each group
        sessions = sorted(k.split("_", 1)[1] for k in keys)
        assert sessions == sorted([f"{s}_0" for s in range(N)] * PROMPTS)
