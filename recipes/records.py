"""What a run records: one `StepRecord` per trainer step in `steps.jsonl`, totals in `run.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

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


class RunLog:
    """Writes `steps.jsonl` line by line (flushed, so progress can be followed) and `run.json`
    into `out_dir` (nothing when it is ""), and hands each record to `on_step`."""

    def __init__(self, out_dir: str, on_step: Callable[[StepRecord], None] | None = None):
        self.out = Path(out_dir) if out_dir else None
        self.on_step = on_step
        self._steps = None

    def __enter__(self) -> "RunLog":
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
        if self.on_step:
            self.on_step(record)
        return record

    def finish(self, totals: dict[str, Any]) -> dict[str, Any]:
        if self.out:
            self.out.joinpath("run.json").write_text(json.dumps(totals, indent=1))
        return totals
