"""`python -m recipes.dataflow_demo` (`make demo`): a GRPO-shaped data flow through an embedded cluster.

Two producer processes stand in for rollout workers: each connects its own client and puts
synthetic rollouts in whole groups of 8 (one prompt, eight responses of random length). Two
consumer tasks run at the same time in this process: `compute_ref` streams `input_ids` and
writes a new column, `ref_log_prob`, for the same rows; `actor_update` streams whole groups
once their `ref_log_prob` is there. The last producer to finish seals the partition, so both
streams end by themselves. Only the public API is used. The summary gives throughput per stage
and checks that each task consumed every sample exactly once; the exit status is 1 if not.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from transfer_queue.host import stop_while_loading

stop_while_loading(__name__)  # before the heavy imports

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tqdm import tqdm  # noqa: E402

import transfer_queue as tq  # noqa: E402

PARTITION = "train"
GROUP = 8
"""GRPO group size: responses per prompt. Producers put whole groups; `actor_update` takes them."""
SEQ = 1024
VOCAB = 32_000
PRODUCERS = 2
START_TIMEOUT = 120.0
"""Seconds to wait for the producer processes to start (they import torch)."""
BATCH_TIMEOUT = 120.0
"""Seconds a consumer waits for its next batch before it gives up (a stuck pipeline fails)."""


def quiet_torch() -> None:
    """One thread per process (2 cores here), and no once-per-process notice from torch.fx that
    tensordict triggers when it wraps a nested tensor: it is noise in the demo's output."""
    torch.set_num_threads(1)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


class DemoError(Exception):
    """The demo could not run to the end; the message says which part failed."""


@dataclass
class Stage:
    """What one producer or consumer task moved, with wall-clock times of its batches."""

    name: str
    samples: int = 0
    batches: int = 0
    nbytes: int = 0
    first: float = 0.0
    last: float = 0.0
    indexes: list[int] = field(default_factory=list)
    whole_groups: bool = True
    tokens: int = 0
    """Response tokens seen (`actor_update` only)."""

    def record(self, n: int, nbytes: int, indexes: Sequence[int] = ()) -> None:
        self.last = time.time()
        self.first = self.first or self.last
        self.samples += n
        self.batches += 1
        self.nbytes += nbytes
        self.indexes.extend(indexes)


def rollouts(n: int, gen: torch.Generator) -> TensorDict:
    """`n` synthetic samples: `n // GROUP` prompts, each with GROUP responses of 64-1024 tokens."""
    prompts = torch.randint(VOCAB, (n // GROUP, SEQ), generator=gen).repeat_interleave(GROUP, 0)
    lengths = torch.randint(64, SEQ + 1, (n,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    values = torch.randint(VOCAB, (int(offsets[-1]),), generator=gen)
    return TensorDict(
        {
            "input_ids": prompts,
            "responses": torch.nested.nested_tensor_from_jagged(values, offsets),
            "log_probs": -5 * torch.rand(n, SEQ, generator=gen),
        },
        batch_size=[n],
    )


def nbytes(td: TensorDict) -> int:
    """Tensor bytes in a batch (a jagged field counts its values)."""
    return sum((t.values() if t.is_nested else t).nbytes for t in td.values())


# -- producers (separate processes) --------------------------------------------------------


def produce(
    address: str, producer: int, first_sample: int, n: int, batch_size: int, ready: Any, finished: Any, results: Any
) -> None:
    """A rollout worker: put `n` samples under generation grants, then seal if it is the last."""
    tq.exit_on_signals()  # stopped by the driver (SIGTERM) or Ctrl-C, it gives back its grant and client
    quiet_torch()
    gen = torch.Generator().manual_seed(producer)
    stage = Stage(f"producer {producer}")
    with tq.connect(address) as client:
        ready.wait(START_TIMEOUT)
        for start in range(0, n, batch_size):
            batch = rollouts(min(batch_size, n - start), gen)
            sample_ids = torch.arange(len(batch)) + first_sample + start
            with client.acquire(len(batch)) as grant:
                client.put(
                    batch,
                    partition=PARTITION,
                    policy_version=grant.version,
                    grant=grant,
                    groups=(sample_ids // GROUP).tolist(),
                )
            stage.record(len(batch), nbytes(batch))
        with finished.get_lock():
            finished.value += 1
            last = finished.value == PRODUCERS
        if last:  # both producers are done: streams may end once drained
            client.seal(PARTITION)
    results.put(stage)


# -- consumer tasks (threads of this process, one client each) -----------------------------


def compute_ref(address: str, batch_size: int, bar: tqdm) -> Stage:
    """Stream `input_ids`, write `ref_log_prob` for the same rows (a stand-in reference model)."""
    stage = Stage("compute_ref")
    with tq.connect(address) as client:
        for batch, meta in client.stream(["input_ids"], batch_size, "compute_ref", PARTITION, timeout=BATCH_TIMEOUT):
            ref = -torch.log1p((batch["input_ids"] % 97).float())
            client.put(TensorDict({"ref_log_prob": ref}, batch_size=[len(meta)]), meta=meta)
            stage.record(len(meta), nbytes(batch) + ref.nbytes, meta.indexes)
            bar.update(len(meta))
    return stage


def actor_update(address: str, batch_size: int, bar: tqdm) -> Stage:
    """Stream whole GRPO groups once they have `ref_log_prob`; count their response tokens."""
    stage = Stage("actor_update")
    fields = ["input_ids", "responses", "ref_log_prob"]
    with tq.connect(address) as client:
        for batch, meta in client.stream(
            fields, batch_size, "actor_update", PARTITION, timeout=BATCH_TIMEOUT, sampler="grpo_group", group_size=GROUP
        ):
            stage.tokens += int(batch["responses"].offsets()[-1])
            stage.whole_groups &= set(Counter(meta.groups).values()) == {GROUP}
            stage.record(len(meta), nbytes(batch), meta.indexes)
            bar.update(len(meta))
    return stage


def in_thread(fn: Callable[..., Stage], *args: Any) -> Future:
    """Run `fn` in a daemon thread, so a task stuck on a failed pipeline cannot keep us alive."""
    future: Future = Future()

    def body() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=body, name=fn.__name__, daemon=True).start()
    return future


def wait_all(consumers: list[Future], producers: list[BaseProcess]) -> list[Stage]:
    """The consumers' stages once both streams ended; fails fast if any task or producer fails."""
    while True:
        done, _ = wait(consumers, timeout=0.5, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()
        if len(done) == len(consumers):
            return [f.result() for f in consumers]
        dead = [p for p in producers if p.exitcode not in (None, 0)]
        if dead:
            raise DemoError(f"{dead[0].name} exited with code {dead[0].exitcode}")


# -- driver --------------------------------------------------------------------------------


def run(samples: int, batch_size: int, units: int) -> int:
    """Start the cluster, run producers and consumers to the end, print the summary."""
    quiet_torch()
    ctx = mp.get_context("spawn")
    started = time.time()
    with tq.init(num_storage_units=units, storage_capacity=max(128 << 20, samples * (64 << 10))) as cluster:
        cluster_up = time.time()
        ready, finished, results = ctx.Barrier(PRODUCERS + 1), ctx.Value("i", 0), ctx.Queue()
        groups = samples // GROUP
        shares = [(groups * i // PRODUCERS * GROUP, groups * (i + 1) // PRODUCERS * GROUP) for i in range(PRODUCERS)]
        procs = [
            ctx.Process(
                target=produce,
                name=f"producer-{i}",
                args=(cluster.address, i, lo, hi - lo, batch_size, ready, finished, results),
            )
            for i, (lo, hi) in enumerate(shares)
        ]
        for proc in procs:
            proc.start()
        try:
            try:
                ready.wait(START_TIMEOUT)
            except threading.BrokenBarrierError:
                raise DemoError(f"the producer processes did not connect within {START_TIMEOUT:g} s") from None
            t0 = time.time()
            with (
                tqdm(total=samples, desc="compute_ref ", unit="sample", position=0, mininterval=0.5) as ref_bar,
                tqdm(total=samples, desc="actor_update", unit="sample", position=1, mininterval=0.5) as actor_bar,
            ):
                consumers = wait_all(
                    [
                        in_thread(compute_ref, cluster.address, batch_size, ref_bar),
                        in_thread(actor_update, cluster.address, batch_size, actor_bar),
                    ],
                    procs,
                )
            producers = [results.get(timeout=30) for _ in procs]
            for proc in procs:
                proc.join()
            with tq.connect(cluster.address) as client:
                tasks = client.status()["partitions"][PARTITION]["tasks"]
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                    proc.join()
    print(summary(samples, batch_size, units, producers, consumers, t0, cluster_up - started, t0 - cluster_up))
    ok, verdict = check(samples, consumers, tasks)
    print(verdict)
    return 0 if ok else 1


def summary(
    samples: int,
    batch_size: int,
    units: int,
    producers: list[Stage],
    consumers: list[Stage],
    t0: float,
    cluster_s: float,
    procs_s: float,
) -> str:
    """The throughput table: per stage samples, batches, MB, time to first batch, rates."""
    produced = Stage(
        f"produce (x{len(producers)})",
        sum(p.samples for p in producers),
        sum(p.batches for p in producers),
        sum(p.nbytes for p in producers),
        min(p.first for p in producers),
        max(p.last for p in producers),
    )
    stages = [produced, *consumers]
    end = max(s.last for s in stages)
    total = Stage(
        "all stages",
        samples,
        sum(s.batches for s in stages),
        sum(s.nbytes for s in stages),
        min(s.first for s in stages),
        end,
    )
    head = f"{'stage':<14}{'samples':>8}{'batches':>9}{'MB':>9}{'1st batch':>11}{'done':>9}{'samples/s':>11}{'MB/s':>9}"
    lines = [
        "",
        f"Sluice demo: {samples} samples in groups of {GROUP}, batch {batch_size}, {units} storage unit(s)",
        f"start-up (not timed below): cluster {cluster_s:.1f} s, producer processes {procs_s:.1f} s",
        "",
        head,
        "-" * len(head),
    ]
    for s in [*stages, total]:
        span = max(s.last - t0, 1e-9)
        lines.append(
            f"{s.name:<14}{s.samples:>8}{s.batches:>9}{s.nbytes / 1e6:>9.1f}{s.first - t0:>9.2f} s"
            f"{s.last - t0:>7.2f} s{s.samples / span:>11.0f}{s.nbytes / 1e6 / span:>9.1f}"
        )
    lines.append("(times from the moment both producers were connected; rates over that time)")
    actor = consumers[-1]
    lines.append(
        f"{actor.name} trained on {actor.tokens} response tokens, {actor.tokens / max(actor.last - t0, 1e-9):.0f} tokens/s"
    )
    return "\n".join(lines)


def check(samples: int, consumers: list[Stage], tasks: dict) -> tuple[bool, str]:
    """Did each task consume every sample exactly once, and `actor_update` only whole groups?"""
    problems = []
    for stage in consumers:
        seen = Counter(stage.indexes)
        consumed = tasks.get(stage.name, {}).get("consumed", 0)
        if len(seen) != samples or max(seen.values(), default=0) != 1 or consumed != samples:
            problems.append(
                f"{stage.name} got {len(seen)} distinct of {samples} samples "
                f"({stage.samples} deliveries), controller counts {consumed} consumed"
            )
        if not stage.whole_groups:
            problems.append(f"{stage.name} got a batch with a split group")
    if problems:
        return False, "check FAILED: " + "; ".join(problems)
    names = " and ".join(s.name for s in consumers)
    return (
        True,
        f"check ok: {names} each consumed all {samples} samples exactly once; actor_update took whole groups of {GROUP}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    tq.exit_on_signals()
    parser = argparse.ArgumentParser(prog="python -m recipes.dataflow_demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096, help="samples to produce (multiple of 8; default 4096)")
    parser.add_argument(
        "--batch-size", type=int, default=64, help="samples per put and per consumer batch (multiple of 8)"
    )
    parser.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    args = parser.parse_args(argv)
    if args.samples <= 0 or args.samples % GROUP or args.batch_size <= 0 or args.batch_size % GROUP:
        parser.error(f"--samples and --batch-size must be positive multiples of the group size {GROUP}")
    try:
        return run(args.samples, args.batch_size, args.units)
    except (tq.SluiceError, DemoError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
