"""What the trainer and the rollout workers share through the cluster, and nothing else.

They never talk to each other directly: prompts and rollouts go through two partitions, the
weights through `weight_sync`, and these small records through `announce`/`lookup`.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "FIELDS",
    "PROMPTS",
    "PROMPT_SLACK",
    "ROLLOUT_TASK",
    "STOP_KEY",
    "TRAIN",
    "WEIGHTS_KEY",
    "TRAIN_TASK",
    "RolloutStats",
    "rollout_key",
]

PROMPTS, TRAIN = "prompts", "train"
"""Partitions: prompts the trainer feeds, rollouts the workers put."""
ROLLOUT_TASK, TRAIN_TASK = "rollout", "actor_update"
FIELDS = ["prompts", "responses", "logprobs", "rewards"]
STOP_KEY = "recipes/stop"
"""Announced by the trainer when it is done; the value is the final version (msgpack int)."""
WEIGHTS_KEY = "recipes/weights"
"""Announced by the trainer once it published its first weights; the value is their version
(msgpack int). A rollout worker waits for it before it asks the weight channel for anything,
so that its thread only ever waits for weights that exist, and a stop never waits on it."""
PROMPT_SLACK = 1.5
"""Prompts fed per prompt consumed: room for rollouts produced ahead and dropped as too stale."""


def rollout_key(worker: int, done: bool = False) -> str:
    """Where rollout worker `worker` announces its `RolloutStats` (after every batch, and
    under the `done` key once it holds the final version and is leaving)."""
    return f"recipes/rollout/{worker}" + ("/done" if done else "")


class RolloutStats(msgspec.Struct):
    """A rollout worker's running totals, announced after every batch."""

    worker: int
    samples: int = 0
    batches: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    idle_s: float = 0.0
    """Seconds waiting for budget, prompts or weights."""
    spans: int = 0
    """Samples whose generation spanned more than one version (partial rollout)."""
    version: int = -1
    """Weights the worker holds."""
    weight_apply_s: float = 0.0
    late_acks: int = 0
    """Batches whose prompts' lease expired during generation and some of whose prompts another
    worker leased and generated too (their ack raised `tq.LeaseExpiredError`)."""
    weight_retries: int = 0
    """Weight transfers that failed and were tried again (`tq.WeightSyncError`)."""
    finished: bool = False
