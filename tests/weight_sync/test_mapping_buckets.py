"""Name mapping (rename, fuse q/k/v and gate/up, split them back), bucket layout and packing,
the transport registry and stream chunking, and the package's public face."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import weight_sync
from transfer_queue.wire.errors import SchemaError
from weight_sync import LLAMA, Layout, NameMapping, TPShard
from weight_sync.buckets import ALIGN, layout_buckets, pack
from weight_sync.plan import Read, build_plan
from weight_sync.transports import Transport, names, register, resolve
from weight_sync.transports.stream import IN_FLIGHT, Scratch, gather, read_chunks

from .workers import local_targets, weights


def _apply(
    full: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], shard: TPShard, mapping: NameMapping
) -> None:
    """Stage `full` whole on one rank and apply the plan into `targets` (no transport)."""
    manifest = layout_buckets([(n, t.dtype, Layout.full(t.shape)) for n, t in full.items()], 4096)
    slot = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    pack(manifest, list(full.values()), slot, lambda n: None)
    bindings = mapping.bind({n: t.shape for n, t in full.items()}, targets, shard)
    for copy in build_plan([manifest], bindings).copies:
        copy.dst.copy_(copy.read.view(slot, copy.dtype))


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_fuses_qkv_and_gate_up_per_tp_rank(tp):
    """HF-named trainer weights land in vLLM-style fused, TP-split tensors."""
    for rank in range(tp):
        mine = local_targets(rank, tp)
        assert "model.layers.0.self_attn.qkv_proj.weight" in mine
        _apply(weights(5), mine, TPShard(rank, tp), LLAMA)
        expected = local_targets(rank, tp, 5)
        for name in mine:
            assert torch.equal(mine[name], expected[name]), name


def test_llama_splits_fused_trainer_tensors():
    """A trainer that holds fused tensors feeds a subscriber that holds them separately."""
    full = weights(3)
    fused = {}
    for name, tensor in full.items():
        if ".q_proj." in name:
            fused[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [tensor, full[name.replace("q_proj", "k_proj")], full[name.replace("q_proj", "v_proj")]]
            )
        elif ".gate_proj." in name:
            fused[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [tensor, full[name.replace("gate_proj", "up_proj")]]
            )
        elif not any(p in name for p in (".k_proj.", ".v_proj.", ".up_proj.")):
            fused[name] = tensor
    for rank in range(2):
        shard = TPShard(rank, 2)
        mine = {}
        for name, tensor in full.items():
            lo, hi = shard.box(name, tensor.shape)
            mine[name] = torch.zeros(tuple(h - l for l, h in zip(lo, hi)), dtype=tensor.dtype)
        _apply(fused, mine, shard, LLAMA)
        for name, tensor in full.items():
            lo, hi = shard.box(name, tensor.shape)
            assert torch.equal(mine[name], tensor[tuple(slice(a, b) for a, b in zip(lo, hi))]), name


def test_rename_strips_wrappers_and_errors_name_the_tensor():
    full = {"module._orig_mod.w": torch.ones(4, 2)}
    mine = {"w": torch.zeros(4, 2)}
    _apply(full, mine, TPShard(), NameMapping())
    assert torch.equal(mine["w"], torch.ones(4, 2))
    with pytest.raises(SchemaError, match="'x'"):
        NameMapping().bind({"w": (4, 2)}, {"x": torch.zeros(4, 2)}, TPShard())
    with pytest.raises(SchemaError, match="w: local part"):
        NameMapping().bind({"w": (4, 2)}, {"w": torch.zeros(3, 2)}, TPShard())


def test_dtype_mismatch_needs_a_declared_cast():
    manifest = layout_buckets([("w", torch.float32, Layout.full((4,)))], 4096)
    bindings = NameMapping().bind({"w": (4,)}, {"w": torch.zeros(4, dtype=torch.bfloat16)}, TPShard())
    with pytest.raises(SchemaError, match="declare a cast"):
        build_plan([manifest], bindings)


def test_buckets_align_split_and_never_straddle():
    specs = [
        ("a", torch.float32, Layout.full((10,))),
        ("b", torch.float32, Layout.full((200,))),
        ("c", torch.bfloat16, Layout.full((100,))),
        ("big", torch.float32, Layout.full((700,))),
    ]
    manifest = layout_buckets(specs, 1024)
    starts = {e.name: manifest.start(e) for e in manifest.entries}
    assert all(s % ALIGN == 0 for s in starts.values())
    assert starts["b"] // 1024 == (starts["b"] + 799) // 1024
    assert starts["c"] == 1024  # 200 bytes would straddle bucket 0's end: c starts bucket 1
    big = next(e for e in manifest.entries if e.name == "big")
    assert big.nbytes > 1024 and manifest.start(big) + big.nbytes <= manifest.nbytes  # split over buckets
    assert len({e.bucket for e in manifest.entries}) >= 2


def test_pack_casts_and_reports_each_bucket():
    tensors = [torch.randn(300), torch.randn(40, 30).t()]  # the second is not contiguous
    specs = [(f"t{i}", torch.bfloat16, Layout.full(t.shape)) for i, t in enumerate(tensors)]
    manifest = layout_buckets(specs, 256)
    slot = torch.zeros(manifest.nbytes, dtype=torch.uint8)
    seen: list[int] = []
    pack(manifest, tensors, slot, seen.append)
    assert seen == sorted(seen) and seen[-1] == manifest.nbytes
    assert seen[:2] == [256, 512]  # the contiguous tensor reports each bucket boundary it passes
    for entry, tensor in zip(manifest.entries, tensors):
        start = manifest.start(entry)
        got = slot[start : start + entry.nbytes].view(torch.bfloat16).view(tensor.shape)
        assert torch.equal(got, tensor.to(torch.bfloat16))


def test_registry_refuses_duplicates_and_auto_prefers_shared_memory():
    assert {"shm", "tcp", "torch", "ucx"} <= set(names())

    class Dup(Transport):
        name = "tcp"
        mode = "reads"

        def receive(self, job):  # noqa: ANN001, ANN201
            raise NotImplementedError

    with pytest.raises(ValueError, match="already registered"):
        register(Dup)
    auto = [t.name for t in resolve("auto")]
    assert auto[0] == "shm" and "tcp" in auto
    with pytest.raises(ValueError, match="unknown transport"):
        resolve("carrier-pigeon")


@given(st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple), st.data())
def test_read_chunks_concatenate_to_the_box(shape, data):
    lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    hi = tuple(data.draw(st.integers(l + 1, n)) for l, n in zip(lo, shape))
    read = Read(0, shape, lo, hi, 4)
    import weight_sync.transports.stream as stream

    limit = stream.GATHER_BYTES
    stream.GATHER_BYTES = data.draw(st.integers(4, 64))
    try:
        chunks = read_chunks(read)
    finally:
        stream.GATHER_BYTES = limit
    flat = torch.arange(torch.Size(shape).numel()).view(shape)
    box = flat[tuple(slice(a, b) for a, b in zip(lo, hi))].reshape(-1)
    got = torch.cat([flat[tuple(slice(a, b) for a, b in zip(clo, chi))].reshape(-1) for clo, chi in chunks])
    assert torch.equal(got, box)


def test_gathered_views_stay_valid_while_the_next_are_taken():
    """Strided boxes are gathered into the stream's scratch; each one's bytes hold while
    `IN_FLIGHT - 1` more are gathered (the ucx transport keeps that many sends in flight)."""
    full = torch.arange(4 * IN_FLIGHT, dtype=torch.int16).view(4, IN_FLIGHT)
    read = Read(0, tuple(full.shape), (0, 0), tuple(full.shape), 2)
    scratch = Scratch()
    views = [gather(full.view(-1).view(torch.uint8), read, ((0, k), (4, k + 1)), scratch) for k in range(IN_FLIGHT)]
    for k, view in enumerate(views):  # one column each, none overwritten by the next
        assert torch.equal(torch.frombuffer(view, dtype=torch.int16), full[:, k])


def test_public_face_is_documented():
    assert {"WeightPublisher", "WeightSubscriber"} <= set(weight_sync.__all__)
    missing = []
    for name in weight_sync.__all__:
        obj = getattr(weight_sync, name)
        if callable(obj) and not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if (
                    not attr.startswith("_") and callable(member) and not inspect.getdoc(getattr(obj, attr))
                ):  # inherited docs count
                    missing.append(f"{name}.{attr}")
    assert not missing, missing
    for method in ("publish", "close"):
        assert callable(getattr(weight_sync.WeightPublisher, method))
    for method in ("poll", "wait", "close"):
        assert callable(getattr(weight_sync.WeightSubscriber, method))
