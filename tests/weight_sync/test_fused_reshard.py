"""Fused tensors (`qkv_proj` with GQA sizes and its bias, `gate_up_proj`) resharded between
tensor-parallel sizes through real publishers and subscribers (shm staging, the control plane
over ZeroMQ): a fused TP shard is its slice of each part, [q_r; k_r; v_r] as vLLM and Megatron
hold it, so every rank of every side ends with exactly its bytes; part sizes that cannot be
known or disagree are a `SchemaError` naming the tensor, never silently wrong weights."""

from __future__ import annotations

import contextlib

import pytest
import torch

from transfer_queue.wire.errors import SchemaError
from weight_sync import LLAMA, FlatShard, TPShard, WeightPublisher, WeightSubscriber
from weight_sync.subscriber import _signature

ATTN, MLP = "model.layers.0.self_attn.", "model.layers.0.mlp."
Q, KV, HIDDEN, INTER = 24, 8, 12, 40
"""GQA: 6 query heads and 2 key/value heads of 4, so q, k and v differ in size."""
SHAPES = {
    ATTN + "q_proj.weight": (Q, HIDDEN),
    ATTN + "k_proj.weight": (KV, HIDDEN),
    ATTN + "v_proj.weight": (KV, HIDDEN),
    ATTN + "q_proj.bias": (Q,),
    ATTN + "k_proj.bias": (KV,),
    ATTN + "v_proj.bias": (KV,),
    ATTN + "o_proj.weight": (HIDDEN, Q),
    MLP + "gate_proj.weight": (INTER, HIDDEN),
    MLP + "up_proj.weight": (INTER, HIDDEN),
}
PARTS = {"qkv_proj.": (Q, KV, KV), "gate_up_proj.": (INTER, INTER)}
FUSED = {".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."), ".gate_up_proj.": (".gate_proj.", ".up_proj.")}


def weights(version: int) -> dict[str, torch.Tensor]:
    """The global (unfused) weights of `version`."""
    gen = torch.Generator().manual_seed(version)
    return {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in SHAPES.items()}


def tp(tensors: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Each tensor's TP slice, split as one tensor (Megatron/vLLM's dims)."""
    shard = TPShard(rank, size)
    return {n: t.chunk(size, shard.dim(n))[rank].clone() if shard.dim(n) >= 0 else t for n, t in tensors.items()}


def fuse(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q/k/v and gate/up concatenated along dim 0: of TP slices, a vLLM rank's fused tensors."""
    out = dict(tensors)
    for fused, parts in FUSED.items():
        for name in [n for n in tensors if parts[0] in n]:
            out[name.replace(parts[0], fused)] = torch.cat([out.pop(name.replace(parts[0], p)) for p in parts])
    return out


def fused(version: int, rank: int, size: int) -> dict[str, torch.Tensor]:
    """What TP rank `rank` of `size` holds with fused tensors ([q_r; k_r; v_r]; at size 1 the
    fused checkpoint layout [q; k; v], as Phi-3's)."""
    return fuse(tp(weights(version), rank, size))


def unfused(version: int, rank: int, size: int) -> dict[str, torch.Tensor]:
    return tp(weights(version), rank, size)


@contextlib.contextmanager
def publishers(size: int, shard=lambda rank, size: TPShard(rank, size, parts=PARTS if size > 1 else {})):  # noqa: ANN001
    """`size` publisher ranks of one model (rank 0 coordinates), sharded by `shard(rank, size)`
    (by default declaring the fused tensors' part sizes where TP splits them, and only there)."""
    with contextlib.ExitStack() as stack:
        pubs = [stack.enter_context(WeightPublisher(None, "shm", world_size=size, shard=shard(0, size), timeout=10))]
        for rank in range(1, size):
            pubs.append(
                stack.enter_context(
                    WeightPublisher(
                        None,
                        "shm",
                        rank=rank,
                        world_size=size,
                        shard=shard(rank, size),
                        coordinator=pubs[0].endpoint,
                        timeout=10,
                    )
                )
            )
        yield pubs


def subscriber(stack: contextlib.ExitStack, pub: WeightPublisher, targets, shard: TPShard) -> WeightSubscriber:  # noqa: ANN001
    return stack.enter_context(
        WeightSubscriber(None, targets, transport="shm", publisher=pub.endpoint, shard=shard, mapping=LLAMA, timeout=10)
    )


@pytest.mark.parametrize(("pub_tp", "sub_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_fused_tensors_land_exactly_across_tp_sizes(pub_tp, sub_tp):
    """Trainer ranks with fused tensors (declaring their parts' sizes where TP splits them)
    feed every rank of a TP group holding them fused (which learns the sizes from the
    publishers' manifests, or declares them itself when the trainer is not split) and holding
    them unfused; trainer ranks with unfused tensors feed the fused ones. Two versions, each
    exact on every rank."""
    with (
        publishers(pub_tp) as fused_pubs,
        publishers(pub_tp, lambda rank, size: TPShard(rank, size)) as unfused_pubs,
        contextlib.ExitStack() as stack,
    ):
        subs = []
        for rank in range(sub_tp):
            own = PARTS if pub_tp == 1 else {}
            held = fused(0, rank, sub_tp)
            subs.append((subscriber(stack, fused_pubs[0], held, TPShard(rank, sub_tp, parts=own)), held, fused, rank))
            held = unfused(0, rank, sub_tp)
            subs.append((subscriber(stack, fused_pubs[0], held, TPShard(rank, sub_tp)), held, unfused, rank))
            held = fused(0, rank, sub_tp)
            subs.append((subscriber(stack, unfused_pubs[0], held, TPShard(rank, sub_tp)), held, fused, rank))
        for version in (1, 2):
            for rank in range(pub_tp):
                fused_pubs[rank].publish(fused(version, rank, pub_tp), version)
                unfused_pubs[rank].publish(unfused(version, rank, pub_tp), version)
            for sub, held, layout, rank in subs:
                assert sub.wait(version, timeout=30) == version
                want = layout(version, rank, sub_tp)
                wrong = [n for n, t in held.items() if not torch.equal(t, want[n])]
                assert not wrong, f"TP {pub_tp} -> rank {rank} of {sub_tp} ({layout.__name__}): {wrong} differ"


def test_a_fused_tp_shard_whose_part_sizes_are_unknown_is_refused():
    """A trainer rank holding a fused tensor split by TP without its parts' sizes cannot say
    what it holds: publish refuses it, naming the tensor. A TP rank holding a fused tensor
    published fused by an unsplit trainer that declared nothing cannot know which rows are
    its own: its wait is refused, naming the tensor, and its tensors stay untouched."""
    with (
        publishers(2, lambda rank, size: TPShard(rank, size)) as pubs,
        pytest.raises(SchemaError, match=r"qkv_proj\.weight.*TPShard\(parts="),
    ):
        pubs[0].publish(fused(1, 0, 2), 1)
    with publishers(1, lambda rank, size: TPShard(rank, size)) as pubs, contextlib.ExitStack() as stack:
        held = fused(0, 0, 2)
        sub = subscriber(stack, pubs[0], held, TPShard(0, 2))
        pubs[0].publish(fused(1, 0, 1), 1)
        with pytest.raises(SchemaError, match=r"qkv_proj\.(weight|bias).*part sizes are unknown"):
            sub.wait(1, timeout=10)
        assert sub.version == -1 and all(torch.equal(t, fused(0, 0, 2)[n]) for n, t in held.items())


def test_part_sizes_that_disagree_are_refused():
    """A subscriber that declares other part sizes than the trainer's manifest carries is
    refused (which of the two is wrong cannot be told), naming the tensor."""
    with publishers(2) as pubs, contextlib.ExitStack() as stack:
        held = fused(0, 0, 4)
        other = {**PARTS, "qkv_proj.": (Q - 4, KV + 2, KV + 2)}
        sub = subscriber(stack, pubs[0], held, TPShard(0, 4, parts=other))
        for rank in range(2):
            pubs[rank].publish(fused(1, rank, 2), 1)
        with pytest.raises(SchemaError, match=r"qkv_proj\.(weight|bias).*disagree"):
            sub.wait(1, timeout=10)


def test_a_flat_shard_without_a_tensors_shape_names_it():
    shapes = {n: s for n, s in SHAPES.items() if "bias" not in n}
    with WeightPublisher(None, "shm", shard=FlatShard(0, 2, shapes), timeout=10) as pub:
        local = {n: t.reshape(-1)[: -(-t.numel() // 2)] for n, t in weights(1).items()}
        with pytest.raises(SchemaError, match=r"q_proj\.bias: FlatShard\.shapes has no global shape"):
            pub.publish(local, 1)


def test_subscribers_that_declare_other_part_sizes_do_not_share_a_relay():
    """Equal signatures mean equal plans (a relay forwards its bytes to its equals): part sizes
    change the plan, so they change the signature."""
    held = fused(0, 0, 2)
    signatures = {_signature(held, TPShard(0, 2, parts=p), LLAMA) for p in ({}, PARTS, {"qkv_proj.": (Q, KV, KV)})}
    assert len(signatures) == 3
