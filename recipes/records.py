"""What a run records: one `StepRecord` per trainer step in `steps.jsonl`, totals in `run.json`.

`run.json`'s `interrupted` says whether the totals are a whole run's (false) or those of the
steps a run stopped by a signal had finished (true: wall time, samples, consumed and the final
version as they stood at the last step recorded, none of the step it stopped): long work leaves
its record either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .learner import RolloutBatch

__all__ = ["RunLog", "StepRecord"]


@dataclass
class StepRecord:
    """One line of `steps.jsonl`."""

    step: int
    time_s: float
    samples: int
    reward_mean: float
    samples_per_s: float
    tokens_per_s: float
    trainer_idle: float
    rollout_idle: float | None
    version: int
    staleness: dict[str, int]
    weight_sync_s: float
    spanned: int
    loss: float
    clip_frac: float
    behaviour_weight: float
    response_len: float

    @classmethod
    def of(
        cls,
        step: int,
        batch: RolloutBatch,
        stats: Mapping[str, float],
        *,
        elapsed: float,
        step_s: float,
        samples: int,
        trainer_idle: float,
        rollout_idle: float | None,
        version: int,
        staleness: Mapping[int, int],
        spans: Sequence[tuple[int, int]] = (),
        weight_sync_s: float = 0.0,
    ) -> StepRecord:
        """The record of one trainer step on `batch`: the timings given, the rest derived.

        `elapsed` is the run's wall time so far, `step_s` this step's; `samples` the total
        consumed; `staleness` counts the batch's samples by versions behind; `spans` is each
        sample's (first, last) policy version.
        """
        return cls(
            step=step,
            time_s=round(elapsed, 4),
            samples=samples,
            reward_mean=round(float(batch.rewards.mean()), 5),
            samples_per_s=round(samples / elapsed, 3),
            tokens_per_s=round(float(batch.lengths.sum()) / step_s, 1),
            trainer_idle=round(trainer_idle, 4),
            rollout_idle=None if rollout_idle is None else round(rollout_idle, 4),
            version=version,
            staleness={str(k): v for k, v in sorted(staleness.items())},
            weight_sync_s=round(weight_sync_s, 5),
            spanned=sum(1 for first, last in spans if last > first),
            loss=round(stats["loss"], 5),
            clip_frac=round(stats["clip_frac"], 4),
            behaviour_weight=round(stats["behaviour_weight"], 4),
            response_len=round(float(batch.lengths.float().mean()), 3),
        )


class RunLog:
    """Writes `steps.jsonl` line by line (flushed, so progress can be followed) and `run.json`
    into `out_dir` (nothing when it is ""), and hands each record to `on_step`. `last` is the
    last record written (None before the first): an interrupted run's totals are taken there."""

    def __init__(self, out_dir: str, on_step: Callable[[StepRecord], None] | None = None):
        self.out = Path(out_dir) if out_dir else None
        self.on_step = on_step
        self.last: StepRecord | None = None
        self._steps = None

    def __enter__(self) -> RunLog:
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            self._steps = self.out.joinpath("steps.jsonl").open("w")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._steps:
            self._steps.close()

    def write(self, record: StepRecord) -> StepRecord:
        if self._steps:
            self._steps.write(json.dumps(asdict(record)) + "\n")
            self._steps.flush()
        self.last = record
        if self.on_step:
            self.on_step(record)
        return record

    def finish(self, totals: dict[str, Any], interrupted: bool = False) -> dict[str, Any]:
        """Write `totals` to `run.json`, with `interrupted` (a signal stopped the run: the
        totals are those of the steps it finished); returns them so marked."""
        totals = {**totals, "interrupted": interrupted}
        if self.out:
            self.out.joinpath("run.json").write_text(json.dumps(totals, indent=1))
        return totals
