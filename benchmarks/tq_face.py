"""TransferQueue 0.1.11's KV API as verl drives it, timed on whichever `transfer_queue` is installed.

Each round puts a rollout-shaped batch under fresh keys (`input_ids`, `attention_mask`,
`old_log_prob` and a per-sample string `uid`, with `status` tags), reads it back, lists the
partition's keys and clears them: the calls verl's agent loop, replay buffer and trainer make.
Run it in this repo's environment (Sluice's face) and in one where TransferQueue itself is
installed (it needs Ray; `--ray-cpus` gives its actors logical CPUs, which a 2-core machine
lacks), then compare the two tables:

    python benchmarks/tq_face.py --batch 64 --seqlen 2048 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import transfer_queue as tq


def rollout_batch(batch: int, seqlen: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    data = TensorDict(
        {
            "input_ids": torch.randint(0, 32000, (batch, seqlen), generator=gen),
            "attention_mask": torch.ones(batch, seqlen, dtype=torch.int64),
            "old_log_prob": torch.randn(batch, seqlen, generator=gen),
        },
        batch_size=[batch],
    )
    data["uid"] = NonTensorStack(*(NonTensorData(f"uid-{seed}-{i}") for i in range(batch)), stack_dim=0)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ray-cpus", type=int, default=8)
    parser.add_argument("--capacity", default="2GiB", help="Sluice storage_capacity (TransferQueue ignores it)")
    args = parser.parse_args()
    sluice = hasattr(tq, "connect")
    if not sluice:
        import ray

        ray.init(num_cpus=args.ray_cpus, include_dashboard=False, object_store_memory=512 << 20)
    start = time.perf_counter()
    tq.init(
        {"backend": {"SimpleStorage": {"num_data_storage_units": 2}}, "sluice": {"storage_capacity": args.capacity}}
    )
    init_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"kv_batch_put": [], "kv_batch_get": [], "kv_list": [], "kv_clear": []}
    nbytes = 0
    try:
        for r in range(args.warmup + args.rounds):
            data = rollout_batch(args.batch, args.seqlen, r)
            nbytes = sum(v.numel() * v.element_size() for k, v in data.items() if k != "uid")
            keys = [f"u{r}_{i}_0" for i in range(args.batch)]
            tags = [{"status": "success", "global_steps": r} for _ in keys]
            marks = [time.perf_counter()]
            tq.kv_batch_put(keys=keys, partition_id="train", fields=data, tags=tags)
            marks.append(time.perf_counter())
            got = tq.kv_batch_get(keys=keys, partition_id="train")
            marks.append(time.perf_counter())
            listed = tq.kv_list("train")
            marks.append(time.perf_counter())
            tq.kv_clear(keys=keys, partition_id="train")
            marks.append(time.perf_counter())
            ids = got["input_ids"]
            ids = torch.stack(ids.unbind()) if ids.is_nested else ids  # TransferQueue may answer jagged
            assert torch.equal(ids, data["input_ids"]) and len(listed["train"]) == args.batch
            if r >= args.warmup:
                for name, a, b in zip(times, marks, marks[1:]):
                    times[name].append(b - a)
    finally:
        tq.close()
    impl = "Sluice" if sluice else "TransferQueue"
    print(
        f"{impl}: init {init_s:.2f} s; batch {args.batch} x seqlen {args.seqlen} = {nbytes / 2**20:.1f} MiB of tensors + uid strings"
    )
    print(f"| {impl} | median ms | MiB/s |")
    print("| --- | --- | --- |")
    for name, values in times.items():
        ms = statistics.median(values) * 1e3
        rate = f"{nbytes / 2**20 / (ms / 1e3):.0f}" if name in ("kv_batch_put", "kv_batch_get") else "-"
        print(f"| {name} | {ms:.1f} | {rate} |")


if __name__ == "__main__":
    main()
