"""Shared helpers of the benchmark scripts: timing, statistics, tables, JSON records, and the
physical limits (raw loopback TCP socket, memcpy) that every figure is compared with.

The development machines are shared and noisy (docs/architecture.md, section 3), so a benchmark measures its
limits in the same run as its figures and reports ratios against them.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"

__all__ = [
    "ROOT",
    "median",
    "percentile",
    "timed",
    "repeat",
    "gbps",
    "print_table",
    "write_record",
    "tcp_loopback_bandwidth",
    "memcpy_bandwidth",
    "physical_limits",
    "machine_info",
    "cpu_seconds",
    "CpuMeter",
    "exit_on_sigterm",
]


# -- statistics ---------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) by linear interpolation; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def repeat(fn: Callable[[], float], reps: int, warmup: int = 0) -> list[float]:
    """Run `fn` (which returns a figure) `warmup` times untimed, then `reps` times."""
    for _ in range(warmup):
        fn()
    return [fn() for _ in range(reps)]


def gbps(nbytes: float, seconds: float) -> float:
    """GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


# -- CPU accounting -----------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> tuple[float, float, int]:
    """(user, system) CPU seconds used so far by process `pid`, all its threads, and its minor
    page faults (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return (float("nan"), float("nan"), 0)
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK, int(fields[7])


class CpuMeter:
    """CPU seconds and page faults of named processes between `start()` and `stop()`.

    On a shared machine a rate depends on what the neighbours do; the CPU a transfer costs per
    GB does much less, so benchmarks report it too, and how many cores were busy. Page faults show
    data landing in fresh memory (each costs more than copying its page).
    """

    def __init__(self, pids: dict[str, int]):
        self.pids = dict(pids)
        self._t0 = 0.0
        self._c0: dict[str, tuple[float, float, int]] = {}
        self.wall = 0.0
        self.used: dict[str, tuple[float, float]] = {}
        self.faults: dict[str, int] = {}

    def start(self) -> CpuMeter:
        self._c0 = {k: cpu_seconds(p) for k, p in self.pids.items()}
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> CpuMeter:
        self.wall = time.perf_counter() - self._t0
        for k, p in self.pids.items():
            u, s, f = cpu_seconds(p)
            u0, s0, f0 = self._c0[k]
            self.used[k] = (u - u0, s - s0)
            self.faults[k] = f - f0
        return self


# -- output -------------------------------------------------------------------------------


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print (and return) a plain aligned text table; floats get 3 significant-ish digits."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            if v != v:
                return "-"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) if text else len(h) for i, h in enumerate(header)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in text]
    out = "\n".join(lines)
    print(out + "\n", flush=True)
    return out


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "kernel": platform.release(),
    }
    try:
        import torch
        import zmq

        info.update(torch=torch.__version__, pyzmq=zmq.__version__, libzmq=zmq.zmq_version())
    except ImportError:
        pass
    try:
        with open("/proc/loadavg") as f:
            info["loadavg"] = f.read().split()[:3]
    except OSError:
        pass
    return info


def write_record(name: str, record: dict[str, Any]) -> Path:
    """Write `record` (plus machine info and a timestamp) to results/{name}-{stamp}.json."""
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"{name}-{stamp}.json"
    full = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine_info(), **record}
    path.write_text(json.dumps(full, indent=2, default=_jsonable))
    return path


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, float) and v != v:
        return None
    return str(v)


# -- physical limits ----------------------------------------------------------------------

_SENDER = r"""
import socket, sys
port, total, chunk, reps = map(int, sys.argv[1:5])
buf = bytearray(chunk)               # zero-filled: already touched
view = memoryview(buf)
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(reps):
    s.recv(1)                       # "go"
    left = total
    while left:
        n = min(chunk, left)
        s.sendall(view[:n])
        left -= n
s.recv(1)
s.close()
"""


def tcp_loopback_bandwidth(total: int = 256 << 20, reps: int = 3, chunk: int = 16 << 20) -> tuple[list[float], float]:
    """GB/s of `total` bytes over loopback TCP from another process into a preallocated,
    pre-touched buffer (`recv_into`), one figure per repetition (after one warm-up); and the CPU
    seconds per GB that sender and receiver spent together."""
    dest = bytearray(total)  # zero-filled: touched
    view = memoryview(dest)
    c0 = os.times()
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SENDER, str(port), str(total), str(chunk), str(reps + 1)])
    try:
        conn, _ = srv.accept()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        out = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            got = 0
            while got < total:
                n = conn.recv_into(view[got:], total - got)
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            out.append(gbps(total, time.perf_counter() - t0))
        conn.sendall(b"x")
        conn.close()
    finally:
        srv.close()
        proc.wait(30)
    c1 = os.times()
    cpu = (c1.user + c1.system + c1.children_user + c1.children_system) - (
        c0.user + c0.system + c0.children_user + c0.children_system
    )
    return out[1:], cpu / ((reps + 1) * total / 1e9)


def memcpy_bandwidth(total: int = 256 << 20, reps: int = 5) -> list[float]:
    """GB/s of torch `copy_` of `total` bytes into an already-touched destination, one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(total, dtype=torch.uint8)
        dst = torch.zeros(total, dtype=torch.uint8)
        dst.copy_(src)
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            out.append(gbps(total, time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    return out


def physical_limits(total: int = 256 << 20, reps: int = 3) -> dict[str, Any]:
    """Raw loopback TCP and memcpy bandwidth (GB/s) measured now; medians and every repetition,
    and the CPU seconds per GB that the raw socket transfer costs (both ends)."""
    tcp, tcp_cpu = tcp_loopback_bandwidth(total, reps)
    mem = memcpy_bandwidth(total, max(reps, 3))
    return {
        "tcp_gbps": median(tcp),
        "tcp_runs": tcp,
        "tcp_cpu_s_per_gb": tcp_cpu,
        "memcpy_gbps": median(mem),
        "memcpy_runs": mem,
        "bytes": total,
    }


def exit_on_sigterm() -> None:
    """Make SIGTERM (a `timeout`, a job scheduler) end the benchmark as an exception would, so
    that its `finally` blocks and context managers still stop the clusters and processes it
    started and remove its files in /dev/shm (by default SIGTERM ends Python without them)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
