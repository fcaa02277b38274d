"""Compare experiment runs: `compare.png` (curves and bars side by side), `summary.md` and
`summary.json` (a row per config: throughput, ratio to the baseline, final reward, staleness).

With several seeds, curves are means over seeds and figures are `mean ± std`; throughput ratios
to the baseline are taken seed by seed (runs of one seed ran back to back), then averaged. A run
a signal stopped (`interrupted` in its `run.json`) is compared over the steps it finished and
marked so; `report_recorded` compares whatever a stopped runner had recorded.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["RECORDS", "RunSummary", "clear_records", "load_steps", "report_recorded", "summarize", "write_report"]

FINAL_WINDOW = 0.1
"""Final reward = mean reward over this last fraction of steps (at equal samples for all runs)."""


RECORDS = ("steps.jsonl", "run.json", "compare.png", "summary.md", "summary.json")
"""What a run (`steps.jsonl`, `run.json`) and a comparison (the rest) write into a directory."""


def clear_records(directory: Path) -> None:
    """Remove the `RECORDS` a previous run or comparison left in `directory`, so that a run
    stopped before it wrote its own is not reported with the previous one's."""
    for name in RECORDS:
        (directory / name).unlink(missing_ok=True)


def load_steps(run_dir: Path) -> list[dict]:
    with (run_dir / "steps.jsonl").open() as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class RunSummary:
    name: str
    seeds: int
    samples: int
    samples_per_s: tuple[float, float]
    ratio: tuple[float, float] | None
    final_reward: tuple[float, float]
    worst_staleness: int
    trainer_idle: float
    rollout_idle: float | None
    dropped: int
    spanned: int
    interrupted: bool
    """Some seed's run was stopped by a signal: its figures cover the steps it finished."""


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _final_reward(steps: list[dict]) -> float:
    tail = steps[-max(1, int(len(steps) * FINAL_WINDOW)) :]
    return statistics.fmean(s["reward_mean"] for s in tail)


def summarize(runs: dict[int, dict[str, Path]], baseline: str) -> list[RunSummary]:
    """One row per config over all seeds."""
    names = list(next(iter(runs.values())))
    rows = []
    for name in names:
        per_seed = [(load_steps(d[name]), json.loads((d[name] / "run.json").read_text()), d) for d in runs.values()]
        rates = [totals["samples_per_s"] for _, totals, _ in per_seed]
        ratios = [
            totals["samples_per_s"] / json.loads((d[baseline] / "run.json").read_text())["samples_per_s"]
            for _, totals, d in per_seed
            if baseline in d
        ]
        idle_r = [s["rollout_idle"] for steps, _, _ in per_seed for s in steps if s["rollout_idle"] is not None]
        rows.append(
            RunSummary(
                name=name,
                seeds=len(per_seed),
                samples=per_seed[0][1]["samples"],
                samples_per_s=_mean_std(rates),
                ratio=_mean_std(ratios) if ratios else None,
                final_reward=_mean_std([_final_reward(steps) for steps, _, _ in per_seed]),
                worst_staleness=max(int(k) for steps, _, _ in per_seed for s in steps for k in s["staleness"]),
                trainer_idle=statistics.fmean(s["trainer_idle"] for steps, _, _ in per_seed for s in steps),
                rollout_idle=statistics.fmean(idle_r) if idle_r else None,
                dropped=sum(totals["dropped"] for _, totals, _ in per_seed),
                spanned=sum(s["spanned"] for steps, _, _ in per_seed for s in steps),
                interrupted=any(totals.get("interrupted", False) for _, totals, _ in per_seed),
            )
        )
    return rows


def _fmt(pair: tuple[float, float] | None, digits: int) -> str:
    if pair is None:
        return "-"
    mean, std = pair
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std else "")


def _markdown(rows: list[RunSummary], baseline: str) -> str:
    seeds = rows[0].seeds
    lines = [
        f"# Staleness experiments ({seeds} seed{'s' if seeds > 1 else ''}, {rows[0].samples} samples per run)",
        "",
        f"| config | samples/s | ratio to {baseline} | final reward | worst staleness | trainer idle | rollout idle | dropped | spanned |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        idle_r = "-" if r.rollout_idle is None else f"{r.rollout_idle:.2f}"
        name = f"{r.name} (interrupted)" if r.interrupted else r.name
        lines.append(
            f"| {name} | {_fmt(r.samples_per_s, 0)} | {_fmt(r.ratio, 2)} | {_fmt(r.final_reward, 3)} | "
            f"{r.worst_staleness} | {r.trainer_idle:.2f} | {idle_r} | {r.dropped} | {r.spanned} |"
        )
    lines += [
        "",
        f"final reward: mean reward over the last {FINAL_WINDOW:.0%} of trainer steps (equal samples for every run); "
        "idle: fraction of a step's wall time spent waiting; spanned: samples whose generation crossed a weight update.",
    ]
    return "\n".join(lines) + "\n"


def _mean_curve(runs: dict[int, dict[str, Path]], name: str, key: str) -> list[float]:
    curves = [[s[key] for s in load_steps(d[name])] for d in runs.values()]
    n = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(n)]


def _plot(runs: dict[int, dict[str, Path]], rows: list[RunSummary], png: Path) -> None:
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    names = [r.name for r in rows]
    for name in names:
        reward = _mean_curve(runs, name, "reward_mean")
        axes[0, 0].plot(_mean_curve(runs, name, "time_s")[: len(reward)], reward, label=name)
        axes[0, 1].plot(_mean_curve(runs, name, "samples")[: len(reward)], reward, label=name)
    axes[0, 0].set(title="reward vs wall time", xlabel="seconds", ylabel="mean reward")
    axes[0, 1].set(title="reward vs samples consumed", xlabel="samples", ylabel="mean reward")
    axes[0, 0].legend(fontsize=8)
    x = range(len(rows))
    axes[0, 2].bar(x, [r.samples_per_s[0] for r in rows], yerr=[r.samples_per_s[1] for r in rows], color="tab:blue")
    axes[0, 2].set(title="throughput (samples/s)", xticks=list(x))
    axes[0, 2].set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    width = 0.4
    axes[1, 0].bar([i - width / 2 for i in x], [r.trainer_idle for r in rows], width, label="trainer idle")
    axes[1, 0].bar([i + width / 2 for i in x], [r.rollout_idle or 0.0 for r in rows], width, label="rollout idle")
    axes[1, 0].set(title="idle fraction of wall time", xticks=list(x), ylim=(0, 1))
    axes[1, 0].set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    axes[1, 0].legend(fontsize=8)
    worst = max(r.worst_staleness for r in rows)
    width = 0.8 / len(rows)
    for i, name in enumerate(names):
        hist = [0] * (worst + 1)
        for d in runs.values():
            for s in load_steps(d[name]):
                for k, v in s["staleness"].items():
                    hist[int(k)] += v
        total = sum(hist) or 1
        axes[1, 1].bar(
            [k + (i - (len(rows) - 1) / 2) * width for k in range(worst + 1)],
            [h / total for h in hist],
            width,
            label=name,
        )
    axes[1, 1].set(
        title="staleness of consumed samples",
        xlabel="versions behind",
        ylabel="fraction",
        xticks=list(range(worst + 1)),
    )
    axes[1, 1].legend(fontsize=7)
    for name in names:
        axes[1, 2].plot(_mean_curve(runs, name, "samples_per_s"), label=name)
    axes[1, 2].set(title="cumulative samples/s by step", xlabel="trainer step", ylabel="samples/s")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def write_report(runs: dict[int, dict[str, Path]], out: Path, baseline: str) -> tuple[Path, Path]:
    """Write `compare.png`, `summary.md` and `summary.json` into `out`; returns the first two."""
    rows = summarize(runs, baseline)
    out.mkdir(parents=True, exist_ok=True)
    png, md = out / "compare.png", out / "summary.md"
    _plot(runs, rows, png)
    md.write_text(_markdown(rows, baseline))
    (out / "summary.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return png, md


def report_recorded(runs: dict[int, dict[str, Path]], out: Path, baseline: str) -> tuple[Path, Path] | None:
    """`write_report` over the runs of `runs` that recorded totals and at least one step (a
    runner stopped by a signal: those it finished and the one it stopped), keeping the configs
    every such seed recorded; returns its two files, or None when no run had a step recorded.
    The runs' directories must hold only this runner's records (`clear_records` before each
    run), or a previous run's would be reported as this one's."""
    recorded: dict[int, dict[str, Path]] = {}
    for seed, by_name in runs.items():
        kept = {name: d for name, d in by_name.items() if (d / "run.json").exists() and load_steps(d)}
        if kept:
            recorded[seed] = kept
    names = set.intersection(*(set(d) for d in recorded.values())) if recorded else set()
    if not names:
        return None
    common = {seed: {n: d for n, d in by_name.items() if n in names} for seed, by_name in recorded.items()}
    return write_report(common, out, baseline)
