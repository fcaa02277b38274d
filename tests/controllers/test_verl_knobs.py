"""verl's fully-async knobs: `StalenessConfig.from_verl` reproduces verl's production budget.

verl (`FullyAsyncRollouter`): required_samples = ppo_mini_batch_size × require_batches and
max_required_samples = int(required_samples × (staleness_threshold + 1) × trigger_parameter_sync_step);
after each parameter sync the samples still queued (leftovers of the old version) count against
the new budget.
"""

from __future__ import annotations

import pytest

import transfer_queue as tq
from tests.helpers import rows

# (ppo_mini_batch_size, require_batches, trigger_parameter_sync_step, staleness_threshold) -> max
# samples per sync, worked out by hand. The first rows are the settings of verl's fully-async docs
# (mini-batch 32 prompts, trigger 4, threshold 0 / 0.1 / 0.3 / 0.5), counted in prompts and in
# samples (x 16 responses per prompt).
HAND_COMPUTED = [
    ((32, 1, 4, 0.0), 128),  # 32 x 4 = 128: synchronous-like, no run-ahead
    ((32, 1, 4, 0.1), 140),  # 128 x 1.1 = 140.8 -> 140
    ((32, 1, 4, 0.3), 166),  # 128 x 1.3 = 166.4 -> 166
    ((32, 1, 4, 0.5), 192),  # 128 x 1.5 = 192
    ((512, 1, 4, 0.1), 2252),  # 2048 x 1.1 = 2252.8 -> 2252
    ((512, 1, 4, 0.3), 2662),  # 2048 x 1.3 = 2662.4 -> 2662
    ((512, 1, 4, 0.5), 3072),  # 2048 x 1.5 = 3072
    ((32, 2, 2, 0.5), 192),  # 64 x 2 x 1.5 = 192
    ((64, 1, 1, 1.0), 128),  # one-step off-policy: 64 x 2
]


@pytest.mark.parametrize(("settings", "expected"), HAND_COMPUTED, ids=[str(s) for s, _ in HAND_COMPUTED])
def test_from_verl_matches_hand_computed_budgets(settings, expected):
    mini, require, trigger, threshold = settings
    cfg = tq.StalenessConfig.from_verl(
        mini, require_batches=require, trigger_parameter_sync_step=trigger, staleness_threshold=threshold
    )
    assert cfg.max_samples_per_version == expected
    assert cfg.max_samples_per_version == int(mini * require * (threshold + 1) * trigger)  # verl's own expression
    assert cfg.consumer_batch_size == mini * require * trigger  # samples the trainer takes per sync
    assert cfg.budget_staleness == threshold
    assert cfg.max_staleness is None  # verl drops nothing unless asked


def test_from_verl_keeps_partial_rollout_and_an_optional_consumption_bound():
    cfg = tq.StalenessConfig.from_verl(
        32, trigger_parameter_sync_step=4, staleness_threshold=0.5, partial_rollout=True, max_staleness=2
    )
    assert cfg.partial_rollout is True and cfg.max_staleness == 2 and cfg.budget_staleness == 0.5


@pytest.mark.parametrize(
    "bad",
    [
        dict(ppo_mini_batch_size=0),
        dict(ppo_mini_batch_size=32, require_batches=0),
        dict(ppo_mini_batch_size=32, trigger_parameter_sync_step=-1),
        dict(ppo_mini_batch_size=32, staleness_threshold=-0.1),
    ],
)
def test_from_verl_refuses_impossible_settings(bad):
    with pytest.raises(tq.SchemaError):
        tq.StalenessConfig.from_verl(**bad)


@pytest.mark.parametrize("threshold", [0.1, 0.3, 0.5])
def test_a_cluster_configured_in_verl_terms_grants_verl_s_budget(make_cluster, threshold):
    """Threshold t, trigger 4, mini-batch 32: int(128 (1 + t)) samples under version 0; after the
    trainer consumes one sync's worth (128) and publishes version 1, the leftovers count against
    the new budget, so exactly 128 more may be produced, as in verl."""
    cfg = tq.StalenessConfig.from_verl(
        32, require_batches=1, trigger_parameter_sync_step=4, staleness_threshold=threshold, partial_rollout=True
    )
    first = int(128 * (1 + threshold))
    cluster = make_cluster(staleness=cfg)
    with cluster.connect() as rollout, cluster.connect() as trainer:
        assert rollout.config.partial_rollout is True and rollout.config.budget_staleness == threshold
        with rollout.acquire(first, timeout=5) as grant:
            rollout.put(rows(first), grant=grant)
        with pytest.raises(tq.TimeoutError):
            rollout.acquire(1, timeout=0.3)
        meta = trainer.get_meta(["x"], 128, task="train", timeout=10)
        trainer.ack(meta)
        trainer.set_version(1)
        leftovers = first - 128  # verl: still queued at the sync, counted against the new budget
        assert trainer.status()["admission"]["budget"] == first - leftovers == 128
        with rollout.acquire(128, timeout=5) as grant:
            rollout.put(rows(128, 1000), grant=grant)
        assert grant.version == 1
        with pytest.raises(tq.TimeoutError):
            rollout.acquire(1, timeout=0.3)
