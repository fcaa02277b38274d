"""Fresh connections to a service whose process holds the GIL: how many first calls fail.

A weight subscriber's control client (`weight_sync.protocol.RpcClient`) sends its first request
on a new connection, which ZeroMQ's handshake must finish first. Here the service is a
`ThreadService` in a process of its own whose `--hogs` threads copy 256 MiB with the GIL held
(`bytes(bytearray)`), as a trainer's Python threads may; with CurveZMQ its ZAP handler, a Python
thread, must get the GIL to finish each handshake. For each mode (with and without CurveZMQ) and
each connect timeout (`--connect-timeouts`: the weight client's, and 2 s, what it had before and
what a subscriber's `poll` gives its first contact), `--reps` fresh channels with the weight
client's settings each send one `Ping`: it reports how many calls failed (a send not taken within
the connect timeout: "took no message for N s" of a live service; or an answer not given within
`dead_after`), the median and longest time for a send to be taken, and the median and longest
wait for the `Ok` (see docs/reliability.md, Liveness).

    .venv/bin/python benchmarks/connect_under_load.py                 # 25 channels, 4 hogs
    .venv/bin/python benchmarks/connect_under_load.py --reps 10 --hogs 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import multiprocessing as mp
import threading
import time

from benchmarks._common import exit_on_sigterm, median, print_table, write_record
from transfer_queue import WeightSyncError
from transfer_queue.wire.rpc import DEAD_AFTER, Cancel, Codec, Credentials, Ping, ThreadService
from weight_sync.protocol import RpcClient

HOG_BYTES = 256 << 20


def serve(token: str, hogs: int, out, stop) -> None:  # noqa: ANN001 - multiprocessing queue and event
    """The service process: a `ThreadService` (CurveZMQ when `token`) and `hogs` GIL-holding threads."""
    credentials = Credentials.from_token(token) if token else None
    service = ThreadService(Codec(Ping | Cancel), lambda msg, pending: None, credentials=credentials)

    def hog() -> None:
        block = bytearray(HOG_BYTES)
        while not stop.is_set():
            bytes(block)  # one copy with the GIL held

    for _ in range(hogs):
        threading.Thread(target=hog, daemon=True).start()
    out.put(service.endpoint)
    stop.wait()
    service.close()


def measure(reps: int, hogs: int, credentials: Credentials | None, connect_timeout: float) -> dict:
    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=serve, args=(credentials.token() if credentials else "", hogs, out, stop))
    proc.start()
    taken: list[float] = []
    answered: list[float] = []
    failed: list[str] = []
    try:
        endpoint = out.get(timeout=60)
        for _ in range(reps):
            channel = RpcClient(
                endpoint,
                timeout=60,
                connect_timeout=connect_timeout,
                credentials=credentials.for_clients() if credentials else None,  # None: SLUICE_CREDENTIALS, unset here
            )
            t0 = time.monotonic()
            try:
                rid = channel.send(Ping())
                taken.append(time.monotonic() - t0)
                channel.reply(rid, 60)
                answered.append(time.monotonic() - t0)
            except WeightSyncError as exc:
                failed.append(str(exc))
            finally:
                channel.close()
    finally:
        stop.set()
        proc.join(30)
    return {"failed": failed, "taken": taken, "answered": answered}


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--hogs", type=int, default=4)
    parser.add_argument("--connect-timeouts", type=float, nargs="+", default=[DEAD_AFTER, 2.0])
    args = parser.parse_args()
    rows, record = [], {"reps": args.reps, "hogs": args.hogs, "modes": {}}
    for connect_timeout in args.connect_timeouts:
        for mode, credentials in (("CurveZMQ", Credentials.generate()), ("plain", None)):
            got = measure(args.reps, args.hogs, credentials, connect_timeout)
            record["modes"][f"{mode}, connect timeout {connect_timeout:g} s"] = got
    for mode, got in record["modes"].items():
        taken, answered = got["taken"], got["answered"]
        rows.append(
            [
                mode,
                f"{len(got['failed'])}/{args.reps}",
                median(taken),
                max(taken, default=float("nan")),
                median(answered),
                max(answered, default=float("nan")),
            ]
        )
    print_table(
        f"first sends of the weight client to a service with {args.hogs} GIL-holding threads",
        ["mode", "failed", "taken s (median)", "taken s (max)", "answered s (median)", "answered s (max)"],
        rows,
    )
    for mode, got in record["modes"].items():
        if got["failed"]:
            print(f"{mode}: {got['failed'][0]}")
    print(write_record("connect_under_load", record))


if __name__ == "__main__":
    main()
