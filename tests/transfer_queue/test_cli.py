"""The `sluice` command as a user runs it: `serve` and `status` as real subprocesses."""

from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import alive, descendants, free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _sluice(*args: str, **popen: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "transfer_queue.cli", *args],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _address(serve: subprocess.Popen, timeout: float = 60.0) -> str:
    """The `SLUICE_ADDRESS` that `sluice serve` prints once the cluster is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and serve.poll() is None:
        if select.select([serve.stdout], [], [], 0.5)[0]:
            line = serve.stdout.readline()
            if line.startswith("SLUICE_ADDRESS "):
                return line.split()[1]
    serve.kill()
    raise AssertionError(f"sluice serve printed no address: {serve.stderr.read()}")


def test_serve_status_and_clean_stop():
    serve = _sluice("serve", "--units", "2", "--capacity", "64MiB", "--max-staleness", "1")
    try:
        address = _address(serve)
        with tq.connect(address) as client:
            client.put(
                TensorDict({"x": torch.ones(16, 4)}, batch_size=[16]),
                partition="train",
                groups=[i // 8 for i in range(16)],
            )
            client.ack(client.get_meta(["x"], 8, task="actor_update", partition="train", timeout=5))
            cluster_id = client.status()["cluster_id"]
        table, as_json = _sluice("status", address), _sluice("status", address, "--json")
        # started as a script's background job is: SIGINT ignored, which Ctrl-C must still end
        watch = _sluice("status", address, "--watch", "0.2", preexec_fn=_ignore_sigint)
        out, err = table.communicate(timeout=60)
        assert table.returncode == 0, err
        assert "train" in out and "actor_update" in out and "throughput" in out
        row = next(line for line in out.splitlines() if line.startswith("train"))
        assert row.split()[:5] == ["train", "16", "16", "no", "256"], row  # samples, committed, unsealed, bytes
        assert row.split()[-4:] == ["actor_update", "8", "0", "8"], row  # ready, leased, consumed
        status = json.loads(as_json.communicate(timeout=60)[0])
        assert status["partitions"]["train"]["samples"] == 16
        assert status["partitions"]["train"]["tasks"]["actor_update"]["consumed"] == 8
        assert status["max_staleness"] == 1 and len(status["units"]) == 2

        frames = []
        while len(frames) < 2:  # --watch refreshes until Ctrl-C
            line = watch.stdout.readline()
            assert line, watch.stderr.read()
            if line.startswith("throughput"):
                frames.append(line)
        watch.send_signal(signal.SIGINT)
        err = watch.communicate(timeout=30)[1]  # drained while it exits: its exit flushes what it holds
        assert watch.returncode == -signal.SIGINT and "Traceback" not in err  # it was stopped: a shell says 130

        services = descendants(serve.pid)
        assert len(services) == 3 and glob.glob(f"/dev/shm/sluice-{cluster_id}-*")
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, serve.stderr.read()
        assert not [pid for pid in services if alive(pid)]
        assert not glob.glob(f"/dev/shm/sluice-{cluster_id}-*")
    finally:
        if serve.poll() is None:
            serve.kill()


def test_bad_address_is_a_one_line_error():
    started = time.monotonic()
    runs = [_sluice("status", f"tcp://127.0.0.1:{free_port()}"), _sluice("status", "not-an-address")]
    for run in runs:
        out, err = run.communicate(timeout=60)
        assert run.returncode == 1
        assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("sluice status: "), err
    assert time.monotonic() - started < 20  # interpreter start-up included; no reply timeout waited out
