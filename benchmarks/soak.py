"""Soak: the controller's and units' memory over millions of small samples put, streamed, acked
and cleared.

One cluster (a controller, 2 storage units); one process with asyncio producers that put batches
of one-int64 samples (so the run is bound by metadata, not bytes) and consumers that take them
with `get_meta`, read every 8th batch's data, `ack` and `clear` them. Live samples are bounded
(`--live`), so everything the services hold beyond that grows with time, not with load.

Every 100,000 samples cleared it prints, per service, RSS, anonymous memory (`RssAnon` of
/proc/PID/status) and open fds. At the end: the controller's growth per 100k samples after the
warm-up (least-squares slope of its anonymous memory) and its anonymous memory above idle,
against the goals (<= 2 MiB per 100k, <= 64 MiB above idle). The last line is the summary as
JSON (the slow test reads it); the record goes to results/soak-*.json.

    .venv/bin/python benchmarks/soak.py [--samples 5000000] [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import os
import time
from typing import Any

import torch

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, print_table, write_record

STEP = 100_000
GOAL_SLOPE_MIB = 2.0
GOAL_ABOVE_IDLE_MIB = 64.0


def memory(pid: int) -> dict[str, float]:
    """RSS and anonymous memory (MiB) and open fds of process `pid`."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                fields[key] = int(value.split()[0]) / 1024
    return {"rss": fields["VmRSS"], "anon": fields["RssAnon"], "fds": float(len(os.listdir(f"/proc/{pid}/fd")))}


async def stream(
    address: str, samples: int, batch: int, producers: int, consumers: int, live: int, sample: Any
) -> float:
    """Put `samples` samples in batches of `batch` and consume, ack and clear all of them; calls
    `sample(cleared)` at every `STEP` samples cleared. Returns samples/s."""
    client = await tq.connect_async(address)
    batches = samples // batch
    room = asyncio.Semaphore(max(1, live // batch))
    data = {"x": torch.arange(batch, dtype=torch.int64)}
    state = {"put": 0, "taken": 0, "cleared": 0, "next": STEP}

    async def produce() -> None:
        while state["put"] < batches:
            state["put"] += 1
            await room.acquire()
            await client.put(data, partition="soak", timeout=60)

    async def consume() -> None:
        while state["taken"] < batches:
            state["taken"] += 1
            meta = await client.get_meta(["x"], batch, task="soak", partition="soak", timeout=60)
            if state["taken"] % 8 == 0:
                got = await client.get_data(meta)
                assert got["x"].shape == (batch,)
            await client.ack(meta)
            await client.clear(meta)
            room.release()
            state["cleared"] += len(meta)
            while state["cleared"] >= state["next"]:
                sample(state["next"])
                state["next"] += STEP

    t0 = time.perf_counter()
    await asyncio.gather(*[produce() for _ in range(producers)], *[consume() for _ in range(consumers)])
    rate = batches * batch / (time.perf_counter() - t0)
    await client.close()
    return rate


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares growth of the second value per `STEP` of the first."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var * STEP


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5_000_000)
    parser.add_argument("--warmup", type=int, default=None, help="samples before the slope is measured (20%%)")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--producers", type=int, default=4)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--live", type=int, default=32_000, help="samples put but not yet cleared, at most")
    parser.add_argument("--quick", action="store_true", help="500,000 samples")
    args = parser.parse_args()
    samples = 500_000 if args.quick else args.samples
    warmup = args.warmup if args.warmup is not None else max(STEP, samples // 5)

    cluster = tq.init(num_storage_units=2, storage_capacity="1GiB")
    try:
        pids = {s["service"]: s["pid"] for s in cluster.services}
        idle = {name: memory(pid) for name, pid in pids.items()}
        rows: list[list[Any]] = []
        points: list[tuple[int, float]] = []
        t0 = time.perf_counter()

        def sample(cleared: int) -> None:
            now = {name: memory(pid) for name, pid in pids.items()}
            ctl = now["controller"]
            points.append((cleared, ctl["anon"]))
            row = [cleared, round(time.perf_counter() - t0, 1)]
            for name in pids:
                row += [now[name]["rss"], now[name]["anon"], int(now[name]["fds"])]
            rows.append(row)
            print("  ".join(str(round(v, 1)) if isinstance(v, float) else str(v) for v in row), flush=True)

        header = ["samples", "s"]
        for name in pids:
            header += [f"{name} rss MiB", "anon MiB", "fds"]
        print("  ".join(header), flush=True)
        rate = asyncio.run(
            stream(cluster.address, samples, args.batch, args.producers, args.consumers, args.live, sample)
        )
        growth = slope([p for p in points if p[0] > warmup])
        above = points[-1][1] - idle["controller"]["anon"] if points else float("nan")
        print_table(f"soak: {samples:,} samples, {rate:,.0f} samples/s", header, rows)
        verdict = "meets" if growth <= GOAL_SLOPE_MIB and above <= GOAL_ABOVE_IDLE_MIB else "misses"
        print(
            f"controller anonymous memory: idle {idle['controller']['anon']:.1f} MiB, end {points[-1][1]:.1f} MiB "
            f"({above:+.1f} MiB; goal <= {GOAL_ABOVE_IDLE_MIB:g}); growth after {warmup:,} samples: "
            f"{growth:+.2f} MiB per 100k (goal <= {GOAL_SLOPE_MIB:g}): {verdict} the goal"
        )
        summary = {
            "samples": samples,
            "samples_per_s": rate,
            "warmup": warmup,
            "idle": idle,
            "controller_anon_growth_mib_per_100k": growth,
            "controller_anon_above_idle_mib": above,
            "unit_anon_growth_mib_per_100k": {
                name: slope([(r[0], r[3 + 3 * i]) for r in rows if r[0] > warmup])
                for i, name in enumerate(pids)
                if name != "controller"
            },
        }
        write_record("soak", {**summary, "rows": rows, "header": header, "args": vars(args)})
        print(json.dumps(summary))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
