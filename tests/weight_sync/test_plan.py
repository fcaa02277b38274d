"""Reshard planning on the CPU, from metadata alone: for many trainer layouts (TP along any
dim, FSDP flat shards, TP then flat, replicas) and inference layouts (TP ranks), every target
element is written exactly once and only needed bytes are read; then the same plans move real
bytes (staged by `pack`, applied as a "map" subscriber applies: `coalesce` and `Targets.apply`)
and reproduce the global tensors, with as few copies as the memory on both sides allows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer_queue.wire.errors import SchemaError
from weight_sync.buckets import layout_buckets, pack
from weight_sync.layout import Layout, flat_boxes, intersect, numel, subtract
from weight_sync.mapping import LLAMA, Binding, TPShard
from weight_sync.plan import build_plan, plan_tensor
from weight_sync.receivers import Targets, coalesce

shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


def _count(shape, boxes) -> torch.Tensor:
    hits = torch.zeros(shape, dtype=torch.int32)
    for lo, hi in boxes:
        hits[tuple(slice(a, b) for a, b in zip(lo, hi))] += 1
    return hits


@given(shapes, st.data())
def test_flat_boxes_tile_the_range_in_order(shape, data):
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    boxes = flat_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1 or not boxes
    flat = torch.arange(total).view(shape)
    got = (
        torch.cat([flat[tuple(slice(a, b) for a, b in zip(lo, hi))].reshape(-1) for lo, hi in boxes])
        if boxes
        else torch.empty(0, dtype=torch.long)
    )
    assert torch.equal(got, torch.arange(start, stop))


@given(shapes, st.data())
def test_subtract_and_intersect_partition_a_box(shape, data):
    def box():
        lo = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
        return lo, tuple(data.draw(st.integers(l + 1, n)) for l, n in zip(lo, shape))

    a, b = box(), box()
    parts = subtract(a, b) + ([intersect(a, b)] if intersect(a, b) else [])
    hits = _count(shape, parts)
    assert torch.equal(hits, _count(shape, [a]))  # disjoint, and exactly `a`
    assert sum(numel(*p) for p in parts) == numel(*a)


def _trainer_layouts(shape, kind: str, size: int) -> list[Layout]:
    """Layouts of `size` trainer ranks (some may hold nothing, like FSDP's padded tails); a
    fused tensor's parts are q, k, v with GQA-like sizes (some empty in small shapes)."""
    parts = (shape[0] - 2 * (shape[0] // 3), shape[0] // 3, shape[0] // 3)
    if kind == "fused":
        return [Layout.tp(shape, 0, r, size, parts) for r in range(size)]
    if kind == "fused_fsdp":  # 2-way TP split part by part, each shard flat-split over size // 2 ranks
        half = max(size // 2, 1)
        return [Layout.tp(shape, 0, r // half, 2, parts).flat_shard(r % half, half) for r in range(2 * half)]
    if kind == "replica":
        return [Layout.full(shape) for _ in range(size)]
    if kind == "fsdp":
        return [Layout.full(shape).flat_shard(r, size) for r in range(size)]
    dim = len(shape) - 1 if kind == "tp_last" else 0
    tp = [Layout.tp(shape, dim, r, size) for r in range(size)]
    if kind == "tp_fsdp":  # 2-way TP, each TP shard flat-split over size // 2 ranks
        half = max(size // 2, 1)
        return [Layout.tp(shape, 0, r // half, 2).flat_shard(r % half, half) for r in range(2 * half)]
    return tp


@settings(max_examples=150, deadline=None)
@given(
    shapes,
    st.sampled_from(["replica", "fsdp", "tp_first", "tp_last", "tp_fsdp", "fused", "fused_fsdp"]),
    st.integers(1, 4),
    st.integers(1, 4),
    st.data(),
)
def test_every_target_element_is_written_exactly_once(shape, kind, train_size, infer_size, data):
    layouts = _trainer_layouts(shape, kind, train_size)
    sources = [layout.pieces() for layout in layouts]
    dim = data.draw(st.integers(-1, len(shape) - 1))
    for rank in range(infer_size):
        target = (Layout.tp(shape, dim, rank, infer_size) if dim >= 0 else Layout.full(shape)).box
        planned = plan_tensor(sources, target, first=rank)
        hits = _count(shape, [box for _, _, box in planned])
        assert torch.equal(hits, _count(shape, [target])), "an element was missed, written twice, or not needed"
        for r, piece, box in planned:  # each read lies inside what its rank holds
            assert piece in sources[r] and intersect(box, piece.box) == box


def test_a_fused_tp_shard_is_a_slice_of_each_part():
    """vLLM's [q_1; k_1; v_1] of [q; k; v] (8, 4, 4 rows) at TP 2: three runs of the local tensor."""
    layout = Layout.tp((16, 6), 0, 1, 2, parts=(8, 4, 4))
    assert layout.local_shape == (8, 6)
    assert [(p.lo[0], p.hi[0], p.offset) for p in layout.pieces()] == [(4, 8, 0), (10, 12, 24), (14, 16, 36)]
    with pytest.raises(SchemaError, match="do not add up"):
        Layout.tp((16, 6), 0, 1, 2, parts=(8, 4))


def test_replicas_spread_reads_over_ranks():
    sources = [Layout.full((8, 4)).pieces() for _ in range(4)]
    ranks = [plan_tensor(sources, ((0, 0), (8, 4)), first=i)[0][0] for i in range(4)]
    assert sorted(ranks) == [0, 1, 2, 3]


def test_missing_elements_are_a_schema_error():
    with pytest.raises(SchemaError):
        plan_tensor([Layout.tp((8, 4), 0, 0, 2).pieces()], ((0, 0), (8, 4)))


def _stage(full: dict[str, torch.Tensor], layouts: dict[str, Layout], rank: int, size: int, bucket: int = 256):
    """Stage a trainer rank's local tensors: the manifest and the slot bytes."""
    local = {}
    for name, layout in layouts.items():
        boxes = [full[name][tuple(slice(a, b) for a, b in zip(lo, hi))] for lo, hi in layout.boxes]
        part = torch.cat(boxes, max(layout.dim, 0)).contiguous()
        local[name] = part.reshape(-1)[layout.flat_start : layout.flat_stop] if layout.flat_stop >= 0 else part
    manifest = layout_buckets([(n, t.dtype, layouts[n]) for n, t in local.items()], bucket, rank, size)
    slot = torch.zeros(max(manifest.nbytes, 1), dtype=torch.uint8)
    pack(manifest, list(local.values()), slot, lambda n: None)
    return manifest, slot


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["replica", "fsdp", "tp_first", "tp_last", "tp_fsdp", "fused", "fused_fsdp"]),
    st.integers(1, 3),
    st.integers(1, 3),
    st.data(),
)
def test_plans_move_real_bytes_exactly(kind, train_size, infer_size, data):
    full = {
        "w": torch.randn(6, 10, dtype=torch.float32),
        "b": torch.randn(10, dtype=torch.float32),
        "e": torch.randn(3, 4, 5, dtype=torch.float32),
    }
    staged = []
    for rank in range(len(_trainer_layouts((6, 10), kind, train_size))):
        layouts = {n: _trainer_layouts(t.shape, kind, train_size)[rank] for n, t in full.items()}
        staged.append(_stage(full, layouts, rank, len(_trainer_layouts((6, 10), kind, train_size))))
    manifests = [m for m, _ in staged]
    dims = {"w": data.draw(st.integers(-1, 1)), "b": 0, "e": data.draw(st.integers(-1, 2))}
    for rank in range(infer_size):
        shard = TPShard(rank, infer_size, {n: d for n, d in dims.items() if d >= 0})
        targets, bindings = {}, []
        for name, tensor in full.items():
            box = shard.box(name, tensor.shape)
            targets[name] = torch.zeros(tuple(h - l for l, h in zip(*box)))
            bindings.append(Binding(name, name, box, targets[name]))
        plan = build_plan(manifests, bindings, first=rank)
        assert plan.nbytes >= sum(c.read.nbytes for c in plan.copies)
        assert sum(c.read.nbytes for c in plan.copies) == sum(t.numel() * 4 for t in targets.values())  # nothing else
        dsts, sources = coalesce(plan, {r: slot for r, (_, slot) in enumerate(staged)})
        Targets().apply(0, plan, sources, {}, dsts)
        for name, tensor in full.items():
            lo, hi = shard.box(name, tensor.shape)
            assert torch.equal(targets[name], tensor[tuple(slice(a, b) for a, b in zip(lo, hi))])


def _apply(full: dict[str, torch.Tensor], targets: dict[str, torch.Tensor], shard: TPShard, mapping=None, bucket=4096):
    """Stage `full` on one trainer rank, plan `targets` (bound by `mapping`, default same names)
    and apply as a "map" subscriber does; returns how many copies the apply issued."""
    layouts = {n: Layout.full(t.shape) for n, t in full.items()}
    manifest, slot = _stage(full, layouts, 0, 1, bucket)
    if mapping is None:
        bindings = [Binding(n, n, shard.box(n, full[n].shape), t) for n, t in targets.items()]
    else:
        bindings = mapping.bind({n: t.shape for n, t in full.items()}, targets, shard)
    plan = build_plan([manifest], bindings)
    dsts, sources = coalesce(plan, {0: slot})
    Targets().apply(1, plan, sources, {}, dsts)
    return len(dsts)


def test_copies_that_read_and_write_back_to_back_are_one_copy():
    """Staged tensors read one after another into one stretch of one target's memory become one
    copy of their bytes (each copy is a launch on a GPU): a fused qkv_proj made of q, k and v, and
    tensors kept in one flat buffer in staging order. Copies with a gap on either side, strided
    reads and separate tensors stay apart. Every case lands exactly."""
    p = "model.layers.0.self_attn."
    full = {
        p + "q_proj.weight": torch.randn(8, 4),
        p + "k_proj.weight": torch.randn(4, 4),
        p + "v_proj.weight": torch.randn(4, 4),
    }
    fused = torch.zeros(16, 4)
    assert _apply(full, {p + "qkv_proj.weight": fused}, TPShard(), LLAMA) == 1
    assert torch.equal(fused, torch.cat(list(full.values())))

    flat = torch.zeros(64)
    views = {n: flat[i * 16 : (i + 1) * 16].view(4, 4) for i, n in enumerate("abcd")}
    parts = {n: torch.randn(4, 4) for n in "abcd"}
    assert _apply(parts, views, TPShard()) == 1
    assert torch.equal(flat, torch.cat([t.view(-1) for t in parts.values()]))

    separate = {n: torch.zeros(4, 4) for n in "abcd"}
    assert _apply(parts, separate, TPShard()) == 4
    assert all(torch.equal(separate[n], parts[n]) for n in parts)

    halves = {n: flat[i * 8 : (i + 1) * 8].view(4, 2) for i, n in enumerate("abcd")}  # columns: strided reads
    assert _apply(parts, halves, TPShard(0, 2, {n: 1 for n in "abcd"})) == 4
    assert all(torch.equal(halves[n], parts[n][:, :2]) for n in parts)

    odd = {"x": torch.randn(5), "y": torch.randn(5)}  # staged 64-byte aligned: a gap after x
    buffer = torch.zeros(10)
    assert _apply(odd, {"x": buffer[:5], "y": buffer[5:]}, TPShard()) == 2
    assert torch.equal(buffer, torch.cat([odd["x"], odd["y"]]))

    across = {"x": torch.randn(24), "y": torch.randn(24)}  # y does not fit x's bucket: it starts the next
    buffer = torch.zeros(48)
    assert _apply(across, {"x": buffer[:24], "y": buffer[24:]}, TPShard(), bucket=128) == 2
    assert torch.equal(buffer, torch.cat([across["x"], across["y"]]))

    memory = bytearray(128)  # two storages over one memory, x's too short to hold y's bytes too
    aliased = {"x": torch.frombuffer(memory, dtype=torch.float32, count=16)}
    aliased["y"] = torch.frombuffer(memory, dtype=torch.float32, count=32)[16:]
    both = {"x": torch.randn(16), "y": torch.randn(16)}
    assert _apply(both, aliased, TPShard()) == 2
    assert torch.equal(torch.frombuffer(memory, dtype=torch.float32), torch.cat([both["x"], both["y"]]))
