"""verl's async knobs → Sluice's staleness control (`tq.StalenessConfig`), written into the
`transfer_queue.sluice` section that `tq.init(config.transfer_queue)` hands to Sluice.

| verl knob | Sluice |
| --- | --- |
| `data.train_batch_size` x `rollout.n` x `require_batches` x sync steps | `consumer_batch_size`: samples consumed per weight version |
| `async_training.trigger_parameter_sync_step`, else V1's `separate_async.parameter_sync_step` (1 for other modes) | training steps per version, in `consumer_batch_size` |
| `async_training.staleness_threshold` | `budget_staleness`: admission lets producers run that fraction of a version ahead |
| `trainer.v1.sampler.max_off_policy_threshold` T (global steps a trajectory may span) | `max_staleness = ceil((T - 1) / sync steps)` versions; null: unbounded; V1 `sync` mode: 0 |
| `max_off_policy_strategy: drop` | `stale_policy="drop"`: too-stale samples are dropped (counted) |
| `max_off_policy_strategy: wait` | `stale_policy="keep"` and admission bounded by `max_staleness` too: nothing is produced that could become too stale, so nothing is dropped |
| `async_training.partial_rollout` | `partial_rollout` |
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

import transfer_queue as tq

__all__ = ["staleness_from_verl", "sluice_settings", "apply"]


def _get(config: Any, path: str, default: Any = None) -> Any:
    node = config
    for part in path.split("."):
        if node is None or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def staleness_from_verl(config: Any) -> tuple[tq.StalenessConfig, str]:
    """The `StalenessConfig` and stale policy that give verl's knobs in `config` in Sluice's terms.

    Raises `tq.SchemaError` for an unknown `max_off_policy_strategy`.
    """
    mode = _get(config, "trainer.v1.trainer_mode", "sync")
    sync_steps = int(
        _get(config, "async_training.trigger_parameter_sync_step")
        or (_get(config, "trainer.v1.separate_async.parameter_sync_step", 1) if mode == "separate_async" else 1)
    )
    samples_per_step = int(_get(config, "data.train_batch_size", 1)) * int(
        _get(config, "actor_rollout_ref.rollout.n", 1)
    )
    threshold = _get(config, "trainer.v1.sampler.max_off_policy_threshold")
    strategy = _get(config, "trainer.v1.sampler.max_off_policy_strategy", "drop")
    if strategy not in ("drop", "wait"):
        raise tq.SchemaError(f"trainer.v1.sampler.max_off_policy_strategy must be drop or wait, got {strategy!r}")
    if mode == "sync":
        max_staleness = 0
    elif threshold is None:
        max_staleness = None
    else:
        max_staleness = math.ceil(max(int(threshold) - 1, 0) / sync_steps)
    staleness = tq.StalenessConfig.from_verl(
        samples_per_step,
        require_batches=int(_get(config, "async_training.require_batches", 1)),
        trigger_parameter_sync_step=sync_steps,
        staleness_threshold=float(_get(config, "async_training.staleness_threshold", 0.0)),
        partial_rollout=bool(_get(config, "async_training.partial_rollout", False)),
        max_staleness=max_staleness,
    )
    if strategy == "wait" and max_staleness is not None:
        budget = staleness.budget_staleness
        staleness = msgspec.structs.replace(
            staleness, budget_staleness=min(budget, max_staleness) if budget is not None else max_staleness
        )
    return staleness, "keep" if strategy == "wait" else "drop"


def sluice_settings(config: Any) -> dict[str, Any]:
    """Sluice `init` keywords for verl's knobs: staleness, consumer batch size, stale policy."""
    staleness, policy = staleness_from_verl(config)
    return {**msgspec.structs.asdict(staleness), "stale_policy": policy}


def apply(config: Any) -> dict[str, Any]:
    """Write `sluice_settings(config)` into `config.transfer_queue.sluice` (kept keys win) and return them."""
    from omegaconf import open_dict

    settings = sluice_settings(config)
    with open_dict(config):
        if config.transfer_queue.get("sluice") is None:
            config.transfer_queue.sluice = {}
        for key, value in settings.items():
            if key not in config.transfer_queue.sluice or config.transfer_queue.sluice[key] is None:
                config.transfer_queue.sluice[key] = value
    return settings
