"""The co-located synchronous baseline: one process, both cores, no Sluice.

Generate a step's rollouts with the weights being trained, then train on them, and repeat;
generation and training share the process's cores (`torch.set_num_threads(2)` here), so the
comparison with the async runs, which pin a rollout worker and a trainer to one core each,
is honest about what a single process could already do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import RecipeConfig
from .engines import make_engine
from .learner import Learner, RolloutBatch
from .records import RunLog, StepRecord
from .task import DigitReversal

__all__ = ["run_colocated"]


def run_colocated(cfg: RecipeConfig, on_step: Callable[[StepRecord], None] | None = None) -> dict[str, Any]:
    """Run `trainer.total_steps` generate-then-train steps; returns the totals (`run.json`). A
    signal that stops it mid-way still leaves `run.json`, for the steps it finished, marked
    `interrupted`."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    task = DigitReversal(cfg.task)
    learner = Learner(cfg)
    engine = make_engine(cfg, learner.model)
    prompts_gen = torch.Generator().manual_seed(cfg.seed + 1)
    sample_gen = torch.Generator(engine.device).manual_seed(cfg.seed * 1009)
    group, width = cfg.rollout.group_size, task.max_new_tokens
    start, samples = time.perf_counter(), 0
    with RunLog(cfg.out_dir, on_step) as log:
        try:
            for step in range(1, cfg.trainer.total_steps + 1):
                t0 = time.perf_counter()
                prompts = task.prompts(cfg.prompts_per_step, prompts_gen).repeat_interleave(group, 0).to(engine.device)
                # generation batches shaped as a rollout worker's, so the comparison is like for like
                gens = [
                    engine.generate(chunk, width, sample_gen)
                    for chunk in prompts.split(cfg.rollout.prompts_per_batch * group)
                ]
                tokens = torch.cat([g.tokens for g in gens])
                batch = RolloutBatch(
                    prompts,
                    tokens,
                    torch.cat([g.logprobs for g in gens]),
                    task.rewards(prompts, tokens),
                    torch.cat([g.lengths for g in gens]),
                )
                t1 = time.perf_counter()
                stats = learner.step(batch)
                now = time.perf_counter()
                samples += len(batch)
                log.write(
                    StepRecord.of(
                        step,
                        batch,
                        stats,
                        elapsed=now - start,
                        step_s=now - t0,
                        samples=samples,
                        trainer_idle=(t1 - t0) / (now - t0),
                        rollout_idle=(now - t1) / (now - t0),
                        version=step,
                        staleness={0: len(batch)},
                    )
                )
        except (KeyboardInterrupt, SystemExit):  # a signal (`tq.exit_on_signals`): keep what the steps made
            last = log.last  # the totals of the steps finished, not of the one stopped
            log.finish(
                _totals(cfg.name, last.time_s, last.samples, last.step) if last else _totals(cfg.name, 0.0, 0, 0),
                interrupted=True,
            )
            raise
        return log.finish(_totals(cfg.name, time.perf_counter() - start, samples, cfg.trainer.total_steps))


def _totals(name: str, wall: float, samples: int, steps: int) -> dict[str, Any]:
    """`run.json` after `steps` steps of `samples` in all: the same fields as an async run's,
    with nothing stale, dropped or left over."""
    return {
        "name": name,
        "wall_s": round(wall, 3),
        "samples": samples,
        "samples_per_s": round(samples / wall, 3) if wall else 0.0,
        "final_version": steps,
        "consumed": samples,
        "duplicates": 0,
        "produced": samples,
        "dropped": 0,
        "left": 0,
        "max_staleness": 0,
        "served_staleness": {"0": samples},
        "rollout": [],
    }
