"""benchmarks/gpu.py as the next GPU session will run it: without CUDA it says so and exits 0;
its host paths run end to end on the CPU (`--device cpu`, slow), every version exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script measures it")
def test_without_cuda_it_says_so_and_exits_0():
    done = _run(timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


@pytest.mark.slow
def test_the_host_paths_run_on_the_cpu():
    done = _run(
        "--device", "cpu", "--sizes", "256MiB", "--transports", "shm,tcp", "--subscribers", "1", "--reps", "1",
        timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1].removeprefix("wrote "))
    record = json.loads(path.read_text())
    rows = record["sizes"]["256MiB"]["rows"]
    assert set(rows) == {"shm x1", "tcp x1"} and all(r["exact"] for r in rows.values())
    paths = ("mapped arena", "tcp frames", "mapped arena 256x8", "tcp frames 256x8")
    assert all(record["data_plane"][k]["exact"] for k in paths)


@pytest.mark.slow
def test_the_data_plane_alone():
    done = _run("--device", "cpu", "--data-plane-only", "--reps", "1", timeout=300)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip().splitlines()[-1].removeprefix("wrote "))
    record = json.loads(path.read_text())
    assert record["sizes"] == {}  # no weight sync
    dp = record["data_plane"]
    assert set(dp) == {"raw pinned", "mapped arena", "tcp frames", "mapped arena 256x8", "tcp frames 256x8"}
    assert all(f["exact"] and len(f["put"]) == len(f["get"]) == 1 for k, f in dp.items() if k != "raw pinned")
