"""What many tests share: waiting on observable state (a status counter, a queue event), never
on a fixed sleep; a small batch builder; a put from a new producer; a free loopback port; the
processes a command started, and whether they still run."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

import transfer_queue as tq

__all__ = ["eventually", "rows", "put_anew", "free_port", "status_bytes", "descendants", "alive"]


def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Wait until `check()` (a look at observable state) is truthy and return it; fail after
    `timeout` s. It looks every 20 ms: the wait ends as soon as the state is reached."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)


async def eventually_async(check: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """`eventually` inside an event loop: the loop keeps running between looks."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := check()):
        assert loop.time() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.01)
    return got


def rows(n: int, start: int = 0) -> TensorDict:
    """`n` samples with one int64 field `x` = start, start+1, ..."""
    return TensorDict({"x": torch.arange(start, start + n, dtype=torch.int64)}, batch_size=[n])


def put_anew(address: str, data: Any, use_shm: bool = False, **put: Any) -> tq.BatchMeta:
    """Put `data` from a new producer, whose first put goes to the emptiest storage unit: one
    producer's small puts stay on its unit (`controllers.placement`), so tests that need rows on
    several units put them from several producers."""
    with tq.connect(address, use_shm=use_shm) as producer:
        return producer.put(data, **put)


def status_bytes(pid: int, key: str = "VmRSS") -> int:
    """A size line (`VmRSS`, `VmHWM`, ...) of `/proc/<pid>/status`, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} for pid {pid}")


def free_port() -> int:
    """A loopback TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_benchmark(script: str, *args: str, timeout: float = 600) -> tuple[dict, str]:
    """Run `benchmarks/<script>` with `args` from the repository root; it must exit 0. Returns
    the JSON summary on its last line and its whole stdout (for assertion messages)."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, and so on (from /proc)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        kids = [child for child, parent in parents.items() if parent in frontier]
        found += kids
        frontier = kids
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
