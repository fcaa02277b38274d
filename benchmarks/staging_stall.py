"""How long a publisher answers no one while it allocates staging: its first `publish` without
`model=`.

Without `model=`, a `WeightPublisher`'s first `publish` allocates and faults in the slot it
stages into, then a background thread makes the other slots (docs/gpu.md, "Staging without
`model=`"). Meanwhile its control server must go on answering subscribers: a call left
unanswered for `DEAD_AFTER` (5 s) is taken for a dead publisher. A probe process sends the
publisher a `Ping` every 2 ms over the weight channel's own client (`RpcClient`) and records how
long each took; the script compares the longest answer while the first publish and the
background allocation ran with the median answer while the publisher was idle (the baseline),
and with the time the allocation took (the share of it the publisher answered no one).

    .venv/bin/python benchmarks/staging_stall.py               # a 2 GiB model, 3 runs
    .venv/bin/python benchmarks/staging_stall.py --size 4GiB --reps 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import multiprocessing as mp
import time

import torch

from benchmarks._common import exit_on_sigterm, median, print_table, write_record
from transfer_queue.wire.rpc import Ping
from transfer_queue.wire.sizes import parse_bytes
from weight_sync import WeightPublisher
from weight_sync.protocol import RpcClient

TENSORS = 8


def probe(endpoint: str, out, ready, stop) -> None:  # noqa: ANN001 - multiprocessing queue and events
    """Ping `endpoint` every 2 ms until `stop` (`ready` once the first was answered); put the
    (sent at, took) pairs, monotonic seconds."""
    client = RpcClient(endpoint, timeout=60)
    samples = []
    try:
        while not stop.is_set():
            sent = time.monotonic()
            client.call(Ping())
            samples.append((sent, time.monotonic() - sent))
            ready.set()
            time.sleep(0.002)
    finally:
        client.close()
        out.put(samples)


def run(size: int) -> dict:
    """One publisher's first publish of `size` bytes under the probe: the figures of one run."""
    weights = {f"w{i}": torch.zeros(size // TENSORS, dtype=torch.uint8) for i in range(TENSORS)}
    ctx = mp.get_context("spawn")
    out, ready, stop = ctx.Queue(), ctx.Event(), ctx.Event()
    with WeightPublisher(None, transport="shm", slots=2, timeout=120) as pub:
        proc = ctx.Process(target=probe, args=(pub.endpoint, out, ready, stop))
        proc.start()
        assert ready.wait(60), "the probe process did not start"
        time.sleep(0.5)  # the baseline: the probe's pings to an idle publisher
        began = time.monotonic()
        pub.publish(weights, 1)
        published = time.monotonic()
        for slot in pub._table.slots:  # the background allocation of the other slot
            while slot.segment is None:
                assert time.monotonic() - published < 120, "the background allocation did not end"
                time.sleep(0.01)
        allocated = time.monotonic()
        time.sleep(0.2)
        stop.set()
        samples = out.get(timeout=120)
        proc.join(30)
    idle = [took for sent, took in samples if sent < began]
    during = [took for sent, took in samples if began <= sent < allocated] or [0.0]
    # a ping sent just before the allocation began and answered after it counts too
    straddling = [took for sent, took in samples if sent < began and sent + took > began]
    return {
        "publish_s": published - began,
        "allocation_s": allocated - began,
        "idle_median_s": median(idle),
        "longest_s": max(during + straddling),
        "pings_during": len(during),
    }


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=parse_bytes, default=2 << 30, help="the model's bytes (e.g. 2GiB)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs = [run(args.size) for _ in range(args.reps)]
    rows = []
    for i, r in enumerate(runs):
        rows.append(
            [
                i,
                r["publish_s"],
                r["allocation_s"],
                r["idle_median_s"] * 1e3,
                r["longest_s"] * 1e3,
                r["longest_s"] / r["allocation_s"],
                r["pings_during"],
            ]
        )
    print_table(
        f"a subscriber's pings while a publisher allocates staging for {args.size / (1 << 30):g} GiB (2 slots)",
        [
            "run",
            "first publish s",
            "allocation s",
            "idle ping ms (median)",
            "longest ping ms",
            "longest / allocation",
            "pings answered",
        ],
        rows,
    )
    longest = median(r["longest_s"] for r in runs)
    print(
        f"median of {args.reps}: the longest ping took {longest * 1e3:.0f} ms, "
        f"{longest / median(r['idle_median_s'] for r in runs):.0f}x an idle ping and "
        f"{longest / median(r['allocation_s'] for r in runs):.2f}x the allocation's time"
    )
    print(write_record("staging_stall", {"size": args.size, "runs": runs}))


if __name__ == "__main__":
    main()
