"""Benchmark of a put under a grant while many `get_meta` requests are parked.

A put under a grant raises admission's `accepted`, which may hold back a request parked on any
partition, so every such commit has each parked request check its consumer's demand. This
measures what that costs. P partitions each hold R granted samples and K parked requests that
can never be served (each asks for more than R); the put goes into another partition, "hot":

- end to end (a real cluster): the median latency of `acquire(1)` + `put(1 row)` into "hot",
  with no request parked (the baseline) and then with P x K parked, in the same run; the ratio
  of the two is what the parked requests cost a producer. The budget is so large that it holds
  back none of them: each only checks that.
- end to end, held back (another cluster): `put(1 row)` into "hot" under a grant acquired
  beforehand, with P x K requests parked that the budget does not hold back, then with the
  budget spent (by samples too stale to count for anyone) so that it holds back every one, in
  the same run: each commit then has every parked request report its demand, the samples the
  other partitions hold for their consumers included (computed once per commit), with no growth
  (the demand fits the budget). The ratio is what a held-back crowd costs a producer over one
  that is not.
- in process (the controller's scheduler called directly, no sockets), per commit over the same
  parked requests: `granted_commit` (each request parked elsewhere checks its demand with the
  samples ready at its last evaluation), the same with the budget spent (admission's `accepted`
  set to its limit: every request is held back and reports), `wake_all` (each is evaluated in
  full: masks, sampler), and `wake` of "hot" alone (no request parked elsewhere checks anything,
  as before the budget counted demand per version); ratios against the first and the last.

    .venv/bin/python benchmarks/admission_wake.py              # P x K = 10 x 20 and 10 x 100
    .venv/bin/python benchmarks/admission_wake.py --quick      # 10 x 20, fewer puts (< 30 s)
    .venv/bin/python benchmarks/admission_wake.py --shapes 1x1000 --puts 500
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict

import transfer_queue as tq
from benchmarks._common import exit_on_sigterm, median, percentile, print_table, timed, write_record

FIELD = "x"


def rows(n: int) -> TensorDict:
    return TensorDict({FIELD: torch.arange(n)}, batch_size=[n])


def granted_put(client: tq.Client, partition: str, n: int) -> None:
    with client.acquire(n, timeout=30) as grant:
        client.put(rows(n), partition=partition, grant=grant)


def put_latencies(client: tq.Client, puts: int) -> list[float]:
    """Seconds of each `acquire(1)` + `put(1 row)` into "hot"."""
    return [timed(lambda: granted_put(client, "hot", 1))[0] for _ in range(puts)]


def puts_under(client: tq.Client, grants: list[tq.Grant]) -> list[float]:
    """Seconds of each `put(1 row)` into "hot" under one of `grants`, acquired beforehand."""

    def put(grant: tq.Grant) -> None:
        client.put(rows(1), partition="hot", grant=grant)

    return [timed(functools.partial(put, grant))[0] for grant in grants]


class Parked:
    """P x K `get_meta` requests parked from an `AsyncClient` in a thread of its own, until
    `close`; each asks for `ask` samples, more than its partition holds, so none is ever served."""

    def __init__(self, address: str, partitions: int, per_partition: int, ask: int):
        self.args = (address, partitions, per_partition, ask)
        self.sent = threading.Event()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        address, partitions, per_partition, ask = self.args

        async def main() -> None:
            client = await tq.connect_async(address)
            calls = [
                asyncio.ensure_future(client.get_meta([FIELD], ask, task=f"t{k}", partition=f"p{p}", timeout=3600))
                for p in range(partitions)
                for k in range(per_partition)
            ]
            self.sent.set()
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await client.close()

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - raised by `close` in the main thread
            self.errors.append(exc)
            self.sent.set()

    def wait_parked(self, client: tq.Client, n: int) -> None:
        """Until the controller holds `n` parked requests (a status poll: this is no test)."""
        self.sent.wait(60)
        deadline = time.monotonic() + 120
        while client.status()["counters"]["parked_get_meta"] < n:
            assert time.monotonic() < deadline and not self.errors, self.errors
            time.sleep(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and not self.errors, self.errors


def end_to_end(partitions: int, per_partition: int, held: int, puts: int) -> dict[str, Any]:
    """Median put latency with no request parked, then with P x K parked, on one cluster."""
    # a budget so large that it never holds a request back: each parked request only checks
    cluster = tq.init(num_storage_units=1, storage_capacity="256MiB", max_staleness=10, consumer_batch_size=10**7)
    with cluster, cluster.connect() as client:
        for p in range(partitions):
            granted_put(client, f"p{p}", held)
        granted_put(client, "hot", 1)  # warm-up: the partition exists
        baseline = put_latencies(client, puts)
        parked = Parked(cluster.address, partitions, per_partition, held + 1)
        try:
            parked.wait_parked(client, partitions * per_partition)
            loaded = put_latencies(client, puts)
        finally:
            parked.close()
    return {
        "baseline_ms": median(baseline) * 1e3,
        "parked_ms": median(loaded) * 1e3,
        "parked_p90_ms": percentile(loaded, 90) * 1e3,
        "ratio": median(loaded) / median(baseline),
    }


def held_back_end_to_end(partitions: int, per_partition: int, held: int, puts: int) -> dict[str, Any]:
    """Median put latency with P x K parked requests the budget does not hold back, then with
    the budget spent so that it holds back every one, on one cluster (see the module's doc)."""
    ask = held + puts + 1  # more than the ready samples and the grants running: held back once spent
    # the most a parked request reports: its batch, the other partitions' (each waits for `ask`),
    # and the samples "hot" holds with no consumer; a budget of that per version never grows
    per_version = partitions * ask + 2 * puts + 1
    staleness = tq.StalenessConfig(per_version, 0)  # η = 0: (version + 1) * per_version admitted
    cluster = tq.init(num_storage_units=1, storage_capacity="256MiB", staleness=staleness)
    with cluster, cluster.connect() as client:
        client.set_version(1)  # samples put as version 0 are too stale to be served or to count
        for p in range(partitions):
            granted_put(client, f"p{p}", held)
        granted_put(client, "hot", 1)
        parked = Parked(cluster.address, partitions, per_partition, ask)
        try:
            parked.wait_parked(client, partitions * per_partition)
            free = puts_under(client, [client.acquire(1, timeout=30) for _ in range(puts)])
            grants = [client.acquire(1, timeout=30) for _ in range(puts)]
            while (left := client.status()["admission"]["budget"]) > 0:  # spend it on stale samples
                with client.acquire(min(left, per_version), timeout=30) as grant:
                    client.put(rows(grant.n), partition="stale", grant=grant, policy_version=0)
            held_back = puts_under(client, grants)
            adm = client.status()["admission"]
            assert adm["consumer_batch_size"] == per_version and adm["budget"] == 0, adm
        finally:
            parked.close()
    return {
        "not_held_ms": median(free) * 1e3,
        "held_ms": median(held_back) * 1e3,
        "held_p90_ms": percentile(held_back, 90) * 1e3,
        "held_ratio": median(held_back) / median(free),
    }


def in_process(partitions: int, per_partition: int, held: int, calls: int) -> dict[str, float]:
    """µs per call of each way a granted commit into "hot" can treat the parked requests."""
    from controllers.service import Controller
    from transfer_queue.wire.messages import (
        Acquire,
        BeginPut,
        ClusterConfig,
        CommitPut,
        GetMeta,
        PutPlan,
        RegisterUnit,
        RowInfo,
        UnitInfo,
    )
    from transfer_queue.wire.meta import FieldSpec

    async def main() -> dict[str, float]:
        config = ClusterConfig(
            num_storage_units=1, storage_capacity=1 << 30, max_staleness=10, consumer_batch_size=10**7
        )
        ctl = Controller(config, "tcp://127.0.0.1:*", secret="bench")
        ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30, "", ""), "bench"), [])
        pinger = ctl.links.pinger
        assert pinger is not None  # a registered unit starts it
        pinger.cancel()  # no unit process answers liveness pings in this in-process run
        specs = {FIELD: FieldSpec("int64", ())}
        for name, n in [(f"p{p}", held) for p in range(partitions)] + [("hot", 1)]:
            grant = await ctl.on_acquire(Acquire(n), [])
            plan = ctl.puts.on_begin_put(BeginPut(name, specs, n, 8), [])
            assert isinstance(plan, PutPlan)  # room at once: no wait
            ctl.puts.landed(plan.indexes[0], 0)  # what unit 0 would report of the put's write
            info = RowInfo([0] * n, [0] * n, list(range(n)), [0] * n, grant.grant_id)
            ctl.puts.on_commit_put(CommitPut(name, plan.indexes, specs, info), [])
        waiting = [
            asyncio.ensure_future(ctl.on_get_meta(GetMeta(f"p{p}", f"t{k}", [FIELD], held + 1, timeout=3600), []))
            for p in range(partitions)
            for k in range(per_partition)
        ]
        await asyncio.sleep(0)  # each request runs to its park
        scheduler = ctl.scheduler
        assert scheduler.status().parked == partitions * per_partition

        def per_call(fn: Callable[[], None]) -> float:
            return median(timed(fn)[0] for _ in range(calls)) * 1e6

        out = {
            "granted_commit_us": per_call(lambda: scheduler.granted_commit("hot")),
            "wake_all_us": per_call(scheduler.wake_all),
            "wake_hot_us": per_call(lambda: scheduler.wake("hot")),
        }
        admission = ctl.admission
        admission.accepted = admission.limit()  # the budget spent: every parked request is held back
        assert admission.holds_back(held, held + 1)
        out["granted_commit_held_us"] = per_call(lambda: scheduler.granted_commit("hot"))
        assert admission.batch_size == config.consumer_batch_size and scheduler.status().parked == len(waiting)
        for call in waiting:
            call.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        ctl.sock.close(linger=0)
        return out

    return asyncio.run(main())


def shape(text: str) -> tuple[int, int]:
    p, k = text.lower().split("x")
    return int(p), int(k)


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one shape, fewer puts (< 30 s)")
    p.add_argument("--shapes", nargs="+", type=shape, help="partitions x parked requests each (default 10x20 10x100)")
    p.add_argument("--held", type=int, default=8, help="granted samples in each partition with parked requests")
    p.add_argument("--puts", type=int, help="timed puts per case (default 300; quick 100)")
    p.add_argument("--calls", type=int, default=200, help="timed scheduler calls per way, in process")
    args = p.parse_args(argv)
    args.shapes = args.shapes or ([(10, 20)] if args.quick else [(10, 20), (10, 100)])
    args.puts = args.puts or (100 if args.quick else 300)
    torch.set_num_threads(1)
    t_start = time.time()
    record: dict[str, Any] = {"args": vars(args), "shapes": []}
    e2e_rows, held_rows, inproc_rows = [], [], []
    for partitions, per_partition in args.shapes:
        e2e = end_to_end(partitions, per_partition, args.held, args.puts)
        held = held_back_end_to_end(partitions, per_partition, args.held, args.puts)
        inproc = in_process(partitions, per_partition, args.held, args.calls)
        record["shapes"].append({"partitions": partitions, "per_partition": per_partition, **e2e, **held, **inproc})
        label = f"{partitions} x {per_partition} = {partitions * per_partition}"
        e2e_rows.append([label, e2e["baseline_ms"], e2e["parked_ms"], e2e["parked_p90_ms"], e2e["ratio"]])
        held_rows.append([label, held["not_held_ms"], held["held_ms"], held["held_p90_ms"], held["held_ratio"]])
        commit, commit_held = inproc["granted_commit_us"], inproc["granted_commit_held_us"]
        inproc_rows.append(
            [
                label,
                commit,
                commit_held,
                commit_held / commit,
                inproc["wake_all_us"],
                inproc["wake_hot_us"],
                inproc["wake_all_us"] / commit,
            ]
        )
    print_table(
        f"End to end: acquire(1) + put(1 row) under a grant into another partition, median of {args.puts} (ms)",
        ["parked requests", "none parked", "parked", "parked p90", "x none parked"],
        e2e_rows,
    )
    print_table(
        f"End to end: put(1 row) under a grant acquired beforehand into another partition, median of {args.puts} "
        "(ms): the budget holds back none of the parked requests, then every one",
        ["parked requests", "not held back", "held back", "held back p90", "held / not held"],
        held_rows,
    )
    print_table(
        f"In process: scheduler time per granted commit, median of {args.calls} calls (µs)",
        [
            "parked requests",
            "granted_commit",
            "all held back",
            "held / not held",
            "wake_all (full)",
            "wake hot only",
            "full / granted_commit",
        ],
        inproc_rows,
    )
    record["wall_s"] = time.time() - t_start
    path = write_record("admission_wake", record)
    print(f"wrote {path} ({record['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
