"""How the recipe's losses learn from rollouts a fixed number of versions stale, without Sluice.

One process generates each step's rollouts with the weights of `lag` steps ago and trains on
them (the recipes' own task, engine and learner), so the effect of staleness on learning is
measured apart from any timing. Prints, per loss and lag, the final reward (mean of the last
10% of steps) and the first step whose mean reward passed 0.8, for each seed.

    python benchmarks/learning_under_lag.py --lags 0,2,8 --seeds 0,1,2 [key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics

import torch

from recipes.config import load
from recipes.engines import make_engine
from recipes.learner import Learner, RolloutBatch
from recipes.task import DigitReversal


def run(lag: int, seed: int, overrides: list[str]) -> tuple[float, int | None]:
    cfg = load([], [f"seed={seed}", *overrides])
    task, learner = DigitReversal(cfg.task), Learner(cfg)
    history = collections.deque([copy.deepcopy(learner.model.state_dict())], maxlen=lag + 1)
    behaviour = copy.deepcopy(learner.model)
    engine = make_engine(cfg, behaviour)
    prompts_gen, sample_gen = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed * 1009)
    rewards = []
    for _ in range(cfg.trainer.total_steps):
        behaviour.load_state_dict(history[0])  # the weights of `lag` steps ago
        prompts = task.prompts(cfg.prompts_per_step, prompts_gen).repeat_interleave(cfg.rollout.group_size, 0)
        gen = engine.generate(prompts, task.max_new_tokens, sample_gen)
        batch = RolloutBatch(prompts, gen.tokens, gen.logprobs, task.rewards(prompts, gen.tokens), gen.lengths)
        learner.step(batch)
        rewards.append(float(batch.rewards.mean()))
        history.append(copy.deepcopy(learner.model.state_dict()))
    tail = rewards[-max(1, len(rewards) // 10) :]
    return statistics.fmean(tail), next((i + 1 for i, r in enumerate(rewards) if r > 0.8), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lags", default="0,2,8")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--losses", default="decoupled,ppo")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'loss':10} {'lag':>4}  final reward per seed (first step > 0.8)")
    for loss in args.losses.split(","):
        for lag in (int(x) for x in args.lags.split(",")):
            results = [run(lag, int(s), [f"trainer.loss={loss}", *args.overrides]) for s in args.seeds.split(",")]
            cells = "  ".join(f"{final:.2f} ({hit or '-'})" for final, hit in results)
            print(f"{loss:10} {lag:>4}  {cells}", flush=True)


if __name__ == "__main__":
    main()
