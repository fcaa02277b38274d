"""Fault injection over real processes: producers SIGKILLed mid-put, consumers mid-batch, a
storage unit and the controller killed, at random moments. Counts what the issue asks for:
lost and duplicated acked samples (goal 0 / 0), torn samples (0), leaked rows and bytes (0),
hangs (0). `test_chaos_short` runs in `make test`; the `slow` one runs longer with more kills.
Run with `-s` to see the figures:

    .venv/bin/python -m pytest tests/integration/test_fault_injection.py -m "" -s -q
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

import transfer_queue as tq
from tests.faults import ROOT, eventually, unit_status


class Worker:
    """A chaos_worker process whose stdout lines are collected by a thread."""

    def __init__(self, lines: list, *args: str):
        env = {**os.environ, "PYTHONPATH": ROOT}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.chaos_worker", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.lines = lines
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY"):
                self.ready.set()
            else:
                self.lines.append(line.split())

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.join(10)

    def finished(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return False
        self.reader.join(10)
        return True


def _ids(lines: list, tag: str) -> list[int]:
    return [int(i) for line in lines if line and line[0] == tag for i in line[1:]]


def chaos(seconds: float, seed: int, kill_unit: bool) -> dict:
    """Two producers and two consumers under random SIGKILLs for `seconds`; then seal, drain,
    sweep, and kill the controller under a blocked consumer. Returns the figures."""
    rng = random.Random(seed)
    lines: list = []
    figures = Counter()
    with (
        tq.init(num_storage_units=2, storage_capacity="64MiB", lease_timeout=2.0) as cluster,
        cluster.connect() as client,
    ):
        bases = iter(range(0, 10**9, 10**6))
        producers = [Worker(lines, "producer", cluster.address, str(next(bases))) for _ in range(2)]
        consumers = [Worker(lines, "consumer", cluster.address) for _ in range(2)]
        for worker in producers + consumers:  # processes start slowly on a busy machine (torch import)
            assert worker.ready.wait(120), "a worker did not start"
        eventually(lambda: _ids(lines, "ACKED"), 60, "a first consumed batch")
        started = time.monotonic()
        unit_killed = False
        while time.monotonic() - started < seconds:
            time.sleep(rng.uniform(0.1, 0.8))  # the injector's random clock, not a synchronization
            if kill_unit and not unit_killed and time.monotonic() - started > seconds / 2:
                cluster.backend.procs[2].send_signal(signal.SIGKILL)
                unit_killed = True
                figures["units_killed"] += 1
                continue
            group = producers if rng.random() < 0.5 else consumers
            i = rng.randrange(len(group))
            if not group[i].ready.is_set():  # still starting: kill it once it works
                continue
            if group is producers:
                producers[i].kill()
                producers[i] = Worker(lines, "producer", cluster.address, str(next(bases)))
                figures["producers_killed"] += 1
            else:
                consumers[i].kill()
                consumers[i] = Worker(lines, "consumer", cluster.address)
                figures["consumers_killed"] += 1
        for p in producers:  # the last kills land mid-put too
            p.kill()
            figures["producers_killed"] += 1
        client.seal("train")
        drain_started = time.monotonic()
        figures["hangs"] += sum(not c.finished(60) for c in consumers)
        figures["drain_s"] = round(time.monotonic() - drain_started, 1)
        eventually(lambda: client.status()["counters"]["open_puts"] == 0, 30, "every killed put expired")
        status = client.status()
        # rows the consumers acked but were killed before clearing: sweep them by index
        left = client.get_meta(["id"], 1 << 20, task="sweep", timeout=1, allow_partial=True)
        client.clear(left)
        status_after = client.status()
        units = [unit_status(u["address"]) for u in status_after["units"].values()]  # the live ones
        put, got, acked = set(_ids(lines, "PUT")), set(_ids(lines, "GOT")), Counter(_ids(lines, "ACKED"))
        figures.update(
            acked_puts=len(put),
            delivered=len(got),
            lost_unaccounted=max(0, len(put - got) - status["counters"]["samples_lost"]),
            lost_with_dead_unit=status["counters"]["samples_lost"],
            duplicated_acks=sum(1 for n in acked.values() if n > 1),
            torn=len(_ids(lines, "TORN")),
            uncommitted_rows_left=status["partitions"]["train"]["samples"] - status["partitions"]["train"]["committed"],
            leaked_rows=status_after["partitions"]["train"]["samples"] + sum(sum(u["rows"].values()) for u in units),
            leaked_bytes=status_after["bytes"] + sum(u["used"] for u in units),
            puts_expired=status["counters"]["puts_expired"],
        )
        # the controller dies under a blocked consumer: it must hear a ServiceError, not hang
        blocked = Worker(lines, "consumer", cluster.address, "empty")
        eventually(lambda: client.status()["counters"]["parked_get_meta"] >= 1, 30, "consumer parked")
        cluster.backend.procs[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        figures["hangs"] += not blocked.finished(30)
        figures["controller_death_reported_s"] = round(time.monotonic() - killed_at, 1)
        assert lines[-1][0] == "DEAD" and "controller" in " ".join(lines[-1]), lines[-1]
    print(f"\nchaos {seconds:g}s seed {seed}: {dict(figures)}")
    return figures


def _check(figures: Counter) -> None:
    assert figures["acked_puts"] > 0 and figures["delivered"] > 0
    for key in (
        "lost_unaccounted",
        "duplicated_acks",
        "torn",
        "uncommitted_rows_left",
        "leaked_rows",
        "leaked_bytes",
        "hangs",
    ):
        assert figures[key] == 0, (key, dict(figures))
    assert figures["controller_death_reported_s"] < 15  # 5 s of silence, then the worker exits


def test_chaos_short():
    _check(chaos(10.0, seed=1, kill_unit=False))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3])
def test_chaos_long_with_a_unit_killed(seed):
    _check(chaos(40.0, seed=seed, kill_unit=True))
