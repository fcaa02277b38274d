"""A small crowd of concurrent clients (`benchmarks/crowd.py`): every sample put is read exactly
once, and no client hangs or fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.faults import ROOT


@pytest.mark.slow
def test_a_crowd_loses_duplicates_and_hangs_nothing():
    done = subprocess.run(
        [sys.executable, "benchmarks/crowd.py", "--producers", "160", "--consumers", "40", "--procs", "2"]
        + ["--seconds", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["samples_put"] > 0, done.stdout
    assert (summary["lost"], summary["duplicated"], summary["hung"], summary["errors"]) == (0, 0, 0, 0), done.stdout
