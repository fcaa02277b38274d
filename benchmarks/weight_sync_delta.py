"""Delta weight sync benchmark: versions from real Adam steps, only the changed bytes on the wire.

A Llama-shaped model (the shapes of `benchmarks/weight_sync.py`) keeps fp32 master weights
(init N(0, 0.02), norms 1) and is stepped by `torch.optim.Adam` (one optimizer per tensor, so
only one tensor's gradient exists at a time) with Gaussian gradients; every step is published
cast to bf16, as a trainer does. For each learning rate and 1 and 2 subscriber processes over
tcp (or `--transport torch`: a gloo broadcast to the group), the steps alternate between a whole version (`publisher.delta` off for it) and a delta
against the version before, so whole and delta transfers of the same trajectory are measured
side by side in the same run. Per learning rate it reports medians of:

- "values changed": the fraction of bf16 values that differ from the previous version;
- "wire/floor": bytes a delta put on the wire over the floor (changed values times 2 bytes);
- "whole/wire": how many times fewer bytes than the whole version;
- "whole s", "delta s", "speedup": seconds from `publish` to the last subscriber having
  applied the version in place (whole and delta versions of the same run);
- "block whole", "block delta": how long `publish` blocked the trainer (the compare is the
  difference).

With `--micro`, it instead times the encoder alone on one 64 MiB staging bucket of bf16 values
with 2.6%, 6% and 16% of them moved by one unit in the last place: `compare`, building the
bucket's frame (`encode`) and applying it (`apply`), in GB/s of bucket bytes and as a multiple of
a plain copy of the same bytes timed in the same run (best of 7 each, the machine being shared).

A second `--micro` table times compare, encode and apply of eight such buckets one after
another on one thread and spread over `weight_sync.delta.threads()` threads (as the
publisher's compare and encode pools and the subscriber's apply pool run them): GB/s each and
the speedup, medians of 5 paired runs. End to end, `--threads 1,` runs each trajectory once
with the passes one at a time and once spread (the default count: the cores but one, at most 8), the count in the record;
`--copy-threads N` gives torch N threads in the publisher and the subscribers (the staging
copies and `poll`'s copy into the tensors, whole and delta alike). `--receive-memory host,cuda`
runs each trajectory once with the subscribers' tcp receive buffers in host memory and once in
GPU memory (`TcpTransport(memory="cuda")`: frames applied on the GPU, the version applied
device to device), whole and delta alike.

With `--recipe CONFIG`, it instead trains the recipes' own policy (`recipes.learner.Learner`:
the demo's tiny transformer, or `model.family=qwen2 rollout.engine=hf` for the HF Qwen2) on
rollouts it generates with the current weights (`recipes.engines`), and reports per version
the fraction of values that changed, as published (fp32) and cast to bf16.

The machine is shared and noisy; compare only figures of one run. Prints a table and writes
results/weight_sync_delta-<time>.json. Run:

    .venv/bin/python benchmarks/weight_sync_delta.py                       # 1 GiB, lr 1e-6, 3e-6, 1e-5
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 256MiB --steps 4
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 4GiB          # ~28 GiB of RAM: Adam's states
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 4GiB --device cuda   # a GPU trainer: compared on the device
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 4GiB --device cuda --subscriber-device cuda   # GPU to GPU
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 4GiB --device cuda --subscriber-device cuda --receive-memory host,cuda
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 256MiB --transport torch   # gloo broadcast
    .venv/bin/python benchmarks/weight_sync_delta.py --micro
    .venv/bin/python benchmarks/weight_sync_delta.py --sizes 4GiB --lrs 1e-6 --subscribers 1 --steps 4 --copy-threads 8
    .venv/bin/python benchmarks/weight_sync_delta.py --recipe fully_async --steps 10
    .venv/bin/python benchmarks/weight_sync_delta.py --recipe fully_async --steps 10 model.family=qwen2 rollout.engine=hf
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import exit_on_sigterm, median, print_table, write_record  # noqa: E402
from benchmarks.weight_sync import Timeline, Workers, delta_steps, llama_shapes  # noqa: E402

HEADER = [
    "size",
    "lr",
    "subs",
    "recv in",
    "threads",
    "copy threads",
    "values changed",
    "wire MB",
    "whole MB",
    "wire/floor",
    "whole/wire",
    "whole s",
    "delta s",
    "speedup",
    "block whole",
    "block delta",
]


class Trainer:
    """fp32 master weights under Adam with Gaussian gradients, published as bf16, on `device`."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], lr: float, seed: int = 0, device: str = "cpu"):
        gen = torch.Generator(device).manual_seed(seed)
        self.master = {
            n: (
                torch.ones(s, device=device) if len(s) == 1 else torch.randn(s, generator=gen, device=device).mul_(0.02)
            ).requires_grad_()
            for n, s in shapes.items()
        }
        self.optimizers = {n: torch.optim.Adam([p], lr=lr, foreach=False) for n, p in self.master.items()}
        self.gen = gen
        self.bf16 = {n: p.detach().to(torch.bfloat16) for n, p in self.master.items()}

    def step(self) -> int:
        """One Adam step, cast into the bf16 state; returns how many bf16 values changed."""
        changed = 0
        for name, param in self.master.items():
            param.grad = torch.randn(param.shape, generator=self.gen, device=param.device).mul_(1e-3)
            self.optimizers[name].step()
            param.grad = None
            new = param.detach().to(torch.bfloat16)
            changed += int(torch.count_nonzero(new != self.bf16[name]))
            self.bf16[name] = new
        return changed


def run(
    size: str,
    lr: float,
    n: int,
    steps: int,
    workers: Workers,
    version: list[int],
    device: str = "cpu",
    transport: str = "tcp",
    threads: str = "",
    memory: str = "host",
    timeline: bool = False,
) -> dict:
    """One trajectory of `steps` Adam steps on `device` published to `n` subscribers (their
    tensors) over `transport` ("tcp", or "torch": a gloo broadcast), alternating whole and
    delta versions, the delta's compare, encode and apply spread over `threads` threads per
    process ("": the default, `weight_sync.delta.threads`); returns per-version records."""
    from weight_sync import TorchTransport, WeightPublisher
    from weight_sync.delta import threads as delta_threads

    os.environ.pop("SLUICE_DELTA_THREADS", None)
    os.environ.update({"SLUICE_DELTA_THREADS": threads} if threads else {})
    workers.send(n, "threads", threads, torch.get_num_threads())
    assert workers.recv(n) == ["ok"] * n

    shapes = llama_shapes(size)
    trainer = Trainer(shapes, lr, device=device)
    numel = sum(t.numel() for t in trainer.bf16.values())
    rows = []
    served = TorchTransport(world_size=n + 1) if transport == "torch" else transport
    with (
        Timeline(delta_steps()[0] if timeline else ()) as stamped,
        WeightPublisher(None, transport=served, delta=True, timeout=300) as pub,
    ):
        versions = [version[0] + i for i in range(1, steps + 3)]
        version[0] = versions[-1]
        kwargs = {"memory": memory} if memory != "host" else {}
        workers.send(n, "session", transport, kwargs, pub.endpoint, versions, {}, timeline)
        assert workers.recv(n) == ["ready"] * n
        for i, v in enumerate(versions):
            changed = trainer.step() if i >= 2 else 0  # two warm-up versions: one per slot
            delta = i >= 2 and i % 2 == 1
            pub.delta = delta
            t0 = time.monotonic()
            pub.publish(trainer.bf16, v)
            done = workers.recv(n)
            stamps = stamped.take() + [mark for *_, marks in done for mark in marks]
            if i < 2:
                continue
            stats = next(s for s in pub.stats() if s.version == v)
            rows.append(
                {
                    "version": v,
                    "delta": delta,
                    "values_changed": changed / numel,
                    "floor": changed * 2,
                    "whole": stats.requested / n,
                    "sent": stats.sent / n,
                    "seconds": max(t for _, t, *_ in done) - t0,
                    "blocking": pub.last_publish_seconds,
                    "density": stats.density,
                    "compared_on": stats.compared_on,
                    "stamps": _spans(stamps, t0),
                }
            )
        workers.recv(n)  # the session's checksum
    return {
        "size": size,
        "lr": lr,
        "subscribers": n,
        "threads": delta_threads(),
        "copy_threads": torch.get_num_threads(),
        "device": device,
        "transport": transport,
        "receive_memory": memory,
        "versions": rows,
    }


def _spans(stamps: list[tuple[str, float]], t0: float) -> dict[str, list]:
    """Per `--timeline` label: [ms after `publish` started of its first and last stamp, stamps]."""
    spans: dict[str, list] = {}
    for label, at in stamps:
        ms = (at - t0) * 1e3
        span = spans.setdefault(label, [ms, ms, 0])
        span[0], span[1], span[2] = min(span[0], ms), max(span[1], ms), span[2] + 1
    return spans


def print_timeline(record: dict) -> None:
    """`--timeline`: for whole and delta versions, medians of each step's first and last stamp."""
    rows = []
    for delta in (False, True):
        versions = [r for r in record["versions"] if r["delta"] == delta]
        labels = sorted(
            {label for r in versions for label in r["stamps"]},
            key=lambda x: median(r["stamps"][x][0] for r in versions if x in r["stamps"]),
        )
        for label in labels:
            spans = [r["stamps"][label] for r in versions if label in r["stamps"]]
            rows.append(
                [
                    "delta" if delta else "whole",
                    label,
                    median(s[0] for s in spans),
                    median(s[1] for s in spans),
                    median(s[2] for s in spans),
                ]
            )
    title = f"timeline, {record['size']} lr {record['lr']:.0e}, recv in {record['receive_memory']}: ms after publish starts (medians)"
    print_table(title, ["version", "step", "first ms", "last ms", "stamps"], rows)


def summarize(record: dict) -> list:
    whole = [r for r in record["versions"] if not r["delta"]]
    delta = [r for r in record["versions"] if r["delta"]]
    wire = median(r["sent"] for r in delta)
    whole_bytes = median(r["whole"] for r in delta)
    whole_s, delta_s = median(r["seconds"] for r in whole), median(r["seconds"] for r in delta)
    return [
        record["size"],
        f"{record['lr']:.0e}",
        record["subscribers"],
        record["receive_memory"],
        record["threads"],
        record["copy_threads"],
        f"{100 * median(r['values_changed'] for r in record['versions']):.1f}%",
        wire / 1e6,
        whole_bytes / 1e6,
        median(r["sent"] / r["floor"] for r in delta if r["floor"]),
        whole_bytes / wire,
        whole_s,
        delta_s,
        whole_s / delta_s,
        median(r["blocking"] for r in whole),
        median(r["blocking"] for r in delta),
    ]


def _best(fn: Callable[[], object], repeats: int = 7) -> float:
    """The fastest of `repeats` runs of `fn`, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def micro(bucket: int = 64 << 20) -> list[list]:
    """Encoder throughput on one bucket of bf16 values at three densities, against a copy."""
    from weight_sync.delta import CompareScratch

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(bucket // 2, generator=gen).to(torch.bfloat16)
    rows = []
    for fraction in (0.026, 0.06, 0.16):
        new = base.clone()
        new.view(torch.int16)[torch.rand(base.numel(), generator=gen) < fraction] += 1
        rows.append(
            [f"{100 * fraction:.1f}%", *_micro_row(base.view(torch.uint8), new.view(torch.uint8), CompareScratch())]
        )
    return rows


def _micro_row(old: torch.Tensor, new: torch.Tensor, scratch: object) -> list:
    """copy GB/s, then compare, encode and apply GB/s each with its time over the copy's."""
    from weight_sync.delta import apply, compare, encode

    size = old.numel()
    copy = torch.empty_like(old)
    copy_s = _best(functools.partial(copy.copy_, old))
    compare_s = _best(functools.partial(compare, new, old, scratch=scratch))
    row = [size / copy_s / 1e9, size / compare_s / 1e9, compare_s / copy_s]
    changes = compare(new, old, scratch=scratch)
    if changes is None:
        return [*row, "whole", "-", "-", "-", "-"]
    encode_s = _best(functools.partial(encode, size, changes.positions, changes.old, changes.new, 1))
    frame, payload = encode(size, changes.positions, changes.old, changes.new, 1)

    def reapply() -> None:
        copy.copy_(old)
        apply(frame, payload, copy)

    apply_s = _best(reapply) - copy_s
    assert torch.equal(copy, new)
    return [
        *row,
        f"{changes.count / size:.2%}",
        size / encode_s / 1e9,
        encode_s / copy_s,
        size / apply_s / 1e9,
        apply_s / copy_s,
    ]


def micro_threads(buckets: int = 8, bucket: int = 64 << 20) -> list[list]:
    """Compare, encode and apply of `buckets` buckets at 2.6% of bf16 values changed, one
    bucket after another on one thread and spread over `delta.threads()` (as the publisher's
    compare and encode pools and the subscriber's apply pool do): GB/s of bucket bytes each,
    and the speedup (medians of 5 paired runs)."""
    from concurrent.futures import ThreadPoolExecutor

    from weight_sync.delta import CompareScratch, apply, compare, encode, threads

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(buckets * bucket // 2, generator=gen).to(torch.bfloat16)
    new = base.clone()
    new.view(torch.int16)[torch.rand(base.numel(), generator=gen) < 0.026] += 1
    old8, new8, target = base.view(torch.uint8), new.view(torch.uint8), base.view(torch.uint8).clone()
    scratch = threading.local()

    def compared(k: int):  # noqa: ANN202
        if not hasattr(scratch, "s"):
            scratch.s = CompareScratch()
        return compare(new8[k * bucket : (k + 1) * bucket], old8[k * bucket : (k + 1) * bucket], scratch=scratch.s)

    changes = [compared(k) for k in range(buckets)]
    assert all(c is not None for c in changes)
    frames = [encode(bucket, c.positions, c.old, c.new, 1) for c in changes]

    def encoded(k: int) -> object:
        c = changes[k]
        return encode(bucket, c.positions, c.old, c.new, 1)

    def applied(k: int) -> None:
        frame, payload = frames[k]
        assert payload is not None
        apply(frame, payload, target[k * bucket : (k + 1) * bucket])

    n, rows = threads(), []
    with ThreadPoolExecutor(n) as pool:
        for name, step in (("compare", compared), ("encode", encoded), ("apply", applied)):
            pairs = []
            for _ in range(5):
                target.copy_(old8)
                t0 = time.perf_counter()
                for k in range(buckets):
                    step(k)
                one = time.perf_counter() - t0
                target.copy_(old8)
                t0 = time.perf_counter()
                list(pool.map(step, range(buckets)))
                pairs.append((one, time.perf_counter() - t0))
            assert name != "apply" or torch.equal(target, new8)
            size = buckets * bucket
            rows.append(
                [
                    name,
                    n,
                    size / median(p[0] for p in pairs) / 1e9,
                    size / median(p[1] for p in pairs) / 1e9,
                    median(p[0] / p[1] for p in pairs),
                ]
            )
    return rows


def recipe(config: str, overrides: list[str], steps: int) -> dict:
    """Fraction of values changed per version in the recipes' real training (on-policy)."""
    from recipes.config import load
    from recipes.engines import make_engine
    from recipes.learner import Learner, RolloutBatch
    from recipes.task import DigitReversal

    cfg = load([config], overrides)
    learner = Learner(cfg)
    engine = make_engine(cfg, learner.model)
    task = DigitReversal(cfg.task)
    gen = torch.Generator().manual_seed(cfg.seed)
    group = cfg.rollout.group_size
    before = {n: t.detach().clone() for n, t in learner.model.state_dict().items()}
    rows = []
    for _ in range(steps):
        prompts = task.prompts(
            cfg.trainer.ppo_mini_batch_size * cfg.async_training.require_batches, gen
        ).repeat_interleave(group, 0)
        with torch.no_grad():
            out = engine.generate(prompts, task.max_new_tokens, gen)
        rewards = task.rewards(prompts, out.tokens)
        learner.step(RolloutBatch(prompts, out.tokens, out.logprobs, rewards, out.lengths))
        after = {n: t.detach().clone() for n, t in learner.model.state_dict().items()}
        numel = sum(t.numel() for t in after.values())
        fp32 = sum(int(torch.count_nonzero(after[n] != before[n])) for n in after)
        bf16 = sum(int(torch.count_nonzero(after[n].bfloat16() != before[n].bfloat16())) for n in after)
        rows.append({"fp32_changed": fp32 / numel, "bf16_changed": bf16 / numel, "reward": float(rewards.mean())})
        before = after
    return {"config": config, "overrides": overrides, "lr": cfg.trainer.lr, "params": numel, "versions": rows}


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GiB", help="comma-separated of 256MiB,1GiB,4GiB")
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    parser.add_argument("--subscribers", default="1,2")
    parser.add_argument("--steps", type=int, default=6, help="Adam steps per trajectory (half whole, half delta)")
    parser.add_argument("--micro", action="store_true", help="time the encoder alone on one 64 MiB bucket")
    parser.add_argument("--recipe", default=None, help="a recipes/configs name: measure its real training instead")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the trainer's weights live (cuda: compared there)",
    )
    parser.add_argument(
        "--subscriber-device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the subscribers' tensors live (cuda: a GPU rollout engine's; the version is applied host to device)",
    )
    parser.add_argument(
        "--transport", default="tcp", choices=["tcp", "torch"], help="tcp pulls, or torch: a gloo broadcast"
    )
    parser.add_argument(
        "--threads",
        default="1,",
        help="comma-separated threads per process for the delta's compare, encode and apply, each a run "
        "of its own ('': the default, the cores available but one, at most 8; 1: one at a time)",
    )
    parser.add_argument(
        "--copy-threads",
        type=int,
        default=1,
        help="torch's threads in the publisher and the subscribers (staging and applying copies), whole and delta",
    )
    parser.add_argument(
        "--receive-memory",
        default="host",
        help="comma-separated of host,cuda: where tcp subscribers receive (TcpTransport(memory=): "
        "cuda lands the bytes in GPU buffers and applies delta frames there), each a run of its own",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="stamp each step of a version in the publisher and the subscribers (compares, frames, pulls, applies)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe config overrides")
    args = parser.parse_args()
    torch.set_num_threads(args.copy_threads)
    if args.micro:
        header = [
            "bf16 changed",
            "copy GB/s",
            "compare GB/s",
            "x copy",
            "bytes changed",
            "encode GB/s",
            "x copy",
            "apply GB/s",
            "x copy",
        ]
        rows = micro()
        print_table(
            "delta encoder on one 64 MiB bucket (best of 7; 'x copy': time over a copy of the bucket)", header, rows
        )
        spread_header = ["step", "threads", "1 thread GB/s", "spread GB/s", "speedup"]
        spread = micro_threads()
        print_table(
            "eight 64 MiB buckets at 2.6% changed, one after another vs spread over threads (medians of 5)",
            spread_header,
            spread,
        )
        record = {"header": header, "rows": rows, "spread_header": spread_header, "spread": spread}
        print("wrote", write_record("weight_sync_delta_micro", record))
        return
    if args.recipe is not None:
        record = recipe(args.recipe, args.overrides, args.steps)
        rows = [
            [i + 1, f"{100 * r['fp32_changed']:.1f}%", f"{100 * r['bf16_changed']:.1f}%", r["reward"]]
            for i, r in enumerate(record["versions"])
        ]
        title = f"{args.recipe} {' '.join(args.overrides)} (lr {record['lr']}, {record['params']:,} values)"
        print_table(title, ["version", "fp32 changed", "bf16 changed", "reward"], rows)
        print("wrote", write_record("weight_sync_delta_recipe", record))
        return
    counts = [int(x) for x in args.subscribers.split(",")]
    workers = Workers(max(counts))
    version = [0]
    records, rows = [], []
    try:
        for size in args.sizes.split(","):
            workers.hold(llama_shapes(size), max(counts))
            if args.subscriber_device != "cpu":
                workers.send(max(counts), "to", args.subscriber_device)
                assert workers.recv(max(counts)) == ["ok"] * max(counts)
            for n in counts:
                for lr in (float(x) for x in args.lrs.split(",")):
                    for threads, memory in itertools.product(args.threads.split(","), args.receive_memory.split(",")):
                        record = run(
                            size,
                            lr,
                            n,
                            args.steps,
                            workers,
                            version,
                            args.device,
                            args.transport,
                            threads,
                            memory,
                            args.timeline,
                        )
                        records.append(record)
                        rows.append(summarize(record))
                        print_table(
                            f"delta weight sync over {args.transport}, {args.device} weights -> {args.subscriber_device} (so far)",
                            HEADER,
                            rows[-1:],
                        )
                        if args.timeline:
                            print_timeline(record)
    finally:
        workers.close()
    title = (
        f"delta weight sync over {args.transport}, {args.device} weights -> {args.subscriber_device}: "
        "medians per learning rate"
    )
    print_table(title, HEADER, rows)
    print("wrote", write_record("weight_sync_delta", {"args": vars(args), "runs": records}))


if __name__ == "__main__":
    main()
