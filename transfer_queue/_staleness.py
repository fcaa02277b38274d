"""Staleness settings in Sluice's terms (AReaL's η) and in verl's fully-async terms.

Sluice's rule (AReaL): producers get generation slots only while

    accepted + running <= (budget_staleness + version + 1) * consumer_batch_size

and a consumer never receives a sample more than `max_staleness` versions older than the
trainer. verl's fully-async trainer bounds production per parameter sync instead:

    max samples per sync = ppo_mini_batch_size * require_batches
                           * (1 + staleness_threshold) * trigger_parameter_sync_step

with leftovers of the old version counted against the new budget. Both are the same budget
once `consumer_batch_size` is the samples the trainer consumes per version
(`ppo_mini_batch_size * require_batches * trigger_parameter_sync_step`) and
`budget_staleness = staleness_threshold`: the accepted-minus-consumed count carries leftovers
across versions. verl drops nothing, so `from_verl` leaves consumption unbounded unless you
pass `max_staleness` as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ._errors import SchemaError

__all__ = ["StalenessConfig"]


@dataclass(frozen=True)
class StalenessConfig:
    """How far rollout may run ahead of training, and how stale a consumed sample may be."""

    consumer_batch_size: int = 64
    """Samples the trainer consumes per weight version."""
    max_staleness: int | None = None
    """η: the most versions a consumed sample may lag the trainer (None: unbounded)."""
    budget_staleness: float | None = None
    """η of the admission budget; may be fractional (verl's threshold). Default: max_staleness."""
    partial_rollout: bool = False
    """Rollout workers interrupt generation on a new version and resume under the new weights."""

    def __post_init__(self) -> None:
        if self.consumer_batch_size <= 0:
            raise SchemaError(f"consumer_batch_size must be > 0, got {self.consumer_batch_size}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise SchemaError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.budget_staleness is not None and self.budget_staleness < 0:
            raise SchemaError(f"budget_staleness must be >= 0 or None, got {self.budget_staleness}")

    @property
    def admission_staleness(self) -> float | None:
        return self.max_staleness if self.budget_staleness is None else self.budget_staleness

    @property
    def max_samples_per_version(self) -> int | None:
        """Samples that may be produced per version step, leftovers included (verl's
        `max_required_samples`); None when production is unbounded."""
        eta = self.admission_staleness
        return None if eta is None else math.floor((1 + eta) * self.consumer_batch_size + 1e-9)

    @classmethod
    def from_verl(
        cls,
        ppo_mini_batch_size: int,
        *,
        require_batches: int = 1,
        trigger_parameter_sync_step: int = 1,
        staleness_threshold: float = 0.0,
        partial_rollout: bool = False,
        max_staleness: int | None = None,
    ) -> "StalenessConfig":
        """The same production budget as verl's fully-async trainer with these settings.

        `ppo_mini_batch_size` counts samples (prompts x responses per prompt), as verl's
        rollouter does after normalisation.
        """
        for name, value in (("ppo_mini_batch_size", ppo_mini_batch_size), ("require_batches", require_batches),
                            ("trigger_parameter_sync_step", trigger_parameter_sync_step)):
            if value <= 0:
                raise SchemaError(f"{name} must be > 0, got {value}")
        return cls(
            consumer_batch_size=ppo_mini_batch_size * require_batches * trigger_parameter_sync_step,
            max_staleness=max_staleness,
            budget_staleness=staleness_threshold,
            partial_rollout=partial_rollout,
        )
