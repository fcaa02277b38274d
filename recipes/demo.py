"""`python -m recipes.demo` (`make demo`): train a policy fully asynchronously through Sluice.

One run of `configs/fully_async.yaml` on the embedded default (controller and storage units as
local processes; no Ray, no external service): a rollout worker process generates digit
reversals with a tiny transformer inside the staleness budget (η = 2, partial rollout), the
trainer process streams whole GRPO groups, takes decoupled-PPO steps and publishes each new
version back through the weight channel. A progress bar follows the trainer; the closing
summary gives the mean reward at the start and at the end, samples/s, the worst staleness
consumed (checked against η) and the plot it wrote. Exit status 1 if an invariant failed.
Stopped by a signal, it still writes `run.json` (the totals of the steps done, `interrupted`
true) and the plot of those steps, then ends by that signal.

    python -m recipes.demo [--out results/demo] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from transfer_queue.host import stop_while_loading

stop_while_loading(__name__)  # before the heavy imports

import transfer_queue as tq  # noqa: E402

from .config import load  # noqa: E402
from .experiments import run_experiment  # noqa: E402
from .report import clear_records, load_steps, report_recorded, write_report  # noqa: E402

__all__ = ["main"]

WINDOW = 5
"""Steps averaged for the start and end rewards."""


def main(argv: Sequence[str] | None = None) -> int:
    tq.exit_on_signals()
    parser = argparse.ArgumentParser(prog="python -m recipes.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results/demo"), help="where the run and its plot go")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    out = args.out.resolve()  # the trainer and rollout worker run from the repository's root
    cfg = load(["fully_async"], args.overrides)
    run_dir = out / cfg.name
    runs = {cfg.seed: {cfg.name: run_dir}}
    for directory in (out, run_dir):
        clear_records(directory)  # a signal before the run wrote its records finds none of an earlier one's
    try:
        totals = run_experiment(cfg, run_dir)
    except (KeyboardInterrupt, SystemExit):  # a signal (`tq.exit_on_signals`): plot the steps recorded
        recorded = report_recorded(runs, out, baseline=cfg.name)
        if recorded:
            print(f"\ninterrupted: totals of the steps done in {run_dir / 'run.json'}; plot: {recorded[0]}", flush=True)
        raise
    png, _ = write_report(runs, out, baseline=cfg.name)
    steps = load_steps(run_dir)
    start = statistics.fmean(s["reward_mean"] for s in steps[:WINDOW])
    end = statistics.fmean(s["reward_mean"] for s in steps[-WINDOW:])
    worst = max(int(k) for s in steps for k in s["staleness"])
    final_versions = sorted({w["version"] for w in totals["rollout"]})
    problems = []
    if cfg.max_staleness is not None and worst > cfg.max_staleness:
        problems.append(f"a consumed sample was {worst} versions stale, over η = {cfg.max_staleness}")
    if totals["duplicates"]:
        problems.append(f"{totals['duplicates']} samples were consumed twice")
    if final_versions != [totals["final_version"]]:
        problems.append(
            f"rollout workers ended on versions {final_versions}, not the last published {totals['final_version']}"
        )
    print(f"\n{cfg.name}: {totals['samples']} samples in {totals['wall_s']:.1f} s, trainer and rollout overlapping")
    print(
        f"samples/s {totals['samples_per_s']:.0f}; worst staleness consumed {worst} (bound η = {cfg.max_staleness}); "
        f"{sum(s['spanned'] for s in steps)} samples spanned a weight update (partial rollout)"
    )
    print(f"weights: {totals['final_version']} versions published, workers ended on {final_versions}")
    print(
        f"steps: {run_dir / 'steps.jsonl'}; totals: {json.dumps({k: totals[k] for k in ('produced', 'consumed', 'dropped', 'left')})}"
    )
    print(f"reward {start:.2f} -> {end:.2f}")
    print(f"plot: {png}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
