"""Benchmark of storage space under small writes: what a small put costs in a unit's arena, and
whether a long churn of small and large puts and clears keeps placing writes, with the
controller's account of the unit agreeing with the unit's own.

- cost: one put of 4 samples x 3 fields (`x` float32[150], `tok` int64[40], `mask` uint8[77]:
  3,988 bytes of data), arena bytes it occupies (the unit's `used` before and after).
- churn: for `--seconds`, one producer puts batches of 4 such samples (ragged `ids` instead of
  `tok`) and, one put in 20, 1-4 samples of 0.5-2 MiB (ragged); it keeps the newest `--live`
  puts and clears the oldest (one clear in five of a random live put instead). Puts wait at
  most 2 s. Reports puts/s, puts failed (`CapacityError`), the unit's writes that had to wait
  for space, the controller's bytes vs the unit's used bytes, and the fragmentation of the free
  space (1 - largest free extent / free bytes) at the end.

Goals: a 4 KB put occupies <= 8 KB; 0 puts fail while the live data is a fraction of capacity;
controller and unit agree within 3%. Results go to results/small_writes-*.json.

    .venv/bin/python benchmarks/small_writes.py            # 30 s of churn
    .venv/bin/python benchmarks/small_writes.py --quick    # 8 s
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import random
import time
from collections import deque
from typing import Any

import torch
from tensordict import TensorDict

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, print_table, write_record
from transfer_queue.wire.messages import Reply, UnitStatus
from transfer_queue.wire.rpc import Channel, Codec


def _unit_status(address: str) -> dict[str, Any]:
    channel = Channel(address, Codec(Reply), name=f"storage unit at {address}")
    try:
        return channel.call(UnitStatus(), 10.0).status
    finally:
        channel.close()


def _small(rng: random.Random) -> TensorDict:
    ids = [torch.arange(rng.randint(1, 60)) for _ in range(4)]
    return TensorDict(
        {
            "x": torch.ones(4, 150),
            "mask": torch.ones(4, 77, dtype=torch.uint8),
            "ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        },
        batch_size=[4],
    )


def _large(rng: random.Random) -> TensorDict:
    rows = [torch.ones(rng.randint(128 << 10, 512 << 10)) for _ in range(rng.randint(1, 4))]
    return TensorDict({"big": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[len(rows)])


def run(args: argparse.Namespace) -> dict[str, Any]:
    cluster = tq.init(num_storage_units=1, storage_capacity=args.capacity)
    try:
        with tq.connect(cluster.address, use_shm=False) as client:
            address = client.units[0].address
            capacity = _unit_status(address)["capacity"]
            before = _unit_status(address)["used"]
            one = TensorDict(
                {
                    "x": torch.ones(4, 150),
                    "tok": torch.ones(4, 40, dtype=torch.int64),
                    "mask": torch.ones(4, 77, dtype=torch.uint8),
                },
                batch_size=[4],
            )
            client.put(one, "one")
            cost = _unit_status(address)["used"] - before
            client.clear_partition("one")

            rng = random.Random(args.seed)
            live: deque[tq.BatchMeta] = deque()
            puts = failed = 0
            start = time.monotonic()
            while time.monotonic() - start < args.seconds:
                large = rng.random() < 0.05
                try:
                    meta = client.put(_large(rng) if large else _small(rng), "big" if large else "small", timeout=2)
                except tq.CapacityError:
                    failed += 1
                else:
                    live.append(meta)
                puts += 1
                while len(live) > args.live:
                    k = 0 if rng.random() < 0.8 else rng.randrange(len(live))
                    client.clear(live[k])
                    del live[k]
            elapsed = time.monotonic() - start
            ctl = client.status()["units"]["0"]["bytes"]
            unit = _unit_status(address)
            for _ in range(100):  # the last clears' frees may still be on their way to the unit
                if unit["used"] <= ctl:
                    break
                time.sleep(0.05)
                unit = _unit_status(address)
            free = unit["capacity"] - unit["used"]
            return {
                "capacity": capacity,
                "put_cost_bytes": cost,
                "puts": puts,
                "puts_per_s": puts / elapsed,
                "failed": failed,
                "writes_waited": unit.get("writes_waited", unit.get("pending_writes")),
                "controller_bytes": ctl,
                "unit_used": unit["used"],
                "fragmentation": 1 - unit["largest_free"] / free if free else 0.0,
            }
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 s of churn")
    p.add_argument("--seconds", type=float, help="churn duration (default 30; quick 8)")
    p.add_argument("--capacity", default="256MiB", help="the one unit's capacity (default 256MiB)")
    p.add_argument("--live", type=int, default=256, help="puts kept live (default 256)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    args.seconds = args.seconds or (8.0 if args.quick else 30.0)
    r = run(args)
    gap = (r["controller_bytes"] - r["unit_used"]) / max(r["unit_used"], 1)
    rows = [
        [
            "arena bytes of a 4-sample, 3-field put of 3,988 B",
            r["put_cost_bytes"],
            "<= 8192",
            r["put_cost_bytes"] / 8192,
        ],
        ["puts failed (CapacityError)", r["failed"], "0", float("nan")],
        ["puts/s", r["puts_per_s"], "-", float("nan")],
        ["unit writes that waited for space", r["writes_waited"], "-", float("nan")],
        ["controller bytes", r["controller_bytes"], "-", float("nan")],
        ["unit used bytes", r["unit_used"], "-", float("nan")],
        ["controller - unit, of unit used", gap, "|gap| <= 0.03", abs(gap) / 0.03],
        ["fragmentation of free space", r["fragmentation"], "-", float("nan")],
    ]
    print_table(
        f"Small writes ({r['puts']} puts in {args.seconds:g} s, {args.live} live)",
        ["measure", "value", "goal", "ratio"],
        rows,
    )
    path = write_record("small_writes", {"args": vars(args), **r, "gap": gap})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
