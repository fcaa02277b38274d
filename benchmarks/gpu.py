"""GPU benchmark: Sluice's GPU paths next to what the card allows, in one run on whatever GPU it finds.

It measures, on the first CUDA device (subscribers spread over the others when there are any):

- the limits: device-to-device copy, device-to-host and host-to-device through pinned and
  pageable host memory, each of the weights' bytes;
- the CUDA IPC baseline: another process holds the trainer's tensors' IPC handles
  (torch.multiprocessing) and copies them device to device into its own tensors per version;
- the data plane: `put` a batch of CUDA tensors (256 x 8,192 tokens, 59 MB: input_ids,
  attention_mask, position_ids, old_log_probs), `get_data(device="cuda")`, clear; through the
  mapped arena (co-located) and TCP frames, against the raw pinned round trip (D2H + H2D of the
  same bytes);
- weight sync of Llama-shaped bf16 CUDA weights into CUDA tensors of 1 and 2 subscriber
  processes, over cuda_ipc, auto (a publisher on "auto" serving host staging and, from the
  first cuda_ipc lease, GPU staging beside it), shm, tcp, ucx and nixl (when installed;
  `nixl_cuda` is nixl with `memory="cuda"` on both sides: GPU staging read into GPU receive
  buffers) and torch (NCCL
  when there is a GPU per member, else gloo): end to end (publish to the last subscriber's
  apply), how long `publish` blocks, the first version's end to end over the steady state's, and
  whether every version arrived exact (an exact integer checksum of all bytes, per version).

Each figure is printed with its limit and the ratio (a row's limit: one D2D copy of the weights
for the GPU-staged rows, cuda_ipc, auto, nixl_cuda and NCCL; the pinned D2H + H2D of the same bytes
for the host-staged transports; blocking against a D2D snapshot or a pinned D2H). Without CUDA
it says so and exits 0. Needs nothing beyond the project's dependencies. Writes
results/gpu-<time>.json. Run:

    python benchmarks/gpu.py                          # 4 GiB and 16 GiB, every transport
    python benchmarks/gpu.py --sizes 4GiB --reps 3    # one size
    python benchmarks/gpu.py --transports cuda_ipc,shm --subscribers 1
    python benchmarks/gpu.py --sizes 4GiB --transports nixl,nixl_cuda --subscribers 1   # nixl from host / GPU slots
    python benchmarks/gpu.py --data-plane-only        # the data plane alone (seconds)
    python benchmarks/gpu.py --device cpu --sizes 256MiB --transports shm --subscribers 1 --reps 1
        # the script's own check on a machine without a GPU (host paths only, not GPU figures)
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import exit_on_sigterm, gbps, median, print_table, write_record  # noqa: E402
from benchmarks.weight_sync import llama_shapes  # noqa: E402

WARMUP = 2
"""Versions published before measuring (one per staging slot); the first one is reported apart."""
TRANSPORTS = ("cuda_ipc", "auto", "shm", "tcp", "ucx", "nixl", "nixl_cuda", "torch")
GPU_STAGED = ("cuda_ipc", "auto", "nixl_cuda")
"""Rows whose subscribers read GPU staging, so they need CUDA (torch under NCCL stages there too:
its limit is chosen by backend). `auto`: both sides on "auto", so the publisher stages on the
host and, from the first cuda_ipc lease, on the GPU beside it (`weight_sync.gpu_mirror`)."""
BATCH = (256, 8192)
"""The data plane's batch: samples x tokens."""
FIXED = (256, 8)
"""A batch whose copies cost next to nothing: its round trip is a path's fixed cost per call."""


# -- limits ------------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `fn` (after one untimed call), synchronising the device around it."""

    def once() -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    once()
    return median(once() for _ in range(reps))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def limits(nbytes: int, device: torch.device, reps: int) -> dict[str, float]:
    """Seconds to move `nbytes` once: D2D, and D2H/H2D through pinned and pageable memory (the
    buffers are freed once the caller calls `_free`)."""
    pinned = device.type == "cuda"
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
    page = torch.ones(nbytes, dtype=torch.uint8)
    return {
        "d2d": _timed(lambda: dst.copy_(src), device, reps),
        "d2h_pinned": _timed(lambda: host.copy_(src, non_blocking=True), device, reps),
        "h2d_pinned": _timed(lambda: dst.copy_(host, non_blocking=True), device, reps),
        "d2h_pageable": _timed(lambda: page.copy_(src), device, reps),
        "h2d_pageable": _timed(lambda: dst.copy_(page), device, reps),
    }


def _free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.ipc_collect()  # GPU slots other processes had opened, released by them since
        torch.cuda.empty_cache()


# -- the CUDA IPC baseline -----------------------------------------------------------------------


def _ipc_child(queue, conn) -> None:  # noqa: ANN001
    """Hold the parent's tensors (their IPC handles, via torch.multiprocessing) and copy them into
    our own, device to device, whenever told; answer with the monotonic time when done."""
    theirs = queue.get()
    mine = {n: torch.empty_like(t) for n, t in theirs.items()}
    while conn.recv():
        for name, tensor in theirs.items():
            mine[name].copy_(tensor)
        torch.cuda.synchronize()
        conn.send(time.monotonic())
    del theirs


def ipc_baseline(state: dict[str, torch.Tensor], reps: int) -> list[float]:
    """Seconds per version for another process to copy `state` device to device through CUDA IPC."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue, (conn, child) = ctx.Queue(), ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(queue, child), daemon=True)
    proc.start()
    queue.put(state)
    out = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.monotonic()
        conn.send(True)
        out.append(conn.recv() - t0)
    conn.send(False)
    proc.join(60)
    return out[1:]


# -- the data plane ------------------------------------------------------------------------------


def batch(device: torch.device, shape: tuple[int, int] = BATCH) -> dict[str, torch.Tensor]:
    n, t = shape
    return {
        "input_ids": torch.randint(0, 128000, (n, t), device=device),
        "attention_mask": torch.ones(n, t, dtype=torch.int64, device=device),
        "position_ids": torch.arange(t, device=device).expand(n, t).contiguous(),
        "old_log_probs": torch.randn(n, t, device=device),
    }


def data_plane(device: torch.device, reps: int) -> dict[str, dict]:
    """Seconds per round trip (put from `device`, get_data onto it, clear), mapped and over TCP,
    put and get_data apart, and whether every batch came back equal; with the raw pinned round
    trip as the limit. The same round trip of a tiny batch (`FIXED`) gives each path's fixed
    cost per call (messages and Python), which the big batch pays on top of its copies."""
    import transfer_queue as tq

    data = batch(device)
    nbytes = sum(t.numel() * t.element_size() for t in data.values())
    pinned = device.type == "cuda"
    hosts = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for n, t in data.items()}
    back = {n: torch.empty_like(t) for n, t in data.items()}

    def raw() -> None:
        for name, tensor in data.items():
            hosts[name].copy_(tensor, non_blocking=True)
        _sync(device)
        for name, tensor in hosts.items():
            back[name].copy_(tensor, non_blocking=True)

    out: dict[str, dict] = {"raw pinned": {"bytes": nbytes, "seconds": [_timed(raw, device, reps)]}}
    small = batch(device, FIXED)
    # The default capacity (2 GiB): a unit far smaller than the batches it takes would measure
    # its allocator instead, since frames over 1/32 of a unit's capacity land in fresh pages
    # (storage/__main__.py).
    with tq.init(num_storage_units=1) as cluster:
        for label, use_shm in (("mapped arena", True), ("tcp frames", False)):
            with tq.connect(cluster.address, use_shm=use_shm) as client:
                for suffix, tensors in (("", data), (f" {FIXED[0]}x{FIXED[1]}", small)):
                    puts, gets, exact = [], [], True
                    for i in range(reps + 2):
                        _sync(device)
                        t0 = time.perf_counter()
                        meta = client.put(tensors, f"gpu{suffix}")
                        t1 = time.perf_counter()
                        got = client.get_data(meta, device=device)
                        _sync(device)
                        if i >= 2:
                            puts.append(t1 - t0)
                            gets.append(time.perf_counter() - t1)
                        exact = exact and all(torch.equal(got[n], t) for n, t in tensors.items())
                        client.clear(meta)
                    size = sum(t.numel() * t.element_size() for t in tensors.values())
                    seconds = [p + g for p, g in zip(puts, gets)]
                    out[label + suffix] = {"bytes": size, "seconds": seconds, "put": puts, "get": gets, "exact": exact}
    return out


# -- weight sync ---------------------------------------------------------------------------------


def checksum(tensors) -> int:  # noqa: ANN001 - an iterable of tensors
    """An exact integer checksum of the tensors' bytes (as int16 words, summed in int64)."""
    return int(sum(int(t.view(-1).view(torch.int16).sum(dtype=torch.int64)) for t in tensors))


def _subscriber(conn, gpu: int, device: str) -> None:  # noqa: ANN001
    """A rollout process: hold zeroed tensors on `device` (GPU `gpu`), run sessions on command,
    answer (version, monotonic time, apply seconds, checksum) per version."""
    from weight_sync import TorchTransport, WeightSubscriber

    if device == "cuda":
        torch.cuda.set_device(gpu)
    dev = torch.device(device)
    targets: dict[str, torch.Tensor] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "quit":
            return
        if cmd == "shapes":
            targets = {}
            _free(dev)
            targets = {n: torch.zeros(s, dtype=torch.bfloat16, device=dev) for n, s in args[0].items()}
            conn.send("ok")
        elif cmd == "session":
            name, backend, endpoint, versions = args
            transport = TorchTransport(backend=backend) if name == "torch" else _named(name)
            with WeightSubscriber(None, targets, transport=transport, publisher=endpoint, timeout=300) as sub:
                sub.poll()  # connect and open co-located slots now, as a rollout worker does at start-up
                conn.send("ready")
                for version in versions:
                    sub.wait(version, timeout=600)
                    _sync(dev)
                    done = time.monotonic()
                    conn.send((sub.version, done, sub.last_apply_seconds, checksum(targets.values())))


class Subscribers:
    """Long-lived subscriber processes (forkserver: CUDA is initialised in each child only)."""

    def __init__(self, n: int, device: str):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "weight_sync"])
        gpus = torch.cuda.device_count() if device == "cuda" else 1
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            gpu = (i + 1) % gpus if gpus > 1 else 0
            proc = ctx.Process(target=_subscriber, args=(child, gpu, device), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def all(self, n: int, *msg) -> list:  # noqa: ANN002
        for conn in self.conns[:n]:
            conn.send(msg)
        return [conn.recv() for conn in self.conns[:n]]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(("quit",))
        for proc in self.procs:
            proc.join(30)


def _named(name: str):  # noqa: ANN202 - a name or a Transport
    """A row's transport as either side builds it (not torch's): `nixl_cuda` is nixl staging on
    the publisher's GPU and receiving into the subscriber's."""
    from weight_sync import NixlTransport

    return NixlTransport(memory="cuda") if name == "nixl_cuda" else name


def _transport(name: str, n: int, device: torch.device):  # noqa: ANN202
    """The publisher's transport and the torch backend its subscribers use."""
    from weight_sync import TorchTransport

    if name != "torch":
        return _named(name), ""
    backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() > n else "gloo"
    return TorchTransport(world_size=n + 1, backend=backend), backend


def weight_sync(
    name: str, n: int, state: dict[str, torch.Tensor], subs: Subscribers, reps: int, slots: int, device: torch.device
) -> dict:
    """Publish WARMUP + `reps` versions to `n` subscribers; per version: end to end, publish
    blocking, slowest apply, when the last subscriber's copies started (after `publish` was
    called; a little late, as each subscriber stamps its end after `wait` returns), how much the
    subscribers' copies overlapped (`overlap`; n > 1), and whether every subscriber holds exactly
    the published bytes. Where end to end goes beyond the copies: waiting, or copies serialised."""
    from weight_sync import WeightPublisher

    transport, backend = _transport(name, n, device)
    out: dict = {
        "seconds": [],
        "blocking": [],
        "apply": [],
        "start": [],
        "overlap": [],
        "exact": True,
        "backend": backend,
    }
    first = next(iter(state.values())).view(-1)
    # whole versions: what this measures (deltas are weight_sync_delta.py's)
    with WeightPublisher(None, transport=transport, slots=slots, timeout=600, model=state, delta=False) as pub:
        versions = list(range(1, WARMUP + reps + 1))
        assert subs.all(n, "session", name, backend, pub.endpoint, versions) == ["ready"] * n
        for i, version in enumerate(versions):
            first[0] = version  # each version differs from the last
            want = checksum(state.values())
            _sync(device)
            t0 = time.monotonic()
            pub.publish(state, version)
            blocking = pub.last_publish_seconds
            done = [conn.recv() for conn in subs.conns[:n]]
            seconds = max(d[1] for d in done) - t0
            out["exact"] = out["exact"] and all(d[0] == version and d[3] == want for d in done)
            if i == 0:
                out["first"], out["first_blocking"] = seconds, blocking
            if i >= WARMUP:
                out["seconds"].append(seconds)
                out["blocking"].append(blocking)
                out["apply"].append(max(d[2] for d in done))
                spans = [(d[1] - d[2], d[1]) for d in done]  # one host: the subscribers' clock is this one
                out["start"].append(max(s for s, _ in spans) - t0)
                if n > 1:
                    out["overlap"].append(overlap(spans))
    return out


def overlap(spans: list[tuple[float, float]]) -> float:
    """How much the (start, end) spans ran side by side: the time they shared (their sum less
    their union) over the most they could share (their sum less the longest); 1 = all at once,
    0 = one after another."""
    total = sum(e - s for s, e in spans)
    union, reach = 0.0, -math.inf
    for s, e in sorted(spans):
        union += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    most = total - max(e - s for s, e in spans)
    return (total - union) / most if most > 0 else 1.0


def _available(name: str, device: torch.device) -> bool:
    from weight_sync.transports import get

    if name in GPU_STAGED and device.type != "cuda":
        return False
    if name == "auto":
        return True
    return get("nixl" if name == "nixl_cuda" else name).is_available()


# -- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4GiB,16GiB", help="comma-separated of 256MiB,1GiB,4GiB,16GiB")
    parser.add_argument("--subscribers", default="1,2", help="comma-separated subscriber counts")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated transports")
    parser.add_argument("--reps", type=int, default=5, help="measured versions (and batches) per configuration")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: check the script itself")
    parser.add_argument("--data-plane-only", action="store_true", help="measure the data plane, not weight sync")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here (torch sees none); nothing to measure")
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (script check, not GPU figures)"
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    print(f"device: {card}, {gpus} GPU(s), torch {torch.__version__}")
    counts = [int(c) for c in args.subscribers.split(",")]
    names = [t for t in args.transports.split(",") if _available(t, device)]
    skipped = sorted(set(args.transports.split(",")) - set(names))
    if skipped:
        print(f"not available here, skipped: {', '.join(skipped)}")
    if "nixl_cuda" in names and "ucx" in names and "UCX_TLS" not in os.environ:
        # the ucx row sets UCX_TLS (tcp,sm,self) in each process it runs in, which would leave the
        # nixl_cuda rows after it without UCX's CUDA transports: set one list for every row
        from weight_sync.transports.ucx import DEFAULT_TLS

        os.environ["UCX_TLS"] = f"{DEFAULT_TLS},cuda_copy,cuda_ipc"
        print(f"UCX_TLS={os.environ['UCX_TLS']} (ucx and nixl_cuda in one run)")
    record: dict = {"card": card, "gpus": gpus, "sizes": {}}

    dp = data_plane(device, args.reps)
    record["data_plane"] = dp
    raw = dp["raw pinned"]["seconds"][0]
    rows = [
        [
            label,
            f["bytes"] / 1e6,
            median(f["seconds"]),
            median(f["put"]) if "put" in f else float("nan"),
            median(f["get"]) if "get" in f else float("nan"),
            gbps(f["bytes"], median(f["seconds"])),
            raw / median(f["seconds"]) if f["bytes"] == dp["raw pinned"]["bytes"] else float("nan"),
            f.get("exact", "-"),
        ]
        for label, f in dp.items()
    ]
    print_table(
        f"data plane: put {BATCH[0]}x{BATCH[1]} CUDA batches (and {FIXED[0]}x{FIXED[1]}: the fixed cost), "
        f"get_data(device=) back, medians of {args.reps}",
        ["path", "MB", "s", "put s", "get s", "GB/s", "raw pinned/s (goal >= 0.5)", "exact"],
        rows,
    )

    if args.data_plane_only:
        print(f"wrote {write_record('gpu', record)}")
        return 0
    subs = Subscribers(max(counts), args.device)
    try:
        for size in args.sizes.split(","):
            shapes = llama_shapes(size)
            state = {n: torch.randn(s, device=device).to(torch.bfloat16) for n, s in shapes.items()}
            nbytes = sum(t.numel() * 2 for t in state.values())
            lim = limits(nbytes, device, 3)
            _free(device)  # the limits' buffers
            entry: dict = {"bytes": nbytes, "limits": lim, "rows": {}}
            print_table(
                f"limits, {size} ({nbytes / 1e9:.2f} GB)",
                ["what", "s", "GB/s"],
                [[k, v, gbps(nbytes, v)] for k, v in lim.items()],
            )
            if device.type == "cuda":
                entry["cuda_ipc_baseline"] = ipc_baseline(state, args.reps)
            big = nbytes > 8 << 30
            rows = []
            for n in counts:
                assert subs.all(n, "shapes", shapes) == ["ok"] * n
                for name in names:
                    res = weight_sync(name, n, state, subs, args.reps, 1 if big else 2, device)
                    _free(device)
                    label = f"{name}{'/' + res['backend'] if res['backend'] else ''} x{n}"
                    entry["rows"][label] = res
                    gpu_limit = name in GPU_STAGED or res["backend"] == "nccl"
                    limit = lim["d2d"] if gpu_limit else lim["d2h_pinned"] + lim["h2d_pinned"]
                    block_limit = lim["d2d"] if gpu_limit else lim["d2h_pinned"]
                    s, b = median(res["seconds"]), median(res["blocking"])
                    rows.append(
                        [label, s, gbps(nbytes, s), s / limit, b, b / block_limit, res["first"] / s, res["exact"]]
                    )
                    overlapping = f", overlapping {median(res['overlap']):.2f}" if res["overlap"] else ""
                    print(
                        f"  {size} {label}: {s * 1e3:.1f} ms ({s / limit:.2f}x limit), blocks {b * 1e3:.1f} ms, "
                        f"slowest apply {median(res['apply']) * 1e3:.1f} ms ({median(res['apply']) / limit:.2f}x) "
                        f"starting at +{median(res['start']) * 1e3:.1f} ms{overlapping}, "
                        f"first {res['first'] * 1e3:.1f} ms, exact {res['exact']}",
                        flush=True,
                    )
                subs.all(n, "shapes", {})
            if "cuda_ipc_baseline" in entry:
                s = median(entry["cuda_ipc_baseline"])
                rows.append(
                    [
                        "torch.mp CUDA IPC baseline x1",
                        s,
                        gbps(nbytes, s),
                        s / lim["d2d"],
                        float("nan"),
                        float("nan"),
                        float("nan"),
                        True,
                    ]
                )
            print_table(
                f"weight sync {size}, CUDA weights into CUDA tensors: medians of {args.reps} versions; limit = one D2D copy "
                "(cuda_ipc, auto, nixl_cuda, nccl; goal <= 3, blocks <= 2) or pinned D2H + H2D (host-staged; shm goal <= 2, blocks <= 1.5); "
                "first/s goal <= 1.5",
                ["what", "s", "GB/s each", "s/limit", "blocks s", "blocks/limit", "first/s", "exact"],
                rows,
            )
            record["sizes"][size] = entry
            del state
            _free(device)
    finally:
        subs.close()
    path = write_record("gpu", record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
