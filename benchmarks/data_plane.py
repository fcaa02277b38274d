"""Benchmark of the core data plane (put -> storage -> get_data), over TCP frames and shared memory.

Workload, per sample: `input_ids` int64[4096], `responses` int64[4096], `log_probs`
float32[4096] (81,920 bytes). Producers put batches of 64/256/1024 samples; the consumer takes
micro-batches of 64 and 256.

- sequential: one process puts N samples, then reads them back (get_meta + get_data + ack +
  clear per micro-batch). Reports put, get and end-to-end rates, and the `get_meta` round trip
  of a ready batch (p50/p99).
- streaming: a producer in another process (multiprocessing spawn) puts N samples and seals the
  partition while this process consumes with `Client.stream` (and `AsyncClient.stream`),
  clearing each micro-batch once acked. Rate = N x 81,920 B / (last micro-batch in hand -
  first put started), clocks compared with `time.time()` across the two processes.
- put latency: one put of 64 new samples at a time (then cleared), and one put of a new
  column for 64 existing samples (`put(td, meta=meta)`), median and p90.
- time to first micro-batch: the consumer waits in `get_meta`; the producer's put of 64 samples
  then completes the micro-batch. Measured from that put's return (in the producer) to the
  consumer holding its meta, and its data (negative: the consumer had it before the put returned).

Every run also counts, per process, the share of the bytes moved that landed in fresh pages
(minor page faults x the page size): data received into memory never touched before pays a
fault and zeroing per page, more than the copy.

The physical limits, raw loopback TCP (`sendall` -> `recv_into` a touched buffer, another
process) and memcpy (torch `copy_` into a touched destination, one thread), are measured in the
same run; every rate is also given as a ratio to both. Results go to results/data_plane-*.json.

    .venv/bin/python benchmarks/data_plane.py            # full run (~3 minutes)
    .venv/bin/python benchmarks/data_plane.py --quick    # < 1 minute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import functools
import multiprocessing as mp
import os
import time
from typing import Any

import torch
from tensordict import TensorDict

import transfer_queue as tq
from benchmarks._common import (
    CpuMeter,
    exit_on_sigterm,
    gbps,
    median,
    percentile,
    physical_limits,
    print_table,
    write_record,
)

SEQ = 4096
FIELDS = {"input_ids": torch.int64, "responses": torch.int64, "log_probs": torch.float32}
SAMPLE_BYTES = sum(SEQ * torch.tensor([], dtype=dt).element_size() for dt in FIELDS.values())  # 81,920
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
NAMES = list(FIELDS)
PATHS = {"tcp": False, "shm": None}


@functools.cache
def make_batch(n: int, seed: int = 0) -> TensorDict:
    """`n` samples of the workload, made once per process (puts never change them), so that a
    measured run allocates nothing of its own."""
    g = torch.Generator().manual_seed(seed)
    return TensorDict(
        {
            "input_ids": torch.randint(0, 150_000, (n, SEQ), dtype=torch.int64, generator=g),
            "responses": torch.randint(0, 150_000, (n, SEQ), dtype=torch.int64, generator=g),
            "log_probs": -torch.rand((n, SEQ), generator=g),
        },
        batch_size=[n],
    )


# -- the producer process -------------------------------------------------------------------


def producer_main(address: str, use_shm: bool | None, conn) -> None:
    """Serve put commands from the benchmark over a pipe until told to stop."""
    torch.set_num_threads(1)
    client = tq.connect(address, use_shm=use_shm)
    batches: dict[int, TensorDict] = {}

    def batch(n: int) -> TensorDict:
        if n not in batches:
            batches[n] = make_batch(n, seed=n)
        return batches[n]

    conn.send(("ready", bool(client.mapped_units)))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            break
        if cmd == "warm":
            for n in args[0]:
                batch(n)
            conn.send("ok")
        elif cmd == "stream":
            partition, total, put_batch = args
            td = batch(put_batch)
            conn.send("go")
            t0 = time.time()
            done = 0
            while done < total:
                n = min(put_batch, total - done)
                client.put(td if n == put_batch else td[:n], partition=partition)
                done += n
            t1 = time.time()
            client.seal(partition)
            conn.send((t0, t1))
        elif cmd == "put":  # (partition, n, delay): sleep, put n samples, report when it returned
            partition, n, delay = args
            td = batch(n)
            time.sleep(delay)
            t0 = time.time()
            client.put(td, partition=partition)
            conn.send((t0, time.time()))
    client.close()


class Producer:
    def __init__(self, address: str, use_shm: bool | None, warm: list[int]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(address, use_shm, child), daemon=True)
        self.proc.start()
        _tag, self.shm = self.conn.recv()
        self.call("warm", warm)

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def recv(self) -> Any:
        if not self.conn.poll(300):
            raise RuntimeError("the producer process did not answer within 300 s")
        return self.conn.recv()

    def call(self, *msg: Any) -> Any:
        self.send(*msg)
        return self.recv()

    def stop(self) -> None:
        self.send("stop")
        self.proc.join(30)


# -- measurements -------------------------------------------------------------------------

_run_ids = iter(range(1, 1 << 30))


def part_name(tag: str) -> str:
    return f"{tag}-{next(_run_ids)}"


def sequential(client: tq.Client, total: int, put_batch: int, micro: int) -> dict[str, Any]:
    partition = part_name(f"seq-p{put_batch}-c{micro}")
    td = make_batch(put_batch, seed=put_batch)
    t0 = time.perf_counter()
    for _ in range(total // put_batch):
        client.put(td, partition=partition)
    t_put = time.perf_counter() - t0
    client.seal(partition)
    rtts, got = [], 0
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        meta = client.get_meta(NAMES, micro, task="train", partition=partition, timeout=30)
        rtts.append(time.perf_counter() - t1)
        if not len(meta):
            break
        batch = client.get_data(meta)
        got += batch.batch_size[0]
        client.ack(meta)
        client.clear(meta)
        del batch
    t_get = time.perf_counter() - t0
    assert got == total, (got, total)
    nbytes = total * SAMPLE_BYTES
    return {
        "put_gbps": gbps(nbytes, t_put),
        "get_gbps": gbps(nbytes, t_get),
        "e2e_gbps": gbps(nbytes, t_put + t_get),
        "get_meta_s": rtts[:-1],  # the last call answers "drained" with an empty batch
        "bytes": nbytes,
    }


def streaming(client: tq.Client, producer: Producer, total: int, put_batch: int, micro: int) -> dict[str, Any]:
    partition = part_name(f"stream-p{put_batch}-c{micro}")
    producer.send("stream", partition, total, put_batch)
    assert producer.recv() == "go"
    got, prev, t_last = 0, None, 0.0
    for batch, meta in client.stream(NAMES, micro, task="train", partition=partition, timeout=60):
        if prev is not None:
            client.clear(prev)  # acked when this batch was taken
        got += batch.batch_size[0]
        if got == total:
            t_last = time.time()
        prev = meta
    client.clear(prev)
    t0, t1 = producer.recv()
    assert got == total, (got, total)
    return {
        "e2e_gbps": gbps(total * SAMPLE_BYTES, t_last - t0),
        "producer_gbps": gbps(total * SAMPLE_BYTES, t1 - t0),
        "bytes": total * SAMPLE_BYTES,
    }


def streaming_async(
    address: str, use_shm: bool | None, producer: Producer, total: int, put_batch: int, micro: int
) -> dict[str, Any]:
    partition = part_name(f"astream-p{put_batch}-c{micro}")

    async def consume() -> float:
        client = await tq.connect_async(address, use_shm=use_shm)
        try:
            producer.send("stream", partition, total, put_batch)
            assert producer.recv() == "go"
            got, prev, t_last = 0, None, 0.0
            async for batch, meta in client.stream(NAMES, micro, task="train", partition=partition, timeout=60):
                if prev is not None:
                    await client.clear(prev)
                got += batch.batch_size[0]
                if got == total:
                    t_last = time.time()
                prev = meta
            await client.clear(prev)
            assert got == total, (got, total)
            return t_last
        finally:
            await client.close()

    t_last = asyncio.run(consume())
    t0, _ = producer.recv()
    return {"e2e_gbps": gbps(total * SAMPLE_BYTES, t_last - t0)}


def first_batch(client: tq.Client, producer: Producer, micro: int, trials: int, put: int = 64) -> dict[str, Any]:
    """Consumer parked in get_meta; the producer's put of `put` samples completes the micro-batch."""
    partition = part_name(f"ttfb-c{micro}")
    to_meta, to_data = [], []
    for _ in range(trials + 1):  # the first trial warms up
        if micro > put:
            producer.call("put", partition, micro - put, 0.0)
        producer.send("put", partition, put, 0.02)
        meta = client.get_meta(NAMES, micro, task="train", partition=partition, timeout=30)
        t_meta = time.time()
        batch = client.get_data(meta)
        t_data = time.time()
        _, t_put = producer.recv()
        assert batch.batch_size[0] == micro
        client.ack(meta)
        client.clear(meta)
        to_meta.append(t_meta - t_put)
        to_data.append(t_data - t_put)
    return {"to_meta_s": to_meta[1:], "to_data_s": to_data[1:]}


SMALL = 8
"""Samples of the small put (1 KiB each): its latency is mostly round trips, not bytes."""


def put_latency(client: tq.Client, trials: int, n: int = 64) -> dict[str, Any]:
    """Seconds one put of `n` new samples takes (each cleared after), one at a time, and one of
    `SMALL` samples of 1 KiB (x 8 as many); and one put of a new 1 KiB-per-sample column for `n`
    existing samples (`put(td, meta=meta)`)."""
    partition = part_name(f"lat-p{n}")
    rows, small, columns = [], [], []
    for td, out, times in ((make_batch(n, seed=n), rows, trials), (_small(), small, 8 * trials)):
        for _ in range(times + 1):  # the first warms up
            t0 = time.perf_counter()
            meta = client.put(td, partition=f"{partition}-{td.batch_size[0]}")
            out.append(time.perf_counter() - t0)
            client.clear(meta)
    td = make_batch(n, seed=n)
    meta = client.put(td, partition=partition)
    for i in range(trials + 1):
        column = TensorDict({f"col{i}": torch.zeros(n, 256)}, batch_size=[n])
        t0 = time.perf_counter()
        client.put(column, meta=meta)
        columns.append(time.perf_counter() - t0)
    client.clear(meta)
    return {"put_s": rows[1:], "put_small_s": small[1:], "put_columns_s": columns[1:], "n": n}


def _small() -> TensorDict:
    return TensorDict({"x": torch.ones(SMALL, 256)}, batch_size=[SMALL])


# -- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)  # copies run single-threaded (docs/architecture.md, section 3)
    limits = physical_limits(256 << 20, 3)
    print(
        f"physical limits: loopback TCP {limits['tcp_gbps']:.2f} GB/s, memcpy {limits['memcpy_gbps']:.2f} GB/s "
        f"(medians of {len(limits['tcp_runs'])} / {len(limits['memcpy_runs'])})\n",
        flush=True,
    )
    record: dict[str, Any] = {
        "args": vars(args),
        "sample_bytes": SAMPLE_BYTES,
        "limits": limits,
        "rows": [],
        "ttfb": [],
        "get_meta": [],
        "put_latency": [],
    }
    for path in args.paths:
        use_shm = PATHS[path]
        with tq.init(num_storage_units=args.units, storage_capacity=args.capacity) as cluster:
            client = tq.connect(cluster.address, use_shm=use_shm)
            assert bool(client.mapped_units) == (use_shm is None), "shm path wanted but the arenas are not mapped"
            producer = Producer(cluster.address, use_shm, args.put_batches)
            pids = {
                "consumer": os.getpid(),
                "producer": producer.proc.pid,
                "controller": cluster.services[0]["pid"],
                **{f"unit{i}": s["pid"] for i, s in enumerate(cluster.services[1:])},
            }
            try:
                time.sleep(args.settle)  # the units pre-fault their arenas in the background
                # warm-up, not recorded: maps the arenas' pages into both clients, fills the pools
                sequential(client, args.samples, max(args.put_batches), max(args.micro_batches))
                streaming(client, producer, args.samples, max(args.put_batches), max(args.micro_batches))
                for put_batch in args.put_batches:
                    for micro in args.micro_batches:
                        runs = {"seq": [], "stream": [], "astream": []}
                        for _ in range(args.reps):
                            meter = CpuMeter(pids).start()
                            res = sequential(client, args.samples, put_batch, micro)
                            res["faults"] = meter.stop().faults
                            runs["seq"].append(res)
                            meter = CpuMeter(pids).start()
                            res = streaming(client, producer, args.samples, put_batch, micro)
                            meter.stop()
                            res["cpu_s"], res["wall_s"], res["faults"] = meter.used, meter.wall, meter.faults
                            runs["stream"].append(res)
                            if args.async_stream:
                                runs["astream"].append(
                                    streaming_async(cluster.address, use_shm, producer, args.samples, put_batch, micro)
                                )
                        record["rows"].append(summarize(path, put_batch, micro, runs))
                        print_progress(record["rows"][-1])
                for micro in args.micro_batches:
                    ttfb = first_batch(client, producer, micro, args.trials)
                    record["ttfb"].append({"path": path, "micro": micro, **ttfb})
                record["put_latency"].append({"path": path, **put_latency(client, args.trials * 4)})
            finally:
                producer.stop()
                client.close()
    return record


def summarize(path: str, put_batch: int, micro: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    row: dict[str, Any] = {"path": path, "put_batch": put_batch, "micro": micro, "runs": runs}
    for mode, key in (
        ("seq", "put_gbps"),
        ("seq", "get_gbps"),
        ("seq", "e2e_gbps"),
        ("stream", "e2e_gbps"),
        ("astream", "e2e_gbps"),
    ):
        if runs[mode]:
            row[f"{mode}_{key}"] = median(r[key] for r in runs[mode])
    row["get_meta_s"] = [x for r in runs["seq"] for x in r["get_meta_s"]]
    row["stream_cpu_s_per_gb"] = cpu_per_gb(runs["stream"])
    row["fresh_pages"] = {mode: fresh_pages(runs[mode]) for mode in ("seq", "stream")}
    return row


def fresh_pages(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per process, the share of the bytes moved over all `runs` that landed in fresh pages:
    minor page faults x the page size / bytes."""
    if not runs:
        return {}
    nbytes = len(runs) * runs[0]["bytes"]
    return {k: sum(r["faults"][k] for r in runs) * PAGE_SIZE / nbytes for k in runs[0]["faults"]}


def cpu_per_gb(runs: list[dict[str, Any]]) -> dict[str, float]:
    """CPU seconds per GB moved over all `runs` (summed: one run is too short for 10 ms ticks)."""
    if not runs:
        return {}
    gb = len(runs) * runs[0]["bytes"] / 1e9
    keys = runs[0]["cpu_s"].keys()
    used = {k: sum(sum(r["cpu_s"][k]) for r in runs) for k in keys}
    system = sum(r["cpu_s"][k][1] for r in runs for k in keys)
    total = sum(used.values())
    return {
        **{k: v / gb for k, v in used.items()},
        "total": total / gb,
        "system_share": system / total if total else float("nan"),
        "cores_busy": total / sum(r["wall_s"] for r in runs),
    }


def print_progress(row: dict[str, Any]) -> None:
    print(
        f"  {row['path']} put {row['put_batch']:>4} micro {row['micro']:>3}: seq put {row['seq_put_gbps']:.2f} "
        f"get {row['seq_get_gbps']:.2f} e2e {row['seq_e2e_gbps']:.2f}, stream {row['stream_e2e_gbps']:.2f} GB/s"
        + (f", async stream {row['astream_e2e_gbps']:.2f}" if "astream_e2e_gbps" in row else ""),
        flush=True,
    )


def report(record: dict[str, Any]) -> None:
    tcp, mem = record["limits"]["tcp_gbps"], record["limits"]["memcpy_gbps"]
    reps = record["args"]["reps"]
    ncores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print()
    print_table(
        f"Physical limits (this run): loopback TCP {tcp:.2f} GB/s, memcpy {mem:.2f} GB/s",
        ["limit", "GB/s", "runs"],
        [
            ["loopback TCP socket", tcp, " ".join(f"{x:.2f}" for x in record["limits"]["tcp_runs"])],
            ["memcpy (torch copy_, 1 thread)", mem, " ".join(f"{x:.2f}" for x in record["limits"]["memcpy_runs"])],
        ],
    )
    rows = []
    for r in record["rows"]:
        for label, key in (
            ("seq put", "seq_put_gbps"),
            ("seq get", "seq_get_gbps"),
            ("seq end-to-end", "seq_e2e_gbps"),
            ("stream (Client)", "stream_e2e_gbps"),
            ("stream (AsyncClient)", "astream_e2e_gbps"),
        ):
            if key not in r:
                continue
            v = r[key]
            rows.append(
                [r["path"], r["put_batch"], r["micro"], label, v * 1e3, v * 1e9 / SAMPLE_BYTES, v / tcp, v / mem]
            )
    print_table(
        f"Throughput, {record['args']['samples']} samples x {SAMPLE_BYTES:,} B per run, median of {reps}",
        ["path", "put", "micro", "mode", "MB/s", "samples/s", "x socket", "x memcpy"],
        rows,
    )
    rows = []
    socket_cpu = record["limits"].get("tcp_cpu_s_per_gb", float("nan"))
    for r in record["rows"]:
        c = r["stream_cpu_s_per_gb"]
        if not c or not c["total"]:  # a quick run can be shorter than a clock tick
            continue
        units = sum(v for k, v in c.items() if k.startswith("unit"))
        ceiling = ncores / c["total"]
        crossings = 2 if r["path"] == "tcp" else 0  # producer -> unit, unit -> consumer
        rows.append(
            [
                r["path"],
                r["put_batch"],
                r["micro"],
                c["consumer"],
                c["producer"],
                c["controller"],
                units,
                c["total"],
                c["total"] / (crossings * socket_cpu) if crossings else float("nan"),
                c["system_share"],
                c["cores_busy"],
                ceiling,
                r["stream_e2e_gbps"] / ceiling,
            ]
        )
    print_table(
        f"CPU cost of streaming (Client), CPU-seconds per GB, summed over {reps} runs. Ceiling = {ncores} cores / total. "
        f"Raw loopback TCP costs {socket_cpu:.2f} CPU-s/GB (both ends); the TCP path crosses loopback twice "
        "(x 2 sockets = total / twice that: 1.0 would be all socket, nothing else)",
        [
            "path",
            "put",
            "micro",
            "consumer",
            "producer",
            "controller",
            "units",
            "total",
            "x 2 sockets",
            "sys share",
            "cores busy",
            "ceiling GB/s",
            "x ceiling",
        ],
        rows,
    )
    rows = []
    for r in record["rows"]:
        for mode, fresh in r["fresh_pages"].items():
            units = sum(v for k, v in fresh.items() if k.startswith("unit"))
            rows.append([r["path"], r["put_batch"], r["micro"], mode, fresh["consumer"], fresh["producer"], units])
    print_table(
        "Fresh pages: the share of the bytes moved that landed in memory never touched before (minor page faults "
        f"x {PAGE_SIZE} B / bytes; a fault and zeroing cost more than copying the page). seq: one process puts, "
        "then gets (the consumer column)",
        ["path", "put", "micro", "mode", "consumer", "producer", "units"],
        rows,
    )
    rows = []
    for t in record["ttfb"]:
        rows.append(
            [
                t["path"],
                t["micro"],
                median(t["to_meta_s"]) * 1e3,
                percentile(t["to_meta_s"], 90) * 1e3,
                median(t["to_data_s"]) * 1e3,
                percentile(t["to_data_s"], 90) * 1e3,
                len(t["to_meta_s"]),
            ]
        )
    print_table(
        "Time to first micro-batch, from the completing put's return (ms; negative: the consumer had it first)",
        ["path", "micro", "meta p50", "meta p90", "data p50", "data p90", "trials"],
        rows,
    )
    rows = []
    for path in record["args"]["paths"]:
        for micro in record["args"]["micro_batches"]:
            xs = [x for r in record["rows"] if r["path"] == path and r["micro"] == micro for x in r["get_meta_s"]]
            rec = {
                "path": path,
                "micro": micro,
                "p50_ms": percentile(xs, 50) * 1e3,
                "p99_ms": percentile(xs, 99) * 1e3,
                "n": len(xs),
            }
            record["get_meta"].append(rec)
            rows.append([path, micro, rec["p50_ms"], rec["p99_ms"], rec["n"]])
    print_table("get_meta round trip of a ready batch (ms)", ["path", "micro", "p50", "p99", "calls"], rows)
    rows = [
        [r["path"], what, n, median(r[key]) * 1e3, percentile(r[key], 90) * 1e3, len(r[key])]
        for r in record["put_latency"]
        for what, key, n in (
            ("new samples", "put_s", r["n"]),
            ("new samples, 1 KiB", "put_small_s", SMALL),
            ("new column", "put_columns_s", r["n"]),
        )
    ]
    print_table("Latency of one put, one at a time (ms)", ["path", "put of", "samples", "p50", "p90", "puts"], rows)
    targets(record)


def targets(record: dict[str, Any]) -> None:
    tcp = record["limits"]["tcp_gbps"]
    out = []

    def check(what: str, value: float, target: float, higher: bool = True, unit: str = "") -> None:
        ok = value >= target if higher else value <= target
        ratio = value / target if target else float("nan")
        out.append({"target": what, "value": value, "goal": target, "met": ok, "ratio": ratio})
        rows.append(
            [
                what,
                f"{value:.3g}{unit}",
                f"{'>=' if higher else '<='} {target:g}{unit}",
                "met" if ok else "MISSED",
                f"{ratio:.2f}",
            ]
        )

    rows: list[list[Any]] = []
    for r in record["rows"]:
        if r["micro"] != 256:
            continue
        if r["path"] == "tcp":
            check(f"tcp stream, put {r['put_batch']}, micro 256 (GB/s)", r["stream_e2e_gbps"], 1.0)
            check(f"tcp stream, put {r['put_batch']}, micro 256 (x socket)", r["stream_e2e_gbps"] / tcp, 0.5)
        else:
            check(f"shm stream, put {r['put_batch']}, micro 256 (GB/s)", r["stream_e2e_gbps"], 3.0)
    for t in record["ttfb"]:
        check(f"{t['path']} first micro-batch {t['micro']}, meta (ms)", median(t["to_meta_s"]) * 1e3, 5.0, False)
        check(f"{t['path']} first micro-batch {t['micro']}, data (ms)", median(t["to_data_s"]) * 1e3, 5.0, False)
    for g in record["get_meta"]:
        check(f"{g['path']} get_meta micro {g['micro']} p50 (ms)", g["p50_ms"], 0.5, False)
        check(f"{g['path']} get_meta micro {g['micro']} p99 (ms)", g["p99_ms"], 2.0, False)
    record["targets"] = out
    print_table("Targets (ratio = value / goal)", ["target", "value", "goal", "", "ratio"], rows)


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (< 1 minute)")
    p.add_argument("--samples", type=int, help="samples per run (default 8192; quick 1024)")
    p.add_argument("--reps", type=int, help="repetitions per figure, medians reported (default 3)")
    p.add_argument("--trials", type=int, help="time-to-first-micro-batch trials (default 30; quick 8)")
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--put-batches", nargs="+", type=int, default=[64, 256, 1024])
    p.add_argument("--micro-batches", nargs="+", type=int, default=[64, 256])
    p.add_argument("--no-async", dest="async_stream", action="store_false", help="skip the AsyncClient.stream runs")
    p.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    p.add_argument("--capacity", default="4GiB", help="total storage capacity (default 4GiB)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds to let the units pre-fault their arenas")
    args = p.parse_args(argv)
    args.samples = args.samples or (1024 if args.quick else 8192)
    args.reps = args.reps or 3  # a single 84 MB quick run swings 0.2-0.7x the socket on a shared machine
    args.trials = args.trials or (8 if args.quick else 30)
    if args.quick and argv is None and "--no-async" not in sys.argv:
        args.async_stream = False
    t0 = time.time()
    record = run(args)
    report(record)
    record["wall_s"] = time.time() - t0
    path = write_record("data_plane", record)
    print(f"wrote {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
