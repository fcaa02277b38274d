"""Crowd: a thousand concurrent clients on one controller, and nothing lost, duplicated or hung.

One cluster (a controller, 2 storage units), reached over TCP only. `--procs` worker processes
each run asyncio clients, one `AsyncClient` apiece: producers (rollout workers) that `acquire` 4
slots and put 4 samples, each carrying a unique id, in a loop; consumers that `get_meta` 16
samples, read them, `ack` and `clear` them. After `--seconds` the producers stop, the partition
is sealed and the consumers drain it. Then every id put must have been read exactly once:

- lost: ids put and never read; duplicated: ids read more than once;
- hung: clients still running 60 s after the seal (or that failed: `errors`).

With `--kill-producers K` the crowd runs twice, in fresh clusters: as above, then with K more
producer processes that, halfway through the run, each begin one big put (a unit's whole
frame window but for 64 of the crowd's puts), send it part way (even ones: only the `BeginPut`; odd ones: the first half of
their writes, no commit) and are SIGKILLed there (those whose put is not planned within 5 s,
while waiting for it). Reported: the other producers'
put p50/p99 in both runs and their ratio (goal: p99 within 2x), also over the 5 s after the kill,
and their errors (goal: 0).

Reported: the controller's requests/s and CPU share (near 100% of a core: saturated), its own
request handling p50/p99 (measured inside it, `status()["handling_us"]`), p50/p99 of `acquire`,
`put` and `get_meta` as the clients see them, the controller's anonymous memory per connected
client and its fds. Results go to results/crowd-*.json; the last line is the summary as JSON.

    .venv/bin/python benchmarks/crowd.py [--producers 800 --consumers 200 --procs 4 --seconds 60]
                                         [--ray-nodes 4]   # services as Ray actors on a local 4-node Ray cluster
                                         [--kill-producers 4]  # with and without producers killed mid-put
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import time
from collections import Counter
from typing import Any

import torch

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, percentile, print_table, write_record
from controllers.intake import WINDOW_SHARE
from transfer_queue.wire.messages import BeginPut, CommitPut, Write

PUT = 4
TAKE = 16
DRAIN_S = 60.0
ROW_FLOATS = 248
ROW_BYTES = 8 + 4 * ROW_FLOATS
CAPACITY = 2 << 30
"""The units' capacity, in all."""
UNITS = 2
AFTER_KILL_S = 5.0
MID_S = 5.0
VICTIM_SPARE = 64
"""How long the victims have to get their puts planned before all are killed."""


def _proc(pid: int) -> dict[str, float]:
    """Anonymous memory (MiB), fds and CPU seconds of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024
    with open(f"/proc/{pid}/stat") as f:
        ticks = f.read().rsplit(")", 1)[1].split()
    cpu = (int(ticks[11]) + int(ticks[12])) / os.sysconf("SC_CLK_TCK")
    return {"anon": anon, "fds": float(len(os.listdir(f"/proc/{pid}/fd"))), "cpu": cpu}


async def _worker(
    address: str, wid: int, producers: int, consumers: int, ready: Any, go: Any, stop: Any, seconds: float
) -> dict:
    clients = [await tq.connect_async(address, use_shm=False) for _ in range(producers + consumers)]
    ready.put(wid)
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    lat: dict[str, list[float]] = {"acquire": [], "put": [], "get_meta": []}
    put_started: list[float] = []  # wall clock, to pick the puts made just after a kill
    seen: list[int] = []
    put_ids: list[int] = []
    errors: list[str] = []

    async def produce(client: tq.AsyncClient, pno: int) -> None:
        seq = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            grant = await client.acquire(PUT, timeout=60)
            t1 = time.perf_counter()
            started = time.time()
            if stop.is_set():  # the partition is about to be sealed
                await client.release(grant)
                return
            base = ((wid * producers + pno) << 32) + seq
            ids = torch.arange(base, base + PUT, dtype=torch.int64)
            await client.put(
                {"id": ids, "x": torch.zeros(PUT, ROW_FLOATS, dtype=torch.float32)}, grant=grant, timeout=60
            )
            t2 = time.perf_counter()
            lat["acquire"].append(t1 - t0)
            lat["put"].append(t2 - t1)
            put_started.append(started)
            put_ids.extend(ids.tolist())
            seq += PUT

    async def consume(client: tq.AsyncClient) -> None:
        while True:
            t0 = time.perf_counter()
            meta = await client.get_meta(["id", "x"], TAKE, task="train", timeout=60)
            lat["get_meta"].append(time.perf_counter() - t0)
            if not len(meta):
                return  # sealed and drained
            data = await client.get_data(meta, ["id"])
            seen.extend(data["id"].tolist())
            await client.ack(meta)
            await client.clear(meta)

    async def guarded(coro: Any) -> None:
        try:
            await coro
        except Exception as exc:  # noqa: BLE001 - counted and reported, the crowd goes on
            errors.append(f"{type(exc).__name__}: {exc}")

    tasks = [asyncio.ensure_future(guarded(produce(c, i))) for i, c in enumerate(clients[:producers])]
    tasks += [asyncio.ensure_future(guarded(consume(c))) for c in clients[producers:]]
    _, pending = await asyncio.wait(tasks, timeout=seconds + DRAIN_S)
    for task in pending:  # hung: still running long after the seal
        task.cancel()
    for client in clients:
        await client.close()
    return {
        "lat": lat,
        "put_started": put_started,
        "seen": seen,
        "put": put_ids,
        "errors": errors,
        "hung": len(pending),
    }


def _run_worker(
    address: str, wid: int, producers: int, consumers: int, ready: Any, go: Any, stop: Any, seconds: float, out: Any
) -> None:
    out.put(asyncio.run(_worker(address, wid, producers, consumers, ready, go, stop, seconds)))


def _victim(address: str, no: int, nbytes: int, arm: Any, mid: Any) -> None:
    """A producer that, once `arm` is set, drives one put of `nbytes` part way (the `BeginPut`;
    for odd `no` also the first half of its writes, not the commit), says so on `mid` and
    waits to be SIGKILLed."""
    client = tq.connect(address, use_shm=False)
    arm.wait()
    rows = nbytes // ROW_BYTES  # the crowd's own rows: a put must keep the fields' shapes
    data = {"id": torch.full((rows,), -1, dtype=torch.int64), "x": torch.zeros(rows, ROW_FLOATS, dtype=torch.float32)}
    flow = client._core.put(data, timeout=60)
    begin = next(flow)
    assert len(begin) == 1 and isinstance(begin[0].msg, BeginPut), begin
    channel = client._channel(begin[0].target)
    calls = flow.send([channel.reply(channel.send(begin[0].msg, begin[0].data), 90)])
    if no % 2:
        writes = [c for c in calls if isinstance(c.msg, Write)]
        assert not any(isinstance(c.msg, CommitPut) for c in calls[: (len(writes) + 1) // 2]), calls
        for c in writes[: (len(writes) + 1) // 2]:
            channel = client._channel(c.target)
            if c.notice:
                channel.post(c.msg, c.data)
            else:
                channel.send(c.msg, c.data)
    mid.put(no)
    time.sleep(3600)  # until the benchmark kills this process


def crowd(
    producers: int, consumers: int, procs: int, seconds: float, backend: str = "local", kills: int = 0
) -> dict[str, Any]:
    """Run the crowd, with `kills` producers SIGKILLed mid-put halfway through; returns its
    figures (see the module doc)."""
    cluster = tq.init(num_storage_units=UNITS, storage_capacity=CAPACITY, consumer_batch_size=TAKE, backend=backend)
    ctx = mp.get_context("spawn")
    ready, out, mid = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go, stop, arm = ctx.Event(), ctx.Event(), ctx.Event()
    # each victim's put fills a unit's frame window (`storage_capacity` is the total) but for
    # VICTIM_SPARE of the crowd's puts: the others wait for its release, as they would after a kill
    victim_bytes = CAPACITY // UNITS // WINDOW_SHARE - VICTIM_SPARE * PUT * ROW_BYTES
    victims = [
        ctx.Process(target=_victim, args=(cluster.address, v, victim_bytes, arm, mid), daemon=True)
        for v in range(kills)
    ]
    for v in victims:
        v.start()
    try:
        ctl_pid = cluster.services[0]["pid"]
        watcher = cluster.connect(use_shm=False)
        idle = _proc(ctl_pid)
        workers = [
            ctx.Process(
                target=_run_worker,
                args=(cluster.address, w, producers // procs, consumers // procs, ready, go, stop, seconds, out),
                daemon=True,
            )
            for w in range(procs)
        ]
        for w in workers:
            w.start()
        connected_workers = 0
        while connected_workers < len(workers):
            try:
                ready.get(timeout=1.0)
                connected_workers += 1
            except queue.Empty:
                if not all(w.is_alive() for w in workers):
                    raise RuntimeError("a worker died before its clients connected (its stderr says why)") from None
        connected = _proc(ctl_pid)
        served0 = watcher.status()["counters"]["requests_served"]
        t0 = time.perf_counter()
        go.set()
        killed_at = time.time() + seconds / 2
        time.sleep(seconds / 2)  # the benchmark's run time: the crowd works meanwhile
        held = reached = 0
        if victims:
            arm.set()
            reached = 0  # victims whose put got its plan; the others are killed waiting for one
            deadline = time.monotonic() + MID_S
            while reached < len(victims) and time.monotonic() < deadline:
                try:
                    mid.get(timeout=max(0.01, deadline - time.monotonic()))
                    reached += 1
                except queue.Empty:
                    break
            held = sum(u["frames_in_flight"] for u in watcher.status()["units"].values())
            killed_at = time.time()
            for v in victims:
                os.kill(v.pid, signal.SIGKILL)
        time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
        loaded = _proc(ctl_pid)
        status = watcher.status()
        elapsed = time.perf_counter() - t0
        served = status["counters"]["requests_served"] - served0
        handling = status["handling_us"]
        stop.set()
        # producers finish their last put, then the seal lets consumers drain and return
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            counters = watcher.status()["counters"]
            if not counters["open_puts"] and not counters["puts_waiting_for_room"]:
                break
            time.sleep(0.2)
        time.sleep(1.0)  # a producer between its acquire and its BeginPut
        watcher.seal("train")
        results = []
        for _ in workers:
            try:
                results.append(out.get(timeout=DRAIN_S + 120))
            except queue.Empty:  # a worker that never answered: its clients hung
                break
        hung_workers = len(workers) - len(results)
        for w in workers:
            w.join(5)
            if w.is_alive():
                w.kill()
        put_ids = [i for r in results for i in r["put"]]
        seen = Counter(i for r in results for i in r["seen"])
        lat = {k: [x for r in results for x in r["lat"][k]] for k in ("acquire", "put", "get_meta")}
        errors = [e for r in results for e in r["errors"]]
        after_kill = [
            d
            for r in results
            for d, t in zip(r["lat"]["put"], r["put_started"], strict=True)
            if killed_at <= t < killed_at + AFTER_KILL_S
        ]
        clients = producers // procs * procs + consumers // procs * procs
        summary = {
            "clients": clients,
            "producers": producers // procs * procs,
            "consumers": consumers // procs * procs,
            "procs": procs,
            "seconds": round(elapsed, 1),
            "samples_put": len(put_ids),
            "lost": len(set(put_ids) - set(seen)),
            "duplicated": sum(c - 1 for c in seen.values() if c > 1),
            "hung": hung_workers * (clients // procs) + sum(r["hung"] for r in results),
            "errors": len(errors),
            "error_kinds": dict(Counter(e.split(":")[0] for e in errors)),
            "controller_requests_per_s": served / elapsed,
            "controller_cpu_share": (loaded["cpu"] - connected["cpu"]) / elapsed,
            "controller_handling_us": handling,
            "p50_ms": {k: percentile(v, 50) * 1e3 for k, v in lat.items()},
            "p99_ms": {k: percentile(v, 99) * 1e3 for k, v in lat.items()},
            "killed": kills,
            "window_bytes_held_at_the_kill": held,
            "killed_with_a_plan": reached,
            "put_after_kill_ms": {"p50": percentile(after_kill, 50) * 1e3, "p99": percentile(after_kill, 99) * 1e3},
            "controller_anon_idle_mib": idle["anon"],
            "controller_kib_per_client": (connected["anon"] - idle["anon"]) * 1024 / clients,
            "controller_fds": {"idle": idle["fds"], "connected": connected["fds"], "loaded": loaded["fds"]},
            "at_the_end_of_the_run": {
                "puts_waiting_for_room": status["counters"]["puts_waiting_for_room"],
                "open_puts": status["counters"]["open_puts"],
                "parked_get_meta": status["counters"]["parked_get_meta"],
                "unit_bytes": {k: u["bytes"] for k, u in status["units"].items()},
            },
        }
        after = _proc(ctl_pid)["anon"]
        for _ in range(10):  # the controller takes in the clients' disconnections
            time.sleep(0.5)
            after, before = _proc(ctl_pid)["anon"], after
            if after >= before:
                break
        summary["controller_anon_after_mib"] = after
        watcher.close()
        return summary
    finally:
        stop.set()
        go.set()
        for v in victims:
            v.kill()
        cluster.shutdown()


def _report(s: dict[str, Any]) -> None:
    rows = [[op, s["p50_ms"][op], s["p99_ms"][op]] for op in ("acquire", "put", "get_meta")]
    print_table(
        f"crowd: {s['clients']} clients ({s['producers']} producers, {s['consumers']} consumers) in {s['procs']} "
        f"processes, {s['seconds']} s, {s['killed']} producers killed mid-put",
        ["op (client side)", "p50 ms", "p99 ms"],
        rows,
    )
    h = s["controller_handling_us"]
    print(
        f"controller: {s['controller_requests_per_s']:,.0f} requests/s at {s['controller_cpu_share']:.0%} of a core; "
        f"own handling p50 {h.get('p50', float('nan'))} us, p99 {h.get('p99', float('nan'))} us (goal p99 <= 5000); "
        f"{s['controller_kib_per_client']:.1f} KiB per connected client; fds {s['controller_fds']}"
    )
    print(
        f"samples put {s['samples_put']:,}: lost {s['lost']}, duplicated {s['duplicated']}, hung {s['hung']}, "
        f"errors {s['errors']} {s['error_kinds']}"
    )


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producers", type=int, default=800)
    parser.add_argument("--consumers", type=int, default=200)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--ray-nodes",
        type=int,
        default=0,
        help="run the services with the Ray backend on a local Ray cluster of N nodes",
    )
    parser.add_argument(
        "--kill-producers",
        type=int,
        default=0,
        help="run the crowd without, then with K more producers SIGKILLed mid-put halfway through",
    )
    args = parser.parse_args()
    if args.ray_nodes:
        import ray
        from ray.cluster_utils import Cluster

        nodes = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 << 20},
        )
        for _ in range(args.ray_nodes - 1):
            nodes.add_node(num_cpus=1, object_store_memory=100 << 20)
        ray.init(address=nodes.address)
    backend = "ray" if args.ray_nodes else "local"
    try:
        runs = [
            crowd(args.producers, args.consumers, args.procs, args.seconds, backend, kills)
            for kills in sorted({0, args.kill_producers})
        ]
    finally:
        if args.ray_nodes:
            ray.shutdown()
            nodes.shutdown()
    for s in runs:
        s["ray_nodes"] = args.ray_nodes
        _report(s)
    s = runs[-1]
    if args.kill_producers:
        calm, hit = runs
        s = {**hit, "without_kills": calm}
        s["put_p99_ratio"] = hit["p99_ms"]["put"] / calm["p99_ms"]["put"]
        s["put_p99_after_kill_ratio"] = hit["put_after_kill_ms"]["p99"] / calm["put_after_kill_ms"]["p99"]
        print(
            f"{args.kill_producers} producers killed mid-put: the others' put p50 {calm['p50_ms']['put']:.0f} -> "
            f"{hit['p50_ms']['put']:.0f} ms, p99 {calm['p99_ms']['put']:.0f} -> {hit['p99_ms']['put']:.0f} ms "
            f"(x{s['put_p99_ratio']:.2f}, goal <= 2); in the {AFTER_KILL_S:.0f} s after the kill p99 "
            f"{calm['put_after_kill_ms']['p99']:.0f} -> {hit['put_after_kill_ms']['p99']:.0f} ms "
            f"(x{s['put_p99_after_kill_ratio']:.2f}); errors {hit['errors']} (goal 0); the killed puts held "
            f"{hit['window_bytes_held_at_the_kill'] / 2**20:.0f} MiB of the units' {CAPACITY // WINDOW_SHARE / 2**20:.0f} MiB "
            "frame windows; "
            f"{hit['killed_with_a_plan']} of {args.kill_producers} had their put planned"
        )
    write_record("crowd", {**s, "args": vars(args)})
    print(json.dumps(s))


if __name__ == "__main__":
    main()
