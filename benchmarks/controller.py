"""Controller micro-benchmark: `get_meta` + `ack` samples/s with 100,000 samples tracked.

A partition is filled with 100,000 small samples (one int64 field), then sealed; each repetition
is a new consumer task that drains all of them with `get_meta(batch_size=256)` + `ack`:

- sync: one blocking client, one request at a time (bounded by the round trip);
- pipelined: one `AsyncClient` with several coroutines draining the same task concurrently
  (bounded by the controller's own work);
- in-process: the controller's handlers called directly in one event loop, no sockets (its pure
  scheduling cost).

Also the round trip of `get_meta` for a ready batch (p50/p99) and of `ack`. Results go to
results/controller-*.json.

    .venv/bin/python benchmarks/controller.py [--quick]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import time
from typing import Any

import torch

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, median, percentile, print_table, write_record

FIELD = "x"


def fill(client: tq.Client, partition: str, total: int, put_batch: int) -> float:
    """Put `total` one-int64 samples; returns samples/s of the puts."""
    td = {FIELD: torch.arange(put_batch, dtype=torch.int64)}
    t0 = time.perf_counter()
    done = 0
    while done < total:
        n = min(put_batch, total - done)
        client.put(td if n == put_batch else {FIELD: td[FIELD][:n]}, partition=partition)
        done += n
    rate = total / (time.perf_counter() - t0)
    client.seal(partition)
    return rate


def drain_sync(client: tq.Client, partition: str, task: str, batch: int, total: int) -> dict[str, Any]:
    meta_s, ack_s, got = [], [], 0
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        meta = client.get_meta([FIELD], batch, task=task, partition=partition, timeout=30)
        t2 = time.perf_counter()
        if not len(meta):
            break
        client.ack(meta)
        t3 = time.perf_counter()
        got += len(meta)
        if len(meta) == batch:
            meta_s.append(t2 - t1)
            ack_s.append(t3 - t2)
    elapsed = time.perf_counter() - t0
    assert got == total, (got, total)
    return {"samples_per_s": total / elapsed, "get_meta_s": meta_s, "ack_s": ack_s}


def drain_pipelined(address: str, partition: str, task: str, batch: int, total: int, workers: int) -> float:
    async def main() -> float:
        client = await tq.connect_async(address)
        got = 0

        async def worker() -> None:
            nonlocal got
            while True:
                meta = await client.get_meta([FIELD], batch, task=task, partition=partition, timeout=30)
                if not len(meta):
                    return
                await client.ack(meta)
                got += len(meta)

        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(workers)))
            elapsed = time.perf_counter() - t0
        finally:
            await client.close()
        assert got == total, (got, total)
        return total / elapsed

    return asyncio.run(main())


def in_process(total: int, put_batch: int, batch: int, reps: int) -> dict[str, Any]:
    """The controller's handlers driven directly: BeginPut/CommitPut to fill, GetMeta/Ack to drain."""
    from controllers.service import Controller
    from transfer_queue.wire.messages import (
        Ack,
        BeginPut,
        ClusterConfig,
        CommitPut,
        GetMeta,
        RegisterUnit,
        RowInfo,
        Seal,
        UnitInfo,
    )
    from transfer_queue.wire.meta import FieldSpec

    async def main() -> dict[str, Any]:
        ctl = Controller(
            ClusterConfig(num_storage_units=1, storage_capacity=1 << 30), "tcp://127.0.0.1:*", secret="bench"
        )
        ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30, "", ""), "bench"), [])
        ctl.links.pinger.cancel()  # no unit process answers liveness pings in this in-process run
        specs = {FIELD: FieldSpec("int64", ())}
        part = "bench"
        t0 = time.perf_counter()
        done = 0
        while done < total:
            n = min(put_batch, total - done)
            plan = ctl.puts.on_begin_put(BeginPut(part, specs, n, 8), [])  # room at once: no wait
            ctl.puts.landed(plan.indexes[0], 0)  # what unit 0 would report of the put's write
            rows = RowInfo([0] * n, [0] * n, list(range(n)), [0] * n, 0, "", "", [])
            ctl.puts.on_commit_put(CommitPut(part, plan.indexes, specs, rows), [])
            done += n
        put_rate = total / (time.perf_counter() - t0)
        ctl.on_seal(Seal(part), [])
        rates, meta_s = [], []
        for rep in range(reps):
            task = f"inproc-{rep}"
            got = 0
            t0 = time.perf_counter()
            while True:
                t1 = time.perf_counter()
                meta = (await ctl.on_get_meta(GetMeta(part, task, [FIELD], batch), [])).meta
                meta_s.append(time.perf_counter() - t1)
                if not len(meta):
                    break
                ctl.on_ack(Ack(part, task, list(meta.indexes), meta.lease_id), [])
                got += len(meta)
            rates.append(total / (time.perf_counter() - t0))
            assert got == total
        for lease in ctl.scheduler.leases.values():
            lease.timer.cancel()
        ctl.sock.close(linger=0)
        return {
            "put_samples_per_s": put_rate,
            "samples_per_s": median(rates),
            "runs": rates,
            "get_meta_p50_ms": percentile(meta_s, 50) * 1e3,
            "get_meta_p99_ms": percentile(meta_s, 99) * 1e3,
        }

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (< 30 s)")
    p.add_argument("--samples", type=int, default=100_000, help="samples tracked (default 100,000)")
    p.add_argument("--batch", type=int, default=256, help="get_meta batch size (default 256)")
    p.add_argument("--put-batch", type=int, default=1000)
    p.add_argument("--reps", type=int, help="drains per mode (default 3; quick 1)")
    p.add_argument("--workers", type=int, default=4, help="concurrent coroutines in the pipelined mode")
    args = p.parse_args(argv)
    args.reps = args.reps or (1 if args.quick else 3)
    torch.set_num_threads(1)
    t_start = time.time()
    record: dict[str, Any] = {"args": vars(args)}
    with tq.init(num_storage_units=1, storage_capacity="256MiB") as cluster, tq.connect(cluster.address) as client:
        put_rate = fill(client, "bench", args.samples, args.put_batch)
        sync_runs = [drain_sync(client, "bench", f"sync-{r}", args.batch, args.samples) for r in range(args.reps)]
        pipe_runs = [
            drain_pipelined(cluster.address, "bench", f"pipe-{r}", args.batch, args.samples, args.workers)
            for r in range(args.reps)
        ]
        status = client.status()
    inproc = in_process(args.samples, args.put_batch, args.batch, args.reps)

    meta_s = [x for r in sync_runs for x in r["get_meta_s"]]
    ack_s = [x for r in sync_runs for x in r["ack_s"]]
    sync_rate = median(r["samples_per_s"] for r in sync_runs)
    pipe_rate = median(pipe_runs)
    record.update(
        put_samples_per_s=put_rate,
        sync={"samples_per_s": sync_rate, "runs": [r["samples_per_s"] for r in sync_runs]},
        pipelined={"samples_per_s": pipe_rate, "runs": pipe_runs, "workers": args.workers},
        in_process=inproc,
        get_meta_ms={"p50": percentile(meta_s, 50) * 1e3, "p99": percentile(meta_s, 99) * 1e3, "n": len(meta_s)},
        ack_ms={"p50": percentile(ack_s, 50) * 1e3, "p99": percentile(ack_s, 99) * 1e3, "n": len(ack_s)},
        tracked=status.get("partitions", {}).get("bench", {}).get("samples"),
    )
    print_table(
        f"Controller: get_meta(batch {args.batch}) + ack, {args.samples:,} samples tracked, median of {args.reps}",
        ["mode", "samples/s", "get_meta+ack pairs/s", "x target (100k/s)"],
        [
            ["sync client (1 in flight)", sync_rate, sync_rate / args.batch, sync_rate / 1e5],
            [f"AsyncClient, {args.workers} in flight", pipe_rate, pipe_rate / args.batch, pipe_rate / 1e5],
            [
                "in-process handlers (no sockets)",
                inproc["samples_per_s"],
                inproc["samples_per_s"] / args.batch,
                inproc["samples_per_s"] / 1e5,
            ],
        ],
    )
    print_table(
        "Round trips (ms), sync client, ready batches",
        ["call", "p50", "p99", "calls", "target p50/p99"],
        [
            [
                f"get_meta(batch {args.batch})",
                record["get_meta_ms"]["p50"],
                record["get_meta_ms"]["p99"],
                len(meta_s),
                "0.5 / 2",
            ],
            ["ack", record["ack_ms"]["p50"], record["ack_ms"]["p99"], len(ack_s), ""],
            ["get_meta in-process (no sockets)", inproc["get_meta_p50_ms"], inproc["get_meta_p99_ms"], "", ""],
        ],
    )
    print(
        f"fill: {put_rate:,.0f} samples/s through put (BeginPut + Write + CommitPut), "
        f"in-process BeginPut+CommitPut {inproc['put_samples_per_s']:,.0f} samples/s\n"
    )
    record["wall_s"] = time.time() - t_start
    path = write_record("controller", record)
    print(f"wrote {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
