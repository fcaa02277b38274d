"""UCX's own bandwidth test, `ucx_perftest`, as the limit the `ucx` weight transport is held to.

The libucx wheel that ucxx installs ships the binary (`libucx/bin/ucx_perftest`). `perftest`
runs its UCP tag-matching bandwidth test (`-t tag_bw`: one process posts tagged sends of one
touched, reused buffer, the other receives into one) between pairs of processes on this
machine, over the UCX transports in `UCX_TLS`, with endpoint error handling on (`-e`) as the
transport has it, and returns seconds per message. `limit` takes the faster of its two ways
of waiting: polling wins on idle cores, sleeping on events on busy ones (here, loaded, polling
ran up to 4x slower).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["limit", "perftest", "perftest_binary"]


def perftest_binary() -> Path | None:
    """The `ucx_perftest` of the installed libucx wheel, or None without one."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / "ucx_perftest"
    return path if path.exists() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _listening(port: int) -> bool:
    """True once some process listens on TCP `port` (read from /proc: connecting to probe
    would be taken by ucx_perftest as its peer)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def perftest(
    nbytes: int,
    tls: str,
    pairs: int = 1,
    iters: int = 3,
    wait: str = "poll",
    error_handling: bool = True,
    timeout: float = 120,
) -> float:
    """Seconds per `nbytes` message of the slowest of `pairs` sender/receiver pairs running at
    once (each pair: `iters` measured messages after one warm-up), over `tls`; `wait` is how
    both sides wait for completions: "poll" (spin on the worker, perftest's default) or
    "sleep" (sleep on the worker's events).

    Raises:
        RuntimeError: no ucx_perftest is installed, or a run failed (its output says why, e.g.
            "Destination is unreachable" when no transport in `tls` can reach the peer).
    """
    binary = perftest_binary()
    if binary is None:
        raise RuntimeError("ucx_perftest not found (install ucxx, whose libucx wheel ships it)")
    env = dict(os.environ, UCX_TLS=tls, UCX_WARN_UNUSED_ENV_VARS="n", LD_LIBRARY_PATH=str(binary.parent.parent / "lib"))
    args = ["-t", "tag_bw", "-s", str(nbytes), "-n", str(iters), "-w", "1", "-E", wait, "-f"] + (
        ["-e"] if error_handling else []
    )
    ports = [_free_port() for _ in range(pairs)]
    servers = [
        subprocess.Popen(
            [binary, *args, "-p", str(p)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        for p in ports
    ]
    clients: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + timeout
        for port, server in zip(ports, servers):
            while not _listening(port):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ucx_perftest server did not start: {server.stderr.read() if server.stderr else ''}"
                    )
                time.sleep(0.01)
        clients = [
            subprocess.Popen(
                [binary, "127.0.0.1", *args, "-p", str(p)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for p in ports
        ]
        seconds = []
        for client in clients:
            out, _ = client.communicate(timeout=max(1.0, deadline - time.monotonic()))
            last = out.strip().splitlines()[-1] if out.strip() else ""
            fields = last.split()
            if client.returncode != 0 or len(fields) < 8 or not fields[0].isdigit():
                raise RuntimeError(f"ucx_perftest over {tls} failed: {last or out}")
            seconds.append(float(fields[3]) * 1e-6)  # "overall" latency: microseconds per message
        return max(seconds)
    finally:
        for proc in clients + servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def limit(nbytes: int, tls: str, pairs: int = 1) -> float:
    """The faster of `perftest` polling and sleeping (one measured message each): UCX's own
    best over `tls` right now."""
    return min(perftest(nbytes, tls, pairs, 1, wait) for wait in ("poll", "sleep"))
