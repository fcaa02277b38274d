"""Benchmark of `stream`'s prefetch: a consumer reading a filled, sealed partition, so that the
consumer alone sets the pace (in `data_plane.py` a producer runs beside it and usually does).

Per micro-batch the caller clears the batch before (as `data_plane.py`'s streaming loop does),
then works `--work-ms` (a sleep: the CPU idles as it does while a training step runs on a GPU).
Modes, each over the same data, alternating within one run:

- sequential: `get_meta`, `get_data`, `ack`, `clear`, then the work: nothing overlaps.
- stream (Client) and stream (AsyncClient): the next micro-batch's lease and data are fetched
  while the caller works on the current one.

Reported: medians of GB/s (N x 81,920 B / wall time), each stream's ratio to the sequential
reads of the same repetition (so that the machine's load cancels out of the ratio), and the
median time the caller waits for a batch: what a prefetch hides.

    .venv/bin/python benchmarks/stream_prefetch.py                # tcp and shm, work 0 and 20 ms
    .venv/bin/python benchmarks/stream_prefetch.py --paths tcp --work-ms 5
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import itertools
import time
from typing import Any

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, gbps, median, print_table, write_record
from benchmarks.data_plane import NAMES, PATHS, SAMPLE_BYTES, make_batch

_parts = itertools.count()


def fill(client: tq.Client, samples: int, put_batch: int) -> str:
    partition = f"prefetch-{next(_parts)}"
    batch = make_batch(put_batch)
    for _ in range(samples // put_batch):
        client.put(batch, partition=partition)
    client.seal(partition)
    return partition


def sequential(client: tq.Client, partition: str, micro: int, work: float) -> tuple[float, list[float]]:
    """(wall time, the caller's wait for each batch: get_meta + get_data)."""
    waits = []
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        meta = client.get_meta(NAMES, micro, task="train", partition=partition, timeout=30)
        if not len(meta):
            break
        client.get_data(meta)
        waits.append(time.perf_counter() - t1)
        client.ack(meta)
        client.clear(meta)
        time.sleep(work)
    return time.perf_counter() - t0, waits


def stream(client: tq.Client, partition: str, micro: int, work: float) -> tuple[float, list[float]]:
    """(wall time, the caller's wait for each batch: taking it from the iterator)."""
    batches = iter(client.stream(NAMES, micro, task="train", partition=partition, timeout=30))
    prev, waits = None, []
    t0 = time.perf_counter()
    while True:
        t1 = time.perf_counter()
        if (item := next(batches, None)) is None:
            break
        waits.append(time.perf_counter() - t1)
        if prev is not None:
            client.clear(prev)  # acked when this batch was taken
        prev = item[1]
        time.sleep(work)
    elapsed = time.perf_counter() - t0
    client.clear(prev)
    return elapsed, waits


def stream_async(
    address: str, use_shm: bool | None, partition: str, micro: int, work: float
) -> tuple[float, list[float]]:
    """As `stream`, with an `AsyncClient` (the work is an `asyncio.sleep`)."""

    async def consume() -> tuple[float, list[float]]:
        client = await tq.connect_async(address, use_shm=use_shm)
        try:
            batches = aiter(client.stream(NAMES, micro, task="train", partition=partition, timeout=30))
            prev, waits = None, []
            t0 = time.perf_counter()
            while True:
                t1 = time.perf_counter()
                if (item := await anext(batches, None)) is None:
                    break
                waits.append(time.perf_counter() - t1)
                if prev is not None:
                    await client.clear(prev)
                prev = item[1]
                await asyncio.sleep(work)
            elapsed = time.perf_counter() - t0
            await client.clear(prev)
            return elapsed, waits
        finally:
            await client.close()

    return asyncio.run(consume())


MODES = ("seq", "stream", "astream")


def run(args: argparse.Namespace) -> dict[str, Any]:
    nbytes = args.samples * SAMPLE_BYTES
    rows = []
    for path in args.paths:
        use_shm = PATHS[path]
        with (
            tq.init(num_storage_units=2, storage_capacity=args.capacity) as cluster,
            tq.connect(cluster.address, use_shm=use_shm) as client,
        ):
            time.sleep(1.0)  # the units pre-fault their arenas in the background
            sequential(client, fill(client, args.samples, args.put_batch), args.micro, 0.0)  # warm-up
            for work_ms in args.work_ms:
                work = work_ms / 1e3
                runs: dict[str, list[tuple[float, list[float]]]] = {mode: [] for mode in MODES}
                for _ in range(args.reps):
                    runs["seq"].append(sequential(client, fill(client, args.samples, args.put_batch), args.micro, work))
                    runs["stream"].append(stream(client, fill(client, args.samples, args.put_batch), args.micro, work))
                    part = fill(client, args.samples, args.put_batch)
                    runs["astream"].append(stream_async(cluster.address, use_shm, part, args.micro, work))
                row: dict[str, Any] = {"path": path, "work_ms": work_ms, "runs": runs}
                for mode, results in runs.items():
                    row[f"{mode}_gbps"] = median(gbps(nbytes, t) for t, _ in results)
                    row[f"{mode}_x_seq"] = median(s[0] / r[0] for s, r in zip(runs["seq"], results))
                    row[f"{mode}_wait_ms"] = median(w * 1e3 for _, waits in results for w in waits)
                rows.append(row)
                print(
                    f"  {path} work {work_ms:g} ms: "
                    + ", ".join(
                        f"{mode} {row[f'{mode}_gbps']:.2f} GB/s (x{row[f'{mode}_x_seq']:.2f}, "
                        f"waits {row[f'{mode}_wait_ms']:.1f} ms)"
                        for mode in MODES
                    ),
                    flush=True,
                )
    return {"args": vars(args), "sample_bytes": SAMPLE_BYTES, "rows": rows}


def report(record: dict[str, Any]) -> None:
    args = record["args"]
    print_table(
        f"Consumer-paced reads, {args['samples']} samples x 81,920 B, micro-batch {args['micro']}, median of "
        f"{args['reps']}. x seq = sequential time / this mode's time, in the same repetition; wait = median "
        "time the caller waits for a batch (sequential: get_meta + get_data; streams: taking the next)",
        ["path", "work ms"] + [f"{mode} {what}" for mode in MODES for what in ("GB/s", "x seq", "wait ms")],
        [
            [r["path"], r["work_ms"]] + [r[f"{mode}_{key}"] for mode in MODES for key in ("gbps", "x_seq", "wait_ms")]
            for r in record["rows"]
        ],
    )


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=4096, help="samples per run (default 4096)")
    p.add_argument("--put-batch", type=int, default=256)
    p.add_argument("--micro", type=int, default=256, help="micro-batch size (default 256)")
    p.add_argument("--work-ms", nargs="+", type=float, default=[0.0, 20.0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    p.add_argument("--capacity", default="2GiB")
    record = run(p.parse_args(argv))
    report(record)
    print(f"wrote {write_record('stream_prefetch', record)}")


if __name__ == "__main__":
    main()
