"""Overhead of staleness control: samples/s of the produce-consume loop with and without it.

Two clusters run side by side in the same run: `plain` (no η: no admission, no bound) and
`controlled` (η = `--eta`, default 4; `consumer_batch_size` = the trainer's batch). The loop, per
trainer batch of `--batch` samples:

- plain:      put (in chunks of `--chunk`)                        + get_meta + ack
- controlled: acquire(`--gen` slots) + put under the grant (chunks) + get_meta (bounded) + ack
              + set_version (the trainer publishes a version every batch: the worst case)

Two shapes, each repeated `--reps` times, the modes interleaved so load drifts hit both:

- pipeline:   producers in other processes (multiprocessing spawn) put while this process
              consumes until the partition, sealed once the producers are done, is drained;
              rate = samples consumed / (first put started -> last ack), clocks compared with
              `time.time()`. This is how an RL job runs. Samples a slow producer delivers more
              than η versions late are dropped, not consumed: the rate counts only consumed
              samples, and the drops are reported. With P producers each holding a grant of
              `--gen` slots while the trainer publishes a version per `--batch`, a grant's last
              samples are already ~P x gen / batch versions old: η = 2 with the defaults drops
              a good share under load, so the default η (4) leaves room for that.
- sequential: one process does every step in turn, so each extra round trip shows in full.
              Also reported: controller requests per trainer batch, and CPU time per sample
              of this process plus the cluster's service processes (much less sensitive to
              other load on a shared machine than the rates).

Each sample is `input_ids` int64[--seq] + `log_probs` float32[--seq]. Rates are medians;
the ratio controlled / plain is printed with the target (at most 10% slower), as the median of
the per-repetition ratios (both modes back to back, so under the same load) and as the ratio of
the median rates. Results go to results/staleness-*.json.

    .venv/bin/python benchmarks/staleness.py            # full run (a few minutes)
    .venv/bin/python benchmarks/staleness.py --quick    # < 1 minute
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import itertools
import multiprocessing as mp
import os
import threading
import time
from typing import Any

import torch
from tensordict import TensorDict

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, median, print_table, write_record

MODES = ("plain", "controlled")
_names = itertools.count()


def make_rows(n: int, seq: int) -> TensorDict:
    return TensorDict(
        {"input_ids": torch.randint(0, 150_000, (n, seq), dtype=torch.int64), "log_probs": -torch.rand(n, seq)},
        batch_size=[n],
    )


# -- producer side (also run in spawned processes) ---------------------------------------------


def produce(
    client: tq.Client, partition: str, total: int, gen: int, chunk: int, controlled: bool, data: TensorDict
) -> None:
    """Put `total` samples: with a grant per `gen` samples when controlled, in puts of `chunk`."""
    made = 0
    while made < total:
        n = min(gen, total - made)
        if controlled:
            with client.acquire(n, timeout=120) as grant:
                for k in range(0, n, chunk):
                    client.put(data[: min(chunk, n - k)], partition=partition, grant=grant)
        else:
            for k in range(0, n, chunk):
                client.put(data[: min(chunk, n - k)], partition=partition)
        made += n


def producer_job(address: str, partition: str, total: int, gen: int, chunk: int, controlled: bool, seq: int) -> float:
    """One pipeline producer; returns the wall-clock time (time.time()) its first put started."""
    torch.set_num_threads(1)
    data = make_rows(chunk, seq)
    with tq.connect(address) as client:
        start = time.time()
        produce(client, partition, total, gen, chunk, controlled, data)
    return start


def warm(_: int = 0) -> int:
    torch.set_num_threads(1)
    make_rows(1, 8)
    return 0


# -- CPU accounting ---------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes `pids` have used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def cluster_cpu_seconds(cluster: tq.Cluster) -> float:
    """CPU time the cluster's service processes have used so far."""
    return cpu_seconds([service["pid"] for service in cluster.services])


# -- consumer side -------------------------------------------------------------------------------


def consume(client: tq.Client, partition: str, batch: int, controlled: bool) -> tuple[int, float]:
    """Take and ack (and, controlled, publish a version per batch) until the sealed partition is
    drained; returns (samples consumed, time.time() of the last ack)."""
    got, last = 0, time.time()
    version = client.get_version()
    while True:
        meta = client.get_meta(["input_ids", "log_probs"], batch, task="train", partition=partition, timeout=120)
        if not len(meta):
            return got, last
        client.ack(meta)
        got += len(meta)
        last = time.time()
        if controlled:
            version += 1
            client.set_version(version)


def run_pipeline(cluster: tq.Cluster, pool, args: argparse.Namespace, controlled: bool) -> dict[str, Any]:
    partition = f"p{next(_names)}"
    per = args.samples // args.producers
    workers = [w.pid for w in pool._pool]  # noqa: SLF001 - the producer processes, for their CPU time
    cpu = time.process_time() + cluster_cpu_seconds(cluster) + cpu_seconds(workers)
    jobs = [
        pool.apply_async(producer_job, (cluster.address, partition, per, args.gen, args.chunk, controlled, args.seq))
        for _ in range(args.producers)
    ]

    def seal_when_done() -> None:
        for job in jobs:
            job.wait(300)
        with cluster.connect() as c:
            c.seal(partition)

    sealer = threading.Thread(target=seal_when_done)
    sealer.start()
    with cluster.connect() as client:
        before = client.status()["staleness"]["dropped"]
        consumed, end = consume(client, partition, args.batch, controlled)
        sealer.join(60)
        starts = [job.get(60) for job in jobs]
        cpu = time.process_time() + cluster_cpu_seconds(cluster) + cpu_seconds(workers) - cpu
        dropped = client.status()["staleness"]["dropped"] - before
        client.clear_partition(partition)
    seconds = end - min(starts)
    return {
        "samples": consumed,
        "dropped": dropped,
        "seconds": seconds,
        "samples_per_s": consumed / seconds,
        "cpu_us_per_sample": 1e6 * cpu / consumed,
    }


def run_sequential(cluster: tq.Cluster, args: argparse.Namespace, controlled: bool, data: TensorDict) -> dict[str, Any]:
    partition = f"s{next(_names)}"
    total = args.samples
    with cluster.connect() as client:
        version = client.get_version()
        requests = client.status()["counters"]["requests_served"]
        cpu = time.process_time() + cluster_cpu_seconds(cluster)
        start = time.perf_counter()
        done = 0
        while done < total:
            produce(client, partition, args.batch, args.gen, args.chunk, controlled, data)
            meta = client.get_meta(
                ["input_ids", "log_probs"], args.batch, task="train", partition=partition, timeout=60
            )
            client.ack(meta)
            done += len(meta)
            if controlled:
                version += 1
                client.set_version(version)
        seconds = time.perf_counter() - start
        cpu = time.process_time() + cluster_cpu_seconds(cluster) - cpu
        # controller requests of the loop (the first status's own reply is counted after it)
        requests = client.status()["counters"]["requests_served"] - requests - 1
        client.clear_partition(partition)
    return {
        "samples": done,
        "seconds": seconds,
        "samples_per_s": done / seconds,
        "controller_requests_per_batch": requests * args.batch / done,
        "cpu_us_per_sample": 1e6 * cpu / done,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    common = dict(num_storage_units=args.units, storage_capacity=args.capacity)
    clusters = {
        "plain": tq.init(**common),
        "controlled": tq.init(**common, max_staleness=args.eta, consumer_batch_size=args.batch),
    }
    data = make_rows(args.chunk, args.seq)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {shape: {m: [] for m in MODES} for shape in args.shapes}
    try:
        with mp.get_context("spawn").Pool(args.producers) as pool:
            pool.map(warm, range(args.producers))  # import torch in the workers before timing
            for rep in range(args.reps + 1):  # repetition 0 warms up and is not counted
                order = MODES if rep % 2 else MODES[::-1]
                for shape in args.shapes:
                    for mode in order:
                        controlled = mode == "controlled"
                        if shape == "pipeline":
                            row = run_pipeline(clusters[mode], pool, args, controlled)
                        else:
                            row = run_sequential(clusters[mode], args, controlled, data)
                        if rep:
                            runs[shape][mode].append(row)
                        print(
                            f"  {'warm-up' if not rep else f'rep {rep}'}  {shape:<10} {mode:<10} "
                            f"{row['samples_per_s']:>10,.0f} samples/s  dropped {row.get('dropped', 0)}",
                            flush=True,
                        )
        with clusters["controlled"].connect() as client:
            final = client.status()
    finally:
        for cluster in clusters.values():
            cluster.shutdown()
    return {
        "runs": runs,
        "controlled_status": {
            "staleness": final["staleness"],
            "admission": final["admission"],
            "version": final["version"],
        },
    }


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """Per shape: median rates, and the median of the per-repetition ratios (each repetition ran
    both modes back to back, so a ratio compares runs under the same load)."""
    out = {}
    for shape, by_mode in record["runs"].items():
        rates = {m: median(r["samples_per_s"] for r in by_mode[m]) for m in MODES}
        paired = [c["samples_per_s"] / p["samples_per_s"] for p, c in zip(by_mode["plain"], by_mode["controlled"])]
        ratio = median(paired)
        out[shape] = {
            **{f"{m}_samples_per_s": rates[m] for m in MODES},
            "ratio_of_medians": rates["controlled"] / rates["plain"],
            "paired_ratios": paired,
            "ratio": ratio,
            "slowdown_pct": 100 * (1 - ratio),
            "controlled_dropped": sum(r.get("dropped", 0) for r in by_mode["controlled"]),
            "controlled_samples": sum(r["samples"] for r in by_mode["controlled"]),
        }
        for key in ("controller_requests_per_batch", "cpu_us_per_sample"):
            if key in by_mode["plain"][0]:
                out[shape][key] = {m: median(r[key] for r in by_mode[m]) for m in MODES}
    return out


def report(record: dict[str, Any], args: argparse.Namespace) -> None:
    summary = record["summary"]
    rows = []
    for shape, s in summary.items():
        ok = "yes" if s["slowdown_pct"] <= 10.0 else "NO"
        spread = f"{min(s['paired_ratios']):.2f}-{max(s['paired_ratios']):.2f}"
        rows.append(
            [
                shape,
                s["plain_samples_per_s"],
                s["controlled_samples_per_s"],
                s["ratio_of_medians"],
                s["ratio"],
                spread,
                f"{s['slowdown_pct']:.1f}%",
                ok,
                s["controlled_dropped"],
            ]
        )
    print_table(
        f"Staleness control overhead: {args.reps} reps, {args.samples} samples/run, batch {args.batch}, "
        f"grant {args.gen}, put chunk {args.chunk}, seq {args.seq}, η = {args.eta}",
        [
            "shape",
            "plain/s",
            "controlled/s",
            "ratio of medians",
            "paired ratio (median)",
            "range",
            "slowdown",
            "≤ 10%",
            "dropped",
        ],
        rows,
    )
    for shape, s in summary.items():
        if "controller_requests_per_batch" in s:
            per = s["controller_requests_per_batch"]
            print(
                f"{shape}: controller requests per trainer batch of {args.batch}: plain {per['plain']:.1f}, "
                f"controlled {per['controlled']:.1f} (+{per['controlled'] / per['plain'] - 1:.0%}); storage "
                "requests are the same in both"
            )
        cpu = s["cpu_us_per_sample"]
        print(
            f"{shape}: CPU time per consumed sample (all processes of the loop and the cluster, medians): "
            f"plain {cpu['plain']:.0f} µs, controlled {cpu['controlled']:.0f} µs "
            f"({cpu['controlled'] / cpu['plain'] - 1:+.1%}); less sensitive to other load than the rates"
        )
    st = record["controlled_status"]
    print(
        f"controlled cluster after the runs: version {st['version']}, stale {st['staleness']}, "
        f"admission waits {st['admission']['waits']} ({st['admission']['wait_seconds']:.2f}s)\n"
    )


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small run (< 1 minute)")
    p.add_argument("--samples", type=int, help="samples per run (default 4096; quick 2048)")
    p.add_argument("--reps", type=int, help="repetitions per figure (default 9; quick 3)")
    p.add_argument("--eta", type=int, default=4, help="η of the controlled cluster (default 4)")
    p.add_argument("--batch", type=int, default=64, help="trainer batch = consumer_batch_size (default 64)")
    p.add_argument("--gen", type=int, default=64, help="slots per acquire (default 64)")
    p.add_argument("--chunk", type=int, default=16, help="samples per put (default 16)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sample (default 1024)")
    p.add_argument("--producers", type=int, default=2, help="producer processes in the pipeline (default 2)")
    p.add_argument("--shapes", nargs="+", choices=["pipeline", "sequential"], default=["pipeline", "sequential"])
    p.add_argument("--units", type=int, default=2, help="storage units per cluster (default 2)")
    p.add_argument("--capacity", default="1GiB", help="storage capacity per cluster (default 1GiB)")
    args = p.parse_args(argv)
    args.samples = args.samples or (2048 if args.quick else 4096)
    args.reps = max(3, args.reps or (3 if args.quick else 9))
    record = run(args)
    record["summary"] = summarize(record)
    record["settings"] = {k: v for k, v in vars(args).items()}
    report(record, args)
    path = write_record("staleness", record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
