"""Weight-sync benchmark: trainer weights to 1 and 2 rollout processes, every transport, next
to the limits and baselines measured in the same run.

For each state-dict size (Llama-shaped bf16 tensors) it measures, as medians over repeated
versions after warm-up versions (one per staging slot):

- each transport (shm, tcp pipelined and not, ucx and nixl when installed, torch/gloo) to 1 and 2
  subscriber processes: seconds from `publish` to the last subscriber having applied the
  version in place ("s"), GB/s into each subscriber over that time and over the time after
  `publish` returned, how long `publish` blocked the trainer, and the first version's seconds
  and blocking over the steady state's ("first/s", "first blocks/blocks": the publisher is
  built with `model=`, so its staging is allocated before the first publish; the first
  version still pays for the subscribers' receive buffers and mappings);
- the memcpy floor: copying the state dict once into touched memory, one thread, measured
  again right before every publish (block/memcpy is the median of those paired ratios);
- the raw socket: the state's bytes over one loopback TCP connection per subscriber,
  received with `recv_into` straight into its tensors (no protocol, no staging), measured
  again right before each configuration with as many subscribers ("raw sock/s" is the
  fraction of that speed reached);
- for the ucx rows, UCX's own limit: `ucx_perftest` (the tag bandwidth test of the libucx
  wheel ucxx installs) between as many sender/receiver process pairs, over the same `UCX_TLS`
  (default `tcp,sm,self`) with endpoint error handling on, the faster of its polling and
  sleeping modes, measured right before each version ("ucx/perftest" is the median of the
  paired ratios; `UCX_TLS=tcp .venv/bin/python benchmarks/weight_sync.py ...` picks others);
- what a team would otherwise use: `torch.save` to /dev/shm then `torch.load` (plain, and
  with `mmap=True`) and copy into the model, in every subscriber; Ray's object store
  (`ray.put` of the state dict, `ray.get` and copy in every subscriber, as Ray actors; up to
  1 GiB, as its store and actors do not fit beside a 4 GiB run in 24 GiB). "save+load/s" is
  how many times faster than the plain torch.save/load a row is.

The machines are shared and noisy: every ratio is against limits of the same run. Prints a
table and writes results/weight_sync-<time>.json. Run:

    .venv/bin/python benchmarks/weight_sync.py                    # 1 GiB (~5 minutes)
    .venv/bin/python benchmarks/weight_sync.py --sizes 1GiB,4GiB  # and 4 GiB (~10 minutes)
    .venv/bin/python benchmarks/weight_sync.py --quick            # 256 MiB, 3 repeats (~1.5 minutes)
    .venv/bin/python benchmarks/weight_sync.py --quick --reps 5 --transports ucx --no-baselines  # ucx vs ucx_perftest
    .venv/bin/python benchmarks/weight_sync.py --latency --timeline  # per-version control latency (~30 s)
    python benchmarks/weight_sync.py --latency --timeline --transports cuda_ipc --sizes 4GiB --versions 50  # on a GPU

`--latency` measures the control path alone: a tiny Llama-shaped model (84 bf16 tensors, ~47 KB,
so the copies cost next to nothing) over `shm` to one subscriber process waiting in `wait()`,
many versions, each published once the subscriber waits again; per version the time from
`publish`'s start to `wait` returning in the subscriber (one system-wide monotonic clock),
median and p90. `--transports cuda_ipc` (the first name given is used) holds the weights and the
subscriber's tensors on the GPU, and `--sizes` picks a model of `CONFIGS` instead of the tiny one. `--timeline` also stamps each step on both sides (the server thread learning
the version is complete, the offer sent and received, the lease, the apply's start and end, the
release arriving) by wrapping those functions in both processes, which adds a few
microseconds per stamp.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import exit_on_sigterm, gbps, median, percentile, print_table, write_record  # noqa: E402
from benchmarks._ucx import limit as ucx_limit  #
from benchmarks._ucx import perftest_binary  # noqa: E402

UCX_HEADER = ["size", "what", "UCX_TLS", "ucx GB/s each", "ucx_perftest GB/s each", "ucx/perftest"]

GIB = 1 << 30
WARMUP = 2
"""Versions published before measuring: one per staging slot (and receive buffer)."""

# hidden, intermediate, kv width, vocab: a TinyLlama-like and a Llama-2-7B-like layer stack
CONFIGS = {
    "256MiB": (1024, 2816, 256, 32000),
    "1GiB": (2048, 5632, 256, 32000),
    "4GiB": (4096, 11008, 4096, 32000),
    "16GiB": (4096, 14336, 1024, 128256),  # Llama-3-8B-like (grouped KV heads, large vocabulary)
}


TINY = (16, 32, 16, 32)
"""`--latency`'s model: 9 such layers are 84 tensors of ~47 KB in all, so its copies cost next to nothing."""
TINY_LAYERS = 9


def llama_shapes(size: str, layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Llama-style tensor shapes (HF names) whose bf16 total is close to `size` (one of `CONFIGS`),
    or `layers` layers of `TINY`'s widths when `size` is "tiny"."""
    hidden, inter, kv, vocab = TINY if size == "tiny" else CONFIGS[size]
    if layers is None:
        target = {"256MiB": 256 << 20, "1GiB": GIB, "4GiB": 4 * GIB, "16GiB": 16 * GIB}[size] // 2
        per_layer = 2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * inter + 2 * hidden
        layers = max(1, round((target - 2 * vocab * hidden - hidden) / per_layer))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (hidden, hidden),
                p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden),
                p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def _zeros(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}  # zero-filled: touched


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


# -- the subscriber-side worker: one long-lived process per subscriber ------------------------


def worker(conn) -> None:  # noqa: ANN001
    """Serve commands from the benchmark: hold the model's tensors, run a subscriber session or
    a baseline's receiving side, answer with monotonic timestamps (one clock per machine)."""
    torch.set_num_threads(1)
    from weight_sync import WeightSubscriber
    from weight_sync.transports import get

    targets: dict[str, torch.Tensor] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "quit":
            return
        if cmd == "shapes":
            targets = {}
            gc.collect()
            targets = _zeros(args[0])
            conn.send("ok")
        elif cmd == "to":  # (device,): the held tensors move there (a GPU rollout engine's weights)
            targets = {n: t.to(args[0]) for n, t in targets.items()}
            conn.send("ok")
        elif cmd == "threads":  # (SLUICE_DELTA_THREADS or "", torch's threads) for the next sessions
            delta, copies = args
            os.environ.pop("SLUICE_DELTA_THREADS", None)
            os.environ.update({"SLUICE_DELTA_THREADS": delta} if delta else {})
            torch.set_num_threads(copies)
            conn.send("ok")
        elif cmd == "session":  # (transport name, kwargs, endpoint, versions, subscriber kwargs, stamp deltas)
            name, kwargs, endpoint, versions, sub_kwargs, timeline = args
            transport = get(name)(**kwargs) if kwargs else name
            with (
                Timeline(delta_steps()[1] if timeline else ()) as steps,
                WeightSubscriber(
                    None, targets, transport=transport, publisher=endpoint, timeout=120, **sub_kwargs
                ) as sub,
            ):
                conn.send("ready")
                for version in versions:
                    sub.wait(version, timeout=300)
                    conn.send((version, time.monotonic(), sub.last_apply_seconds, steps.take()))
            conn.send(float(sum(t.float().sum().item() for t in list(targets.values())[:3])))
        elif cmd == "latency":  # (endpoint, versions, timeline, transport, device): wait for each version
            endpoint, versions, timeline, name, device = args
            targets = {n: t.to(device) for n, t in targets.items()}
            with (
                Timeline(_steps()[1] if timeline else ()) as steps,
                WeightSubscriber(None, targets, transport=name, publisher=endpoint, timeout=60) as sub,
            ):
                sub.poll()  # connects and maps the slots, as a rollout worker does at start-up
                conn.send("ready")
                for version in versions:
                    sub.wait(version, timeout=60)
                    conn.send((version, time.monotonic(), steps.take()))
                conn.send(float(next(iter(targets.values())).float().mean().item()))
        elif cmd == "raw":  # receive the tensors' bytes over one TCP connection, in place
            srv = socket.socket()
            srv.bind(("127.0.0.1", 0))
            srv.listen(1)
            conn.send(srv.getsockname()[1])
            peer, _ = srv.accept()
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            for _ in range(args[0]):
                for tensor in targets.values():
                    view, got = _bytes(tensor), 0
                    while got < len(view):
                        got += peer.recv_into(view[got:])
                conn.send(time.monotonic())
            peer.close()
            srv.close()
        elif cmd == "torch_load":  # (path, mmap)
            path, use_mmap = args
            loaded = torch.load(path, mmap=use_mmap, weights_only=True)
            for name, tensor in loaded.items():
                targets[name].copy_(tensor)
            del loaded
            conn.send(time.monotonic())


class Workers:
    """The subscriber processes, started once (forkserver, torch preloaded)."""

    def __init__(self, n: int):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "weight_sync"])
        self.conns = []
        self.procs = []
        self.held: list[dict] = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
            self.held.append({})

    def send(self, n: int, *msg) -> None:  # noqa: ANN002
        for conn in self.conns[:n]:
            conn.send(msg)

    def recv(self, n: int) -> list:
        return [conn.recv() for conn in self.conns[:n]]

    def hold(self, shapes: dict, n: int) -> None:
        """The first `n` workers hold a model of `shapes` (touched); the others hold none."""
        for i, conn in enumerate(self.conns):
            want = shapes if i < n else {}
            if self.held[i] != want:
                conn.send(("shapes", want))
                conn.recv()
                self.held[i] = want

    def close(self) -> None:
        self.send(len(self.conns), "quit")
        for proc in self.procs:
            proc.join(10)


# -- measurements -----------------------------------------------------------------------------


class Floor:
    """The memcpy floor: the state dict copied once, tensor by tensor, into touched memory
    (one reused scratch as large as the largest tensor, to spare RAM), one thread."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.scratch = torch.zeros(max(t.numel() for t in state.values()), dtype=torch.bfloat16)

    def seconds(self) -> float:
        t0 = time.perf_counter()
        for tensor in self.state.values():
            self.scratch[: tensor.numel()].view(tensor.shape).copy_(tensor)
        return time.perf_counter() - t0


def raw_socket(state: dict[str, torch.Tensor], workers: Workers, reps: int, n: int = 1) -> list[float]:
    """Seconds to send the state's bytes to `n` subscribers at once, one TCP connection (and
    one sending thread) each, received with `recv_into` straight into their tensors."""
    workers.send(n, "raw", reps + 1)
    socks = []
    for port in workers.recv(n):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        socks.append(sock)

    def send(sock: socket.socket) -> None:
        for tensor in state.values():
            sock.sendall(_bytes(tensor))

    out = []
    for _ in range(reps + 1):
        t0 = time.monotonic()
        threads = [threading.Thread(target=send, args=(sock,)) for sock in socks]
        for thread in threads:
            thread.start()
        done = max(workers.recv(n))
        for thread in threads:
            thread.join()
        out.append(done - t0)
    for sock in socks:
        sock.close()
    return out[1:]


def channel(
    state,
    floor: Floor,
    workers: Workers,
    n: int,
    name: str,
    reps: int,
    version: list[int],
    slots: int,
    sub_kwargs: dict,
    limit: Callable[[], float] | None = None,
) -> dict:  # noqa: ANN001
    """Publish `WARMUP` + `reps` versions to `n` subscribers; per measured version: seconds to the
    last subscriber's apply, seconds after `publish` returned, publish blocking seconds, the
    slowest apply, and a memcpy of the state taken just before (paired, for ratios); with
    `limit`, its seconds measured just before each version too ("limit", paired)."""
    from weight_sync import TorchTransport, WeightPublisher

    transport = TorchTransport(world_size=n + 1) if name == "torch" else name
    out = {k: [] for k in ("seconds", "after_publish", "blocking", "apply", "memcpy")}
    # whole versions: what this measures (deltas are weight_sync_delta.py's)
    with WeightPublisher(None, transport=transport, slots=slots, timeout=300, model=state, delta=False) as pub:
        versions = [version[0] + i for i in range(1, reps + WARMUP + 1)]
        version[0] = versions[-1]
        workers.send(n, "session", name, {}, pub.endpoint, versions, sub_kwargs, False)
        assert workers.recv(n) == ["ready"] * n
        for i, v in enumerate(versions):
            if limit is not None and i >= WARMUP:
                out.setdefault("limit", []).append(limit())
            copy = floor.seconds()
            t0 = time.monotonic()
            pub.publish(state, v)
            returned = time.monotonic()
            done = workers.recv(n)
            if i == 0:
                out["first"] = [max(t for _, t, *_ in done) - t0]
                out["first_blocking"] = [pub.last_publish_seconds]
            if i < WARMUP:
                continue  # the first versions fault each subscriber's receive buffers in
            last = max(t for _, t, *_ in done)
            for key, value in zip(
                out, (last - t0, last - returned, pub.last_publish_seconds, max(a for _, _, a, _ in done), copy)
            ):
                out[key].append(value)
        sums = workers.recv(n)
    expect = float(sum(t.float().sum().item() for t in list(state.values())[:3]))
    assert all(abs(s - expect) <= 1e-3 * max(1.0, abs(expect)) for s in sums), "a subscriber holds other values"
    return out


class Timeline:
    """`--timeline`'s stamps in one process: while open, each of `steps` (owner, function name,
    label, "enter" or "exit", and a test of the call's arguments and result, or None) records
    (label, time.monotonic()) when a call of that function starts or returns and passes the
    test. `take()` hands over the stamps so far."""

    def __init__(self, steps):  # noqa: ANN001 - the tuples above
        self.steps = list(steps)
        self.marks: list[tuple[str, float]] = []
        self._lock = threading.Lock()  # stamps come from several threads; `take` empties the list
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> Timeline:
        for owner, attr, label, at, test in self.steps:
            fn = owner.__dict__[attr]
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._wrap(fn, label, at, test))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, fn in reversed(self._saved):
            setattr(owner, attr, fn)
        self._saved.clear()

    def _wrap(self, fn, label: str, at: str, test):  # noqa: ANN001, ANN202
        def stamp() -> None:
            with self._lock:
                self.marks.append((label, time.monotonic()))

        def stamped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if at == "enter" and (test is None or test(args, None)):
                stamp()
            out = fn(*args, **kwargs)
            if at == "exit" and (test is None or test(args, out)):
                stamp()
            return out

        return stamped

    def take(self) -> list[tuple[str, float]]:
        with self._lock:
            out, self.marks = self.marks, []
        return out


def _steps() -> tuple[list, list]:
    """The steps `--timeline` stamps: (in the publisher's process, in the subscriber's)."""
    from transfer_queue.wire.rpc import Channel, LocalChannel, Pending
    from weight_sync.coordinator import Coordinator
    from weight_sync.protocol import Offer, Release
    from weight_sync.publisher import WeightPublisher
    from weight_sync.ranks import PublisherRanks
    from weight_sync.receivers import MappedReceiver, Targets

    publisher = [
        (WeightPublisher, "_stage", "publisher: packed", "exit", None),
        (Coordinator, "on_staged", "server thread: version complete", "enter", None),
        (Pending, "reply", "server thread: offer sent", "enter", lambda a, _: isinstance(a[1], Offer)),
        (WeightPublisher, "_handle", "server thread: release in", "enter", lambda a, _: isinstance(a[1], Release)),
    ]
    subscriber = [
        (Channel, "reply", "subscriber: offer in", "exit", lambda _, out: isinstance(out[0], Offer)),
        (LocalChannel, "reply", "subscriber: offer in", "exit", lambda _, out: isinstance(out[0], Offer)),
        (PublisherRanks, "lease_all", "subscriber: leased", "exit", None),
        (Targets, "apply", "subscriber: apply starts", "enter", None),
        (Targets, "apply", "subscriber: apply done", "exit", None),
        (MappedReceiver, "_release", "subscriber: released", "exit", None),
    ]
    return publisher, subscriber


def delta_steps() -> tuple[list, list]:
    """The steps the delta benchmark's `--timeline` stamps: (in the publisher's process, in the
    subscriber's). Each frame's encode and apply is stamped, so a version has many of those."""
    from transfer_queue.wire.rpc import Channel, LocalChannel
    from weight_sync.coordinator import Coordinator
    from weight_sync.protocol import Offer
    from weight_sync.publisher import WeightPublisher
    from weight_sync.receivers import Targets
    from weight_sync.transports import stream
    from weight_sync.transports.tcp import TcpTransport

    publisher = [
        (WeightPublisher, "_stage", "publisher: staging issued", "exit", None),
        (WeightPublisher, "_compare", "publisher: a compare job done", "exit", None),
        (stream, "encode_span", "publisher: a frame encoded", "exit", None),
        (Coordinator, "on_staged", "publisher: version complete", "enter", None),
        (WeightPublisher, "_count", "publisher: a stream sent", "enter", None),
    ]
    subscriber = [
        (Channel, "reply", "subscriber: offer in", "exit", lambda _, out: isinstance(out[0], Offer)),
        (LocalChannel, "reply", "subscriber: offer in", "exit", lambda _, out: isinstance(out[0], Offer)),
        (TcpTransport, "receive", "subscriber: pull starts", "enter", None),
        (TcpTransport, "receive", "subscriber: pull ends", "exit", None),
        (stream, "apply", "subscriber: a frame applied", "exit", None),
        (Targets, "apply", "subscriber: poll applies", "enter", None),
        (Targets, "apply", "subscriber: poll applied", "exit", None),
    ]
    return publisher, subscriber


def latency(
    workers: Workers,
    versions: int,
    warmup: int,
    timeline: bool,
    transport: str = "shm",
    size: str = "tiny",
    gap: float = 0.005,
) -> dict:
    """Per-version control latency over a co-located `transport` ("shm", or "cuda_ipc" with the
    weights and the subscriber's tensors on the GPU): the model of `size` (default the tiny one)
    published `warmup` + `versions` times to one subscriber process, each version once the
    subscriber waits again (`gap` s after its last report); ms from `publish`'s start to each
    stamped step (`Timeline`) and to the subscriber's `wait` returning."""
    from weight_sync import WeightPublisher

    device = "cuda" if transport == "cuda_ipc" else "cpu"
    shapes = llama_shapes("tiny", TINY_LAYERS) if size == "tiny" else llama_shapes(size)
    workers.hold(shapes, 1)
    state = {n: torch.randn(s, dtype=torch.float32).to(device, torch.bfloat16) for n, s in shapes.items()}
    first = next(iter(state.values()))
    numbers = list(range(1, warmup + versions + 1))
    per_version: list[dict[str, float]] = []
    with (
        Timeline(_steps()[0] if timeline else ()) as steps,
        WeightPublisher(None, transport=transport, timeout=60, model=state, delta=False) as pub,  # whole versions
    ):
        workers.send(1, "latency", pub.endpoint, numbers, timeline, transport, device)
        assert workers.recv(1) == ["ready"]
        starts = []
        for version in numbers:
            time.sleep(gap)  # the subscriber asks again and waits
            first.fill_(version)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.monotonic()
            pub.publish(state, version)
            returned = time.monotonic()
            ((got, done, theirs),) = workers.recv(1)
            assert got == version
            starts.append(t0)
            row = {"publish returns": returned - t0, "subscriber: wait returns": done - t0}
            per_version.append(row | {label: t - t0 for label, t in theirs if label not in row})
        (held,) = workers.recv(1)
        ends = [*starts[1:], float("inf")]
        for row, t0, end in zip(per_version, starts, ends):
            for label, t in steps.marks:
                if t0 <= t < end and (label not in row or label.endswith("release in")):
                    row[label] = t - t0  # the first of each step, the last release
    assert held == first.float().mean().item(), f"the subscriber holds {held}, not version {numbers[-1]}"
    measured = per_version[warmup:]
    labels = sorted({k for row in measured for k in row}, key=lambda k: median(r[k] for r in measured if k in r))
    return {
        "transport": transport,
        "tensors": len(shapes),
        "bytes": sum(t.numel() * 2 for t in state.values()),
        "versions": versions,
        "steps": {label: [r[label] * 1e3 for r in measured if label in r] for label in labels},
    }


def print_latency(record: dict) -> str:
    rows = [[label, median(ms), percentile(ms, 90), len(ms)] for label, ms in record["steps"].items()]
    return print_table(
        f"weight sync control latency: {record['tensors']} tensors ({record['bytes']:,} bytes) over {record['transport']} to 1 "
        f"subscriber process, {record['versions']} versions; ms from publish's start",
        ["step", "median ms", "p90 ms", "versions"],
        rows,
    )


def torch_save_load(state, workers: Workers, n: int, reps: int, use_mmap: bool) -> list[tuple[float, float]]:
    """(seconds to the last subscriber, save seconds): torch.save to /dev/shm, load, copy in."""
    path = f"/dev/shm/sluice-bench-{os.getpid()}.pt"
    out = []
    try:
        for _ in range(reps + 1):
            t0 = time.monotonic()
            torch.save(state, path)
            saved = time.monotonic() - t0
            workers.send(n, "torch_load", path, use_mmap)
            out.append((max(workers.recv(n)) - t0, saved))
            os.unlink(path)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return out[1:]


def ray_put_get(state, shapes, n: int, reps: int, nbytes: int) -> list[tuple[float, float]]:
    """(seconds to the last subscriber, put seconds): `ray.put` of the state dict, then
    `ray.get` and copy into the model in `n` subscriber actors."""
    import ray

    ray.init(
        object_store_memory=int(nbytes * 1.5) + (256 << 20),
        logging_level="ERROR",
        log_to_driver=False,
        include_dashboard=False,
    )
    try:

        @ray.remote
        class Rollout:
            def __init__(self, shapes):  # noqa: ANN001
                torch.set_num_threads(1)
                self.targets = _zeros(shapes)

            def load(self, refs) -> float:  # noqa: ANN001
                state = ray.get(refs[0])
                for name, tensor in state.items():
                    self.targets[name].copy_(tensor)
                return time.monotonic()

        actors = [Rollout.remote(shapes) for _ in range(n)]
        ray.get([a.load.remote([ray.put({})]) for a in actors])  # started and warm
        out = []
        for _ in range(reps + 1):
            t0 = time.monotonic()
            ref = ray.put(state)
            put = time.monotonic() - t0
            done = ray.get([a.load.remote([ref]) for a in actors])
            out.append((max(done) - t0, put))
            del ref
        return out[1:]
    finally:
        ray.shutdown()


def _ucx_available() -> bool:
    from weight_sync import UcxTransport

    return UcxTransport.is_available()


def _nixl_available() -> bool:
    from weight_sync import NixlTransport

    return NixlTransport.is_available()


def _ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None


def run_size(
    size: str, workers: Workers, reps: int, version: list[int], baselines: bool, transports: set[str] | None
) -> dict:
    """Every measurement for one state-dict size. Above 2 GiB only what fits in 24 GiB beside
    the trainer's copy runs: shm to 1 and 2 subscribers, tcp to 1, and the mmap'd
    torch.save/load to 1 (one staging slot; a model only in the processes that take part)."""
    shapes = llama_shapes(size)
    state = {n: torch.randn(s, dtype=torch.float32).to(torch.bfloat16) for n, s in shapes.items()}
    nbytes = sum(t.numel() * 2 for t in state.values())
    big = nbytes > 2 * GIB
    slots = 1 if big else 2
    workers.hold(shapes, 1 if big else 2)
    floor = Floor(state)
    res: dict[str, dict] = {"memcpy": {"seconds": [floor.seconds() for _ in range(reps)]}}
    res["raw_socket"] = {"seconds": raw_socket(state, workers, reps)}
    if big:
        configs = [("shm", {}, 1), ("shm", {}, 2), ("tcp", {}, 1)]
    else:
        configs = [("shm", {}, 1), ("shm", {}, 2), ("tcp", {}, 1), ("tcp", {}, 2), ("tcp", {"pipelined": False}, 1)]
        configs += [("ucx", {}, 1), ("ucx", {}, 2)] if _ucx_available() else []
        configs += [("nixl", {}, 1), ("nixl", {}, 2)] if _nixl_available() else []
        configs += [("torch", {}, 1), ("torch", {}, 2)]
    configs = [c for c in configs if transports is None or c[0] in transports]
    for name, sub_kwargs, n in configs:
        workers.hold(shapes, n if big else 2)
        raw = raw_socket(state, workers, 1, n)[0]  # the limit, right before this configuration
        label = f"{name}{'' if sub_kwargs.get('pipelined', True) else ' unpipelined'} x{n}"
        # UCX's own test over the same UCX transports, right before each version (paired)
        limit = partial(ucx_limit, nbytes, ucx_tls(), n) if name == "ucx" and perftest_binary() is not None else None
        res[label] = channel(state, floor, workers, n, name, reps, version, slots, sub_kwargs, limit)
        res[label]["raw_socket"] = raw
        gc.collect()
    if baselines:
        for n in (1,) if big else (1, 2):  # at 4 GiB a second model beside the file does not fit
            workers.hold(shapes, n if big else 2)
            for use_mmap in [True] if big else [False, True]:  # plain loads need 2 more copies in RAM
                rows = torch_save_load(state, workers, n, reps, use_mmap)
                label = "torch.save/load" + (" mmap" if use_mmap else "")
                res[f"{label} x{n}"] = {"seconds": [r[0] for r in rows], "blocking": [r[1] for r in rows]}
            if _ray_available() and not big:  # Ray's store plus two more models: > 24 GiB at 4 GiB
                rows = ray_put_get(state, shapes, n, reps, nbytes)
                res[f"ray put/get x{n}"] = {"seconds": [r[0] for r in rows], "blocking": [r[1] for r in rows]}
    del state, floor
    workers.hold({}, 0)
    gc.collect()
    return {"bytes": nbytes, "tensors": len(shapes), "results": res}


def ucx_tls() -> str:
    """The UCX transports the `ucx` rows and their `ucx_perftest` limit run over (main sets
    `UCX_TLS` before the subscriber processes start, so every process uses the same)."""
    return os.environ["UCX_TLS"]


def summarize_ucx(size: str, record: dict) -> list[list]:
    """Table rows: the `ucx` transport's GB/s into each subscriber next to `ucx_perftest`'s
    over the same UCX transports with as many sender/receiver pairs at once, measured right
    before each version, and the median of their paired ratios."""
    rows = []
    for label, f in record["results"].items():
        if "limit" in f:
            f["ucx_perftest_gbps"] = gbps(record["bytes"], median(f["limit"]))
            f["over_ucx_perftest"] = median(p / s for p, s in zip(f["limit"], f["seconds"]))
            rows.append([size, label, ucx_tls(), f["gbps_each"], f["ucx_perftest_gbps"], f["over_ucx_perftest"]])
    return rows


def summarize(size: str, record: dict) -> list[list]:
    """Table rows: medians, GB/s into each subscriber, and ratios against the same run's
    limits (paired with each version or configuration where they were measured alongside)."""
    res, nbytes = record["results"], record["bytes"]
    memcpy = median(res["memcpy"]["seconds"])
    raw = median(res["raw_socket"]["seconds"])
    nan = float("nan")
    rows = []
    for label, f in res.items():
        n = 2 if label.endswith("x2") else 1
        seconds = median(f["seconds"])
        blocking = median(f["blocking"]) if "blocking" in f else nan
        paired = (
            [b / m for b, m in zip(f["blocking"], f["memcpy"])]
            if "memcpy" in f
            else [blocking / memcpy]
            if "blocking" in f
            else []
        )
        baseline = res.get(f"torch.save/load x{n}", res.get(f"torch.save/load mmap x{n}"))
        f.update(
            median_seconds=seconds,
            gbps_each=gbps(nbytes, seconds),
            gbps_each_after_publish=gbps(nbytes, median(f["after_publish"])) if "after_publish" in f else nan,
            blocking_over_memcpy=median(paired),
            raw_socket_over_seconds=f.get("raw_socket", raw) / seconds,
            save_load_over_seconds=median(baseline["seconds"]) / seconds if baseline else nan,
            first_over_seconds=f["first"][0] / seconds if "first" in f else nan,
            first_blocking_over_blocking=f["first_blocking"][0] / blocking if "first" in f else nan,
        )
        rows.append(
            [
                size,
                label,
                seconds,
                f["gbps_each"],
                f["gbps_each_after_publish"],
                blocking,
                f["blocking_over_memcpy"],
                f["raw_socket_over_seconds"],
                f["save_load_over_seconds"],
                f["first_over_seconds"],
                f["first_blocking_over_blocking"],
            ]
        )
    return rows


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB only, 3 repeats")
    parser.add_argument("--sizes", default=None, help="comma-separated of 256MiB,1GiB,4GiB (default 1GiB)")
    parser.add_argument(
        "--reps", type=int, default=None, help="measured versions per configuration (default 5, quick 3)"
    )
    parser.add_argument("--no-baselines", action="store_true", help="skip torch.save/load and Ray")
    parser.add_argument("--transports", default=None, help="comma-separated transports to run (default all)")
    parser.add_argument(
        "--latency", action="store_true", help="per-version control latency over shm (or cuda_ipc), tiny model"
    )
    parser.add_argument("--versions", type=int, default=500, help="--latency: measured versions (default 500)")
    parser.add_argument("--timeline", action="store_true", help="--latency: stamp each step in both processes")
    args = parser.parse_args()
    if args.latency:
        run_latency(args.versions, args.timeline, (args.transports or "shm").split(",")[0], args.sizes or "tiny")
        return
    transports = set(args.transports.split(",")) if args.transports else None
    from weight_sync.transports.ucx import DEFAULT_TLS

    os.environ.setdefault("UCX_TLS", DEFAULT_TLS)  # before the subscriber processes start
    torch.set_num_threads(1)  # the trainer's copies run on one core, like the services'
    sizes = (args.sizes or ("256MiB" if args.quick else "1GiB")).split(",")
    reps = args.reps or (3 if args.quick else 5)
    workers = Workers(2)
    version = [0]
    records = {}
    rows: list[list] = []
    ucx_rows: list[list] = []
    start = time.monotonic()
    header = [
        "size",
        "what",
        "s",
        "GB/s each",
        "after publish",
        "blocks s",
        "block/memcpy",
        "raw sock/s",
        "save+load/s",
        "first/s",
        "first blocks/blocks",
    ]
    title = f"weight sync: medians of {reps} versions; ratios against limits measured in this run"
    try:
        for size in sizes:
            records[size] = run_size(size, workers, reps, version, not args.no_baselines, transports)
            size_rows = summarize(size, records[size])
            print_table(f"{title} ({size})", header, size_rows)
            rows += size_rows
            if ucx := summarize_ucx(size, records[size]):
                print_table(
                    f"ucx transport vs ucx_perftest (tag_bw, faster of polling and sleeping, error handling on) in this run ({size})",
                    UCX_HEADER,
                    ucx,
                )
                ucx_rows += ucx
    finally:
        workers.close()
        if rows:
            table = print_table(title, header, rows)
            if ucx_rows:
                table += "\n" + print_table("ucx transport vs ucx_perftest", UCX_HEADER, ucx_rows)
            path = write_record(
                "weight_sync",
                {"sizes": records, "reps": reps, "table": table, "wall_seconds": time.monotonic() - start},
            )
            print(f"wrote {path} ({time.monotonic() - start:.0f} s)")


def run_latency(versions: int, timeline: bool, transport: str, size: str) -> None:
    torch.set_num_threads(1)
    workers = Workers(1)
    try:
        record = latency(workers, versions, warmup=20, timeline=timeline, transport=transport, size=size.split(",")[0])
    finally:
        workers.close()
    table = print_latency(record)
    print(f"wrote {write_record('weight_sync_latency', {**record, 'table': table})}")


if __name__ == "__main__":
    main()
