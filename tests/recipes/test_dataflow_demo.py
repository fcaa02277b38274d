"""`python -m recipes.dataflow_demo` end to end, as `make demo` runs it (smaller)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.helpers import descendants, eventually

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


def _loading_torch(pid: int) -> bool:
    """Whether process `pid` has mapped torch's library: its `import torch` is under way."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True  # gone already: let the test see how it ended


def test_demo_stops_at_once_on_a_signal_while_it_loads():
    """Started as a script's background job is (SIGINT inherited ignored), the demo spends
    seconds loading torch before `main` installs its handlers: a SIGINT then ends it at once,
    by that signal, without a traceback and having started nothing. It used to be lost, and the
    demo ran on to its end."""
    demo = subprocess.Popen(
        DEMO,
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        eventually(lambda: _loading_torch(demo.pid), 60, "torch loading")
        assert not descendants(demo.pid)
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=30)
    finally:
        demo.kill()
    assert demo.returncode == -signal.SIGINT, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and not out
