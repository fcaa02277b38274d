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

import functools
import math
import operator
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from .errors import SchemaError

__all__ = ["StalenessConfig", "Checked", "admission_limit"]


def admission_limit(staleness: float, version: int, consumer_batch_size: int) -> int:
    """AReaL's cap on samples accepted plus running under `version`:
    `(staleness + version + 1) * consumer_batch_size`, floored (verl's threshold is fractional).

    The controller's admission control and `StalenessConfig.max_samples_per_version` (at
    version 0) both count with it."""
    return math.floor((staleness + version + 1) * consumer_batch_size + 1e-9)


_BOUNDS = (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="), ("lt", operator.lt, "<"))


@functools.cache
def _constraints(cls: type) -> list[tuple[str, str, Callable[[Any, Any], bool], float]]:
    """(field, op, comparison, bound) for every numeric `msgspec.Meta` bound on `cls`'s fields."""
    out: list[tuple[str, str, Callable[[Any, Any], bool], float]] = []
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        kinds = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        for kind in kinds:
            if isinstance(kind, (msgspec.inspect.IntType, msgspec.inspect.FloatType)):
                out += [
                    (field.name, text, op, getattr(kind, name))
                    for name, op, text in _BOUNDS
                    if getattr(kind, name) is not None
                ]
    return out


class Checked(msgspec.Struct, frozen=True):
    """A settings struct whose `msgspec.Meta` bounds hold when built in Python, not only when
    decoded: the bounds are declared once, on the fields, and checked at both doors.

    Raises `SchemaError` naming the field and its bound."""

    def __post_init__(self) -> None:
        for name, text, op, bound in _constraints(type(self)):
            value = getattr(self, name)
            if value is not None and not op(value, bound):
                raise SchemaError(f"{name} must be {text} {bound}, got {value}")


class StalenessConfig(Checked, frozen=True):
    """How far rollout may run ahead of training, and how stale a consumed sample may be."""

    consumer_batch_size: Annotated[int, msgspec.Meta(gt=0)] = 64
    """Samples the trainer consumes per weight version."""
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """η: the most versions a consumed sample may lag the trainer (None: unbounded)."""
    budget_staleness: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """η of the admission budget; may be fractional (verl's threshold). Default: max_staleness."""
    partial_rollout: bool = False
    """Rollout workers interrupt generation on a new version and resume under the new weights."""
    follow_consumers: bool = True
    """Admission's `consumer_batch_size` grows to what the consumers really take per version
    (never below the value given); False pins it, and what it can never let in fails at once
    with `UnsatisfiableError` (see `controllers/admission.py`)."""

    @property
    def admission_staleness(self) -> float | None:
        """η of the admission budget: `budget_staleness`, else `max_staleness`."""
        return self.max_staleness if self.budget_staleness is None else self.budget_staleness

    @property
    def max_samples_per_version(self) -> int | None:
        """Samples that may be produced per version step, leftovers included (verl's
        `max_required_samples`); None when production is unbounded."""
        eta = self.admission_staleness
        return None if eta is None else admission_limit(eta, 0, self.consumer_batch_size)

    @classmethod
    def from_verl(
        cls,
        ppo_mini_batch_size: int,
        *,
        require_batches: int = 1,
        trigger_parameter_sync_step: int = 1,
        staleness_threshold: float | None = 0.0,
        partial_rollout: bool = False,
        max_staleness: int | None = None,
    ) -> StalenessConfig:
        """The same production budget as verl's fully-async trainer with these settings.

        `ppo_mini_batch_size` counts samples (prompts x responses per prompt), as verl's
        rollouter does after normalisation. `staleness_threshold=None` bounds admission by
        `max_staleness` instead. The recipes' schema (`recipes/config.py`) and verl's own
        config (`recipes/verl/knobs.py`) both map onto Sluice through here.

        Raises:
            SchemaError: a count is not positive, or the threshold or bound is negative.
        """
        for name, value in (
            ("ppo_mini_batch_size", ppo_mini_batch_size),
            ("require_batches", require_batches),
            ("trigger_parameter_sync_step", trigger_parameter_sync_step),
        ):
            if value <= 0:
                raise SchemaError(f"{name} must be > 0, got {value}")
        return cls(
            consumer_batch_size=ppo_mini_batch_size * require_batches * trigger_parameter_sync_step,
            max_staleness=max_staleness,
            budget_staleness=staleness_threshold,
            partial_rollout=partial_rollout,
        )
