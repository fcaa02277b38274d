"""Who holds which slice, and how trainer names become inference names.

Sharding: `TPShard` says which tensor-parallel slice a process holds (its rank, the TP size and
which dim each tensor is split along); `FlatShard` says which flat FSDP-style range a trainer
rank holds. Both turn a local tensor into a `Layout` of its global tensor. `LLAMA_TP_DIMS` is
Megatron/vLLM's split for Llama/Qwen: column-parallel layers split dim 0, row-parallel
layers dim 1, norms replicated.

Fused tensors (`LLAMA_FUSED`: `qkv_proj`, `gate_up_proj`) are their parts concatenated along
dim 0, [q; k; v], and that is their global tensor. Tensor parallelism splits them part by part,
as vLLM's `QKVParallelLinear` and Megatron do: TP rank r holds [q_r; k_r; v_r], not rows
r/T..(r+1)/T of [q; k; v]. So a fused tensor's TP shard needs the sizes of its parts (with
GQA, q is larger than k and v): `TPShard(parts=...)` declares them, a publisher's manifest
carries them, and the unfused names on the other side (`q_proj`, ...) give them.

Names: `NameMapping.bind` matches the subscriber's tensors to the publishers' and returns one
`Binding` per (subscriber tensor, source tensor) part: which box of the source's global tensor
lands in which view of the subscriber's tensor. Beyond renaming, it fuses (the subscriber holds
`qkv_proj`, the trainer sends `q_proj`, `k_proj`, `v_proj`: each part's TP slice is a dim-0
block of the fused local tensor) and splits (the trainer sends `gate_up_proj`, the subscriber
holds `gate_proj` and `up_proj`). `LLAMA` (also `QWEN`) does this for Llama/Qwen-style
checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from transfer_queue import SchemaError

from .layout import Box, Layout

__all__ = [
    "TPShard",
    "FlatShard",
    "Binding",
    "NameMapping",
    "LLAMA_TP_DIMS",
    "LLAMA_FUSED",
    "LLAMA",
    "QWEN",
]

LLAMA_TP_DIMS: dict[str, int] = {
    "embed_tokens.": 0,
    "lm_head.": 0,
    "q_proj.": 0,
    "k_proj.": 0,
    "v_proj.": 0,
    "qkv_proj.": 0,
    "gate_proj.": 0,
    "up_proj.": 0,
    "gate_up_proj.": 0,
    "o_proj.weight": 1,
    "down_proj.weight": 1,
}
"""Split dim by name fragment (first match wins); unmatched tensors are replicated."""

LLAMA_FUSED: tuple[str, ...] = ("qkv_proj.", "gate_up_proj.")
"""Name fragments of fused tensors, which tensor parallelism splits part by part."""


@dataclass(frozen=True)
class TPShard:
    """Tensor-parallel rank `rank` of `size`; `dims` maps a name fragment to the split dim.

    `parts` maps a name fragment of a fused tensor (those of `LLAMA_FUSED`, or another whose
    parts are declared here) to the global dim-0 sizes of its parts, e.g. `{"qkv_proj.":
    (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), "gate_up_proj.":
    (intermediate, intermediate)}`. A publisher holding fused tensors split along dim 0 must
    declare them; a subscriber only for a fused tensor it holds split along dim 0 that is
    published fused by a publisher that did not declare them.
    """

    rank: int = 0
    size: int = 1
    dims: Mapping[str, int] = field(default_factory=lambda: dict(LLAMA_TP_DIMS))
    parts: Mapping[str, Sequence[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is not in [0, {self.size})")

    def dim(self, name: str) -> int:
        """The dim `name` is split along, or -1 (replicated)."""
        return next((d for frag, d in self.dims.items() if frag in name), -1)

    def fused(self, name: str) -> str | None:
        """The fragment that makes `name` a fused tensor (see `parts`), or None."""
        return next((frag for frag in (*self.parts, *LLAMA_FUSED) if frag in name), None)

    def part_sizes(self, name: str) -> tuple[int, ...] | None:
        """The declared global dim-0 sizes of fused `name`'s parts, or None."""
        frag = self.fused(name)
        return tuple(self.parts[frag]) if frag is not None and frag in self.parts else None

    def splits_parts(self, name: str) -> bool:
        """Whether this rank holds a slice of each part of `name` (fused, split along dim 0)."""
        return self.size > 1 and self.dim(name) == 0 and self.fused(name) is not None

    def box(self, name: str, shape: Sequence[int], origin: Sequence[int] | None = None) -> Box:
        """The box of a global `shape` (placed at `origin`) that this rank holds of `name`,
        split as one tensor: for a fused tensor split part by part, pass each part's shape."""
        layout = Layout.tp(shape, self.dim(name), self.rank, self.size) if self.dim(name) >= 0 else Layout.full(shape)
        lo, hi = layout.box
        origin = tuple(origin) if origin is not None else (0,) * len(lo)
        return tuple(a + o for a, o in zip(lo, origin)), tuple(b + o for b, o in zip(hi, origin))

    def layout(self, name: str, local: torch.Tensor) -> Layout:
        """The layout of a trainer rank's local `name`, split evenly (global = local × size),
        or, for a fused tensor split along dim 0, split part by part (global dim 0 = the sum
        of its declared parts).

        Raises `SchemaError` if `local` is not that shard, or is a fused tensor's TP shard
        whose part sizes are not declared (its layout cannot be known).
        """
        dim = self.dim(name)
        shape = list(local.shape)
        parts = self.part_sizes(name)
        if self.splits_parts(name) and shape:
            if parts is None:
                raise SchemaError(
                    f"{name}: TP rank {self.rank} of {self.size} holds a slice of each part of this fused tensor; "
                    f"declare the global sizes of its parts: TPShard(parts={{{self.fused(name)!r}: (...)}})"
                )
            shape[0] = sum(parts)
        elif 0 <= dim < len(shape):
            shape[dim] *= self.size
        if parts is not None and (not shape or shape[0] != sum(parts)):
            raise SchemaError(
                f"{name}: declared parts {parts} do not add up to dim 0 of its global shape {tuple(shape)}"
            )
        layout = (
            Layout.tp(shape, dim, self.rank, self.size, parts or ()) if dim >= 0 else Layout.full(shape, parts or ())
        )
        if layout.local_shape != tuple(local.shape):
            split = f", split part by part {parts}" if self.splits_parts(name) else ""
            raise SchemaError(
                f"{name}: local shape {tuple(local.shape)} is not an even TP shard of {tuple(shape)}{split}"
            )
        return layout


@dataclass(frozen=True)
class FlatShard:
    """FSDP1-style rank `rank` of `size`: each tensor's flat range, `shapes` giving global shapes."""

    rank: int
    size: int
    shapes: Mapping[str, Sequence[int]]

    def layout(self, name: str, local: torch.Tensor) -> Layout:
        """The layout of this rank's flat shard of `name` (`local` must hold exactly it).

        Raises `SchemaError` if `shapes` lacks `name` or `local` has another size."""
        if name not in self.shapes:
            raise SchemaError(f"{name}: FlatShard.shapes has no global shape for it")
        layout = Layout.full(self.shapes[name]).flat_shard(self.rank, self.size)
        if local.numel() != layout.numel:
            raise SchemaError(
                f"{name}: local shard has {local.numel()} elements, rank {self.rank}/{self.size} holds {layout.numel}"
            )
        return layout


@dataclass(frozen=True)
class Binding:
    """Box `box` of source tensor `source`'s global tensor lands in `view` of `target`."""

    target: str
    source: str
    box: Box
    view: torch.Tensor


class NameMapping:
    """Renames trainer tensors and fuses or splits them into the subscriber's tensors.

    `rename(trainer_name)` returns the subscriber-side name (None: not wanted); the default
    strips wrapper prefixes (`module.`, `_orig_mod.`, `_fsdp_wrapped_module.`). `fuse` maps a
    fused name fragment to its parts, concatenated along dim 0 in that order.
    """

    def __init__(
        self, rename: Callable[[str], str | None] | None = None, fuse: Mapping[str, Sequence[str]] | None = None
    ):
        self.rename = rename or strip_wrappers
        self.fuse = {f".{k}.": tuple(f".{p}." for p in v) for k, v in (fuse or {}).items()}

    def bind(
        self, sources: Mapping[str, Sequence[int] | Layout], targets: Mapping[str, torch.Tensor], shard: TPShard
    ) -> list[Binding]:
        """One `Binding` per part of every target tensor.

        `sources` maps trainer names to global shapes, or to the layouts the publishers stage
        them with (whose `parts` give a fused tensor's part sizes). Raises `SchemaError` when a
        target has no source, its local shape does not match what its TP slice should be, or
        its TP slice takes a slice of each part of a fused tensor whose part sizes are unknown
        or disagree (declared on either side, or given by the unfused names).
        """
        shapes = {n: tuple(s.shape) if isinstance(s, Layout) else tuple(s) for n, s in sources.items()}
        declared = {n: s.parts for n, s in sources.items() if isinstance(s, Layout) and s.parts}
        by_name: dict[str, str] = {}
        for source in sources:
            name = self.rename(source)
            if name is not None:
                by_name[name] = source
        out: list[Binding] = []
        for target, tensor in targets.items():
            parts = self._parts(target, by_name, shapes, declared, targets, shard)
            if parts is None:
                raise SchemaError(f"no published tensor maps to {target!r} (published e.g. {sorted(by_name)[:3]})")
            row = 0
            for source, origin, shape in parts:
                box = shard.box(target, shape, origin)
                rows = box[1][0] - box[0][0] if shape else 0
                view = tensor.narrow(0, row, rows) if len(parts) > 1 else tensor
                want = tuple(h - l for l, h in zip(*box))
                if tuple(view.shape) != want:
                    raise SchemaError(
                        f"{target}: local part for {source} has shape {tuple(view.shape)}, its TP slice is {want}"
                    )
                out.append(Binding(target, source, box, view))
                row += rows
            if len(parts) > 1 and row != tensor.shape[0]:
                raise SchemaError(f"{target}: parts fill {row} of {tensor.shape[0]} rows")
        return out

    def _parts(
        self, target, by_name, shapes, declared, targets, shard
    ) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None:
        """(source, origin, shape) of each region of a source that makes up `target`: the
        regions' TP slices, concatenated along dim 0, are `target`'s local tensor."""
        splits = shard.size > 1 and shard.dim(target) == 0 and (shard.fused(target) or self._fused(target))
        if target in by_name:
            source = by_name[target]
            shape = shapes[source]
            if not splits or not shape:
                return [(source, (0,) * len(shape), shape)]
            sizes = _agree(target, source, shape[0], declared.get(source), shard.part_sizes(target))
            return _blocks(source, sizes, shape)
        for fused, parts in self.fuse.items():
            if fused in target:  # fuse: the target is the dim-0 concatenation of parts
                names = [target.replace(fused, p) for p in parts]
                if all(n in by_name for n in names):
                    regions = [(by_name[n], (0,) * len(shapes[by_name[n]]), shapes[by_name[n]]) for n in names]
                    if shard.part_sizes(target) is not None and all(r[2] for r in regions):
                        rows = tuple(r[2][0] for r in regions)
                        _agree(target, target, sum(rows), rows, shard.part_sizes(target))
                    return regions
            for part in parts:  # split: the target is a dim-0 block of the fused source
                fused_name = target.replace(part, fused)
                if part in target and fused_name in by_name:
                    source = by_name[fused_name]
                    known = [declared.get(source), shard.part_sizes(fused_name)]
                    if known == [None, None]:  # each sibling's own binding checks its TP slice
                        known = [self._sibling_rows(target, part, parts, source, targets, shard)]
                    sizes = _agree(target, source, shapes[source][0], *known)
                    return [_blocks(source, sizes, shapes[source])[parts.index(part)]]
        return None

    def _fused(self, name: str) -> bool:
        return any(fused in name for fused in self.fuse)

    @staticmethod
    def _sibling_rows(target, part, parts, source, targets, shard) -> tuple[int, ...]:
        """The global rows of each part of fused `source`, from the subscriber's tensors that
        hold them (`target`, part `part`, and its siblings), each an even TP slice."""
        rows = []
        for sibling in parts:
            name = target.replace(part, sibling)
            tensor = targets.get(name)
            if tensor is None:
                raise SchemaError(f"{target}: splitting {source} needs its sibling {name}")
            rows.append(tensor.shape[0] * (shard.size if shard.dim(name) == 0 else 1))
        return tuple(rows)


def _agree(target: str, source: str, rows: int, *candidates: tuple[int, ...] | None) -> tuple[int, ...]:
    """The part sizes of fused `source` (dim 0: `rows`) that every known candidate gives.

    Raises `SchemaError` if none is known, they differ, or they do not add up to `rows`."""
    known = {tuple(c) for c in candidates if c is not None}
    if not known:
        raise SchemaError(
            f"{target}: its TP slice is a slice of each part of fused {source!r}, whose part sizes are unknown: "
            "declare them (TPShard(parts=...)) here or on the publisher, or publish the parts unfused"
        )
    if len(known) > 1:
        raise SchemaError(f"{target}: the part sizes of fused {source!r} disagree: {sorted(known)}")
    sizes = known.pop()
    if sum(sizes) != rows:
        raise SchemaError(f"{target}: parts {sizes} of fused {source!r} do not add up to its {rows} rows")
    return sizes


def _blocks(
    source: str, sizes: Sequence[int], shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(source, origin, shape) of each part of fused `source`, in order."""
    out = []
    offset = 0
    for n in sizes:
        out.append((source, (offset, *(0,) * (len(shape) - 1)), (n, *shape[1:])))
        offset += n
    return out


def strip_wrappers(name: str) -> str:
    """Drop prefixes that DDP, torch.compile and FSDP add to parameter names."""
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


LLAMA = NameMapping(fuse={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
"""Llama-style checkpoints: HF names, fused into (or split from) vLLM's qkv_proj/gate_up_proj."""
QWEN = LLAMA
"""Qwen2/Qwen3 use the same projection names (plus q/k/v biases, fused the same way)."""
