"""Process entry points for the weight-sync tests: subscribers and publishers in their own
processes (spawned), reporting to the test through a queue. Weights are deterministic per
version, so every process can compute what it must hold and compare exactly."""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable

import torch

import weight_sync  # noqa: F401 - preloaded by the forkserver

SHAPES = {
    "model.embed_tokens.weight": (512, 96),
    "model.layers.0.self_attn.q_proj.weight": (96, 96),
    "model.layers.0.self_attn.k_proj.weight": (32, 96),
    "model.layers.0.self_attn.v_proj.weight": (32, 96),
    "model.layers.0.self_attn.o_proj.weight": (96, 96),
    "model.layers.0.mlp.gate_proj.weight": (256, 96),
    "model.layers.0.mlp.up_proj.weight": (256, 96),
    "model.layers.0.mlp.down_proj.weight": (96, 256),
    "model.layers.0.input_layernorm.weight": (96,),
    "model.norm.weight": (96,),
    "lm_head.weight": (512, 96),
}
"""A tiny Llama: ~0.5 MB in bf16, several 64 KiB buckets, one tensor split over buckets."""

BUCKET = 64 << 10


def weights(version: int, dtype: torch.dtype = torch.bfloat16, shapes: dict = SHAPES) -> dict[str, torch.Tensor]:
    """The (global) weights of `version`: the same in every process."""
    gen = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=gen).to(dtype) for name, shape in shapes.items()}


def sparse_weights(version: int, shapes: dict = SHAPES) -> dict[str, torch.Tensor]:
    """Weights whose consecutive versions differ in ~2% of the elements (like RL steps at a
    small learning rate), the same in every process: version 0's, changed version by version."""
    out = weights(0, shapes=shapes)
    for step in range(1, version + 1):
        gen = torch.Generator().manual_seed(1000 + step)
        for tensor in out.values():
            flat = tensor.view(-1)
            index = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=gen)
            flat[index] = torch.randn(index.numel(), generator=gen).to(tensor.dtype)
    return out


def zeros(shapes: dict = SHAPES) -> dict[str, torch.Tensor]:
    """Zeroed bf16 tensors of `shapes` (a subscriber's targets before any version)."""
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}


def transport_of(spec: str | tuple | list):
    """A transport from a picklable spec: a name, (name, kwargs), or a list of those."""
    from weight_sync.transports import get

    if isinstance(spec, str):
        return spec
    if isinstance(spec, list):
        return [transport_of(item) for item in spec]
    name, kwargs = spec
    return get(name)(**kwargs)


def subscriber(out, stop, sub_id: int, address, endpoint, transport, kwargs: dict) -> None:
    """Poll until `stop` is set; after every apply check that every tensor holds exactly the
    applied version. Reports each applied version, errors, and a final summary."""
    torch.set_num_threads(1)
    from weight_sync import WeightSubscriber

    tp = kwargs.pop("tp", None)
    shapes = kwargs.pop("shapes", SHAPES)
    version_of = sparse_weights if kwargs.pop("sparse", False) else weights
    mine = zeros(shapes)
    if tp is not None:
        from weight_sync import LLAMA, TPShard

        kwargs["shard"] = TPShard(tp[0], tp[1])
        kwargs["mapping"] = LLAMA
        mine = local_targets(tp[0], tp[1])
    device = kwargs.pop("device", "cpu")  # where the targets live ("cuda": GPU tensors)
    mine = {name: t.to(device) for name, t in mine.items()}
    ptrs = {name: t.data_ptr() for name, t in mine.items()}
    summary = {"id": sub_id, "applied": [], "errors": [], "mixed": False, "moved": False}
    try:
        sub = WeightSubscriber(address, mine, transport=transport_of(transport), publisher=endpoint, **kwargs)
        while not stop.is_set():
            try:
                version = sub.poll()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                summary["errors"].append(f"{type(exc).__name__}: {exc}")
                out.put(("error", sub_id, type(exc).__name__))
                time.sleep(0.05)
                continue
            if version is None:
                time.sleep(0.002)
                continue
            expected = local_targets(tp[0], tp[1], version) if tp is not None else version_of(version, shapes=shapes)
            if not all(torch.equal(mine[n].cpu(), expected[n]) for n in mine):
                summary["mixed"] = True
            if any(mine[n].data_ptr() != ptrs[n] for n in mine):
                summary["moved"] = True
            summary["applied"].append(version)
            out.put(("applied", sub_id, version))
        summary["transport"] = sub._ranks.transport.name if sub._ranks is not None else ""
        summary["sources"] = list(sub.last_sources)
        summary["received"] = list(sub.last_received)
        sub.close()
        summary["final"] = sub.version
        final = local_targets(tp[0], tp[1], sub.version) if tp is not None else version_of(sub.version, shapes=shapes)
        summary["exact"] = sub.version < 0 or all(torch.equal(mine[n].cpu(), final[n]) for n in mine)
    except Exception:  # noqa: BLE001
        summary["errors"].append(traceback.format_exc())
    out.put(("done", sub_id, summary))


def local_targets(
    rank: int, size: int, version: int | None = None, version_of: Callable[[int], dict[str, torch.Tensor]] = weights
) -> dict[str, torch.Tensor]:
    """What a vLLM-style TP rank holds (fused qkv and gate_up), zeros or `version`'s values
    (`version_of(version)`: `weights`, or `sparse_weights`)."""
    from weight_sync import LLAMA_TP_DIMS, TPShard
    from weight_sync.layout import Layout

    full = version_of(version if version is not None else 0)
    shard = TPShard(rank, size, LLAMA_TP_DIMS)

    def part(name: str) -> torch.Tensor:
        layout = (
            Layout.tp(full[name].shape, shard.dim(name), rank, size)
            if shard.dim(name) >= 0
            else Layout.full(full[name].shape)
        )
        (lo, hi) = layout.box
        return full[name][tuple(slice(a, b) for a, b in zip(lo, hi))]

    out = {}
    for name in full:
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [part(name), part(name.replace("q_proj", "k_proj")), part(name.replace("q_proj", "v_proj"))]
            )
        elif ".gate_proj." in name:
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                [part(name), part(name.replace("gate_proj", "up_proj"))]
            )
        else:
            out[name] = part(name)
    out = {n: t.clone() for n, t in out.items()}
    if version is None:
        for t in out.values():
            t.zero_()
    return out


def publisher(out, commands, address, transport, kwargs: dict) -> None:
    """Serve as a publisher; `commands` brings ("publish", version[, stall]) and ("close",).

    With stall, staging stops after the first bucket and never finishes (a trainer that
    hangs or dies mid-publish: the test then kills this process).
    """
    torch.set_num_threads(1)
    import weight_sync.publisher as publisher_module
    from weight_sync import TPShard, WeightPublisher

    tp = kwargs.pop("tp", None)
    version_of = sparse_weights if kwargs.pop("sparse", False) else weights
    if tp is not None:
        kwargs["shard"] = TPShard(tp[0], tp[1])
    pub = WeightPublisher(address, transport=transport_of(transport), **kwargs)
    out.put(("endpoint", pub.endpoint))
    real_pack = publisher_module.pack

    def stalling_pack(manifest, tensors, slot, progress, destinations=None):  # noqa: ANN001
        def stall(nbytes: int) -> None:
            progress(nbytes)
            out.put(("stalled", nbytes))
            while True:
                time.sleep(1)

        real_pack(manifest, tensors, slot, stall, destinations)

    while True:
        try:
            command = commands.get(timeout=60)
        except queue.Empty:
            break
        if command[0] == "close":
            break
        version = command[1]
        full = version_of(version)
        state = full if tp is None else {n: t for n, t in tp_slices(full, tp[0], tp[1]).items()}
        if len(command) > 2 and command[2]:
            publisher_module.pack = stalling_pack
        pub.publish(state, version)
        out.put(("published", version))
    pub.close()
    out.put(("closed",))


def tp_slices(full: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """A Megatron-style trainer rank's TP shards of `full` (HF names, unfused)."""
    from weight_sync import LLAMA_TP_DIMS, TPShard

    shard = TPShard(rank, size, LLAMA_TP_DIMS)
    out = {}
    for name, tensor in full.items():
        dim = shard.dim(name)
        out[name] = tensor.chunk(size, dim)[rank].clone() if 0 <= dim < tensor.dim() else tensor
    return out


def kill(process) -> None:  # noqa: ANN001
    """SIGKILL a worker (no cleanup runs in it)."""
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)


def nccl_subscriber(out, gpu: int, endpoint: str, versions: int) -> None:
    """On GPU `gpu`: take `versions` versions broadcast over NCCL into GPU tensors; reports
    ("exact", gpu, whether each version arrived exact)."""
    torch.cuda.set_device(gpu)
    from weight_sync import TorchTransport, WeightSubscriber

    mine = {name: t.cuda() for name, t in zeros().items()}
    exact = []
    with WeightSubscriber(None, mine, transport=TorchTransport(backend="nccl"), publisher=endpoint) as sub:
        for version in range(1, versions + 1):
            sub.wait(version, timeout=60)
            exact.append(all(torch.equal(mine[n].cpu(), t) for n, t in weights(sub.version).items()))
    out.put(("exact", gpu, exact))


def waiting_reader(out, endpoint: str, die_before_offer: bool) -> None:
    """A subscriber that asks rank 0 for its next version with a lease (as a "map" receiver
    does) and exits without releasing anything: at once, while its `Latest` is parked
    (`die_before_offer`), or once the offer came, reporting the lease it carried. `endpoint`:
    rank 0's control endpoint, or its local lane (`RankInfo.local`)."""
    from weight_sync.protocol import Latest, LocalClient, RpcClient

    client = LocalClient(endpoint, timeout=60.0) if endpoint.startswith("local:") else RpcClient(endpoint, timeout=60.0)
    if die_before_offer:
        client.send(Latest(after=-1, timeout=60.0, lease="shm"))
        out.put("asked")
        client.ready(wait=60.0)  # never comes: the test kills this process first
        return
    offer = client.call(Latest(after=-1, timeout=60.0, lease="shm"), timeout=90.0)
    out.put(None if offer.granted is None else (offer.version, offer.granted.lease))
    out.close()
    out.join_thread()  # the report is sent; nothing else is
    os._exit(0)  # dies holding the lease: no Release, no orderly close
