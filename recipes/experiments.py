"""Run staleness experiments one after another, with equal resources, and compare them.

    python -m recipes.experiments sync.yaml one_step_off.yaml fully_async.yaml --out results/exp \
        [--seeds 0,1,2] [key=value ...]

Each async run gets a fresh embedded cluster (controller and storage units as local processes),
its rollout workers pinned to the first core and its trainer to the last (the same processes on
the same cores for every config), and the same sample budget (`trainer.total_steps` steps of
the same size). A co-located config (`mode: colocated`) runs in one process on every core.
Progress shows as a bar per run. Per run `DIR/<name>/` holds `steps.jsonl` (one record per
trainer step), `run.json` (totals), the resolved config, and each process's log; then
`DIR/compare.png` and `DIR/summary.md` compare the runs. With several seeds, each seed's runs
go under `DIR/seed-<s>/` and the comparison reports mean ± spread over seeds. Stopped by a
signal, it still compares the runs recorded so far, the one it stopped marked `interrupted`
in its `run.json` (`report.report_recorded`), then ends by that signal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from transfer_queue.host import die_with_parent, stop_processes, stop_while_loading

stop_while_loading(__name__)  # before the heavy imports

from tqdm import tqdm  # noqa: E402

import transfer_queue as tq  # noqa: E402

from .colocated import run_colocated  # noqa: E402
from .config import RecipeConfig, load, to_yaml  # noqa: E402
from .records import StepRecord  # noqa: E402
from .report import clear_records, report_recorded, write_report  # noqa: E402

__all__ = ["ExperimentError", "run_experiment", "main"]

PROCESS_TIMEOUT = 60.0
"""Seconds to wait for the rollout workers to leave once the trainer finished, and for a
stopped run's processes to unwind before they are killed."""


class ExperimentError(RuntimeError):
    """A run's trainer or rollout worker failed; the message names it and its log."""


def run_experiment(cfg: RecipeConfig, out: Path, progress: bool = True) -> dict[str, Any]:
    """Run one config into `out` (`steps.jsonl`, `run.json`, logs); returns the totals. The
    records a previous run left in `out` go first: a run stopped before it wrote its own has
    none, rather than the previous run's."""
    out.mkdir(parents=True, exist_ok=True)
    clear_records(out)
    cfg = replace(cfg, out_dir=str(out))
    config_file = out / f"{cfg.name}.yaml"
    config_file.write_text(to_yaml(cfg))
    bar = tqdm(
        total=cfg.trainer.total_steps,
        desc=f"{cfg.name} (seed {cfg.seed})",
        unit="step",
        disable=not progress,
        dynamic_ncols=True,
        leave=True,
    )
    try:
        if cfg.mode == "colocated":
            return run_colocated(cfg, lambda r: _advance(bar, r))
        return _run_async(cfg, out, config_file, bar)
    finally:
        bar.close()


def _run_async(cfg: RecipeConfig, out: Path, config_file: Path, bar: tqdm) -> dict[str, Any]:
    cores = sorted(os.sched_getaffinity(0))
    c = cfg.cluster
    with tq.init(
        c.units,
        c.capacity,
        staleness=cfg.staleness(),
        lease_timeout=c.lease_timeout,
        grant_timeout=c.grant_timeout,
        stale_policy=c.stale_policy,
    ) as cluster:  # type: ignore[arg-type]
        procs: list[subprocess.Popen] = []  # each one as it starts: a signal mid-way stops those started
        try:
            for i in range(cfg.rollout.workers):
                procs.append(
                    _spawn(
                        "recipes.rollout_worker",
                        ["--address", cluster.address, "--worker-id", str(i), str(config_file)],
                        cores[0],
                        out / f"rollout-{i}.log",
                    )
                )
            trainer = _spawn(
                "recipes.async_trainer",
                ["--address", cluster.address, str(config_file)],
                cores[-1],
                out / "trainer.log",
                pipe=True,
            )
            procs.append(trainer)
            totals = None
            for line in trainer.stdout:  # type: ignore[union-attr]
                if line.startswith("{"):
                    record = json.loads(line)
                    if "totals" in record:
                        totals = record["totals"]
                    else:
                        _advance(bar, StepRecord(**record))
            if trainer.wait() != 0 or totals is None:
                raise ExperimentError(
                    f"{cfg.name}: the trainer failed (exit {trainer.returncode}); see {out / 'trainer.log'}"
                )
            for i, worker in enumerate(procs[:-1]):  # the rollout workers
                if worker.wait(PROCESS_TIMEOUT) != 0:
                    raise ExperimentError(
                        f"{cfg.name}: rollout worker {i} failed (exit {worker.returncode}); see {out}/rollout-{i}.log"
                    )
        finally:
            stop_processes(procs, PROCESS_TIMEOUT)
        return totals


def _spawn(module: str, args: list[str], core: int, log: Path, pipe: bool = False) -> subprocess.Popen:
    """Start `python -m module args` pinned to `core`; stderr (and stdout unless piped) to `log`.
    In a session of its own: a terminal's Ctrl-C reaches only this runner, which stops it
    (`stop_processes`) once, so no second signal cuts its cleanup short; and ended with the runner all the
    same (`die_with_parent`), killed or hung up on as it may be."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    sink = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=root,
        env=env,
        text=True,
        stdout=subprocess.PIPE if pipe else sink,
        stderr=sink,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )
    os.sched_setaffinity(proc.pid, {core})
    sink.close()
    return proc


def _advance(bar: tqdm, record: StepRecord) -> None:
    bar.update(1)
    bar.set_postfix(
        reward=f"{record.reward_mean:.3f}", samples_s=f"{record.samples_per_s:.0f}", v=record.version, refresh=False
    )


def main(argv: Sequence[str] | None = None) -> int:
    tq.exit_on_signals()
    parser = argparse.ArgumentParser(prog="python -m recipes.experiments", description=__doc__.split("\n\n")[0])
    parser.add_argument("items", nargs="+", metavar="CONFIG.yaml|key=value")
    parser.add_argument("--out", required=True, type=Path, help="directory for the runs, compare.png and summary.md")
    parser.add_argument(
        "--seeds", default=None, help="comma-separated seeds, each running every config (default: `seed`)"
    )
    args = parser.parse_intermixed_args(argv)
    files = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    if not files:
        parser.error("name at least one CONFIG.yaml")
    configs = [load([f], overrides) for f in files]
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        parser.error(f"config names must differ: {names}")
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [configs[0].seed]
    out = args.out.resolve()  # the trainer and rollout workers run from the repository's root
    runs = {
        seed: {cfg.name: (out if len(seeds) == 1 else out / f"seed-{seed}") / cfg.name for cfg in configs}
        for seed in seeds
    }
    for directory in [out, *(d for by_name in runs.values() for d in by_name.values())]:
        clear_records(directory)  # a signal before a run wrote its records finds none of an earlier one's
    baseline = "sync" if "sync" in names else names[0]
    try:
        for seed in seeds:  # seeds outermost: machine drift hits every config alike
            for cfg in configs:
                run_experiment(replace(cfg, seed=seed), runs[seed][cfg.name])
    except (KeyboardInterrupt, SystemExit):  # a signal (`tq.exit_on_signals`): compare what was recorded
        recorded = report_recorded(runs, out, baseline)
        if recorded:
            print(f"interrupted: wrote {recorded[0]} and {recorded[1]} from the runs recorded so far", flush=True)
        raise
    png, summary = write_report(runs, out, baseline)
    print(summary.read_text())
    print(f"wrote {png} and {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
