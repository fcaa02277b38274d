"""`python -m recipes.dataflow_demo` end to end, as `make demo` runs it (smaller)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
DEMO = [sys.executable, "-m", "recipes.dataflow_demo", "--samples", "256", "--batch-size", "32"]


def test_demo_streams_every_sample_through_both_tasks():
    run = subprocess.run(DEMO, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {}
    for line in run.stdout.splitlines():  # the summary table: one row per stage
        if line.strip():
            rows.setdefault(line.split()[0], line.split())
    for task in ("compute_ref", "actor_update"):
        assert rows[task][1:3] == ["256", "8"], rows[task]  # samples, batches
    assert rows["produce"][2:4] == ["256", "8"], rows["produce"]  # "produce (x2)": samples, batches
    assert "samples/s" in run.stdout and "MB/s" in run.stdout
    assert "check ok: compute_ref and actor_update each consumed all 256 samples exactly once" in run.stdout
    assert "Traceback" not in run.stderr
