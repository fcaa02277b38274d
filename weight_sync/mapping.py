"""Who holds which slice, and how trainer names become inference names.

Sharding: `TPShard` says which tensor-parallel slice a process holds (its rank, the TP size and
which dim each tensor is split along); `FlatShard` says which flat FSDP-style range a trainer
rank holds. Both turn a local tensor into a `Layout` of its global tensor. `LLAMA_TP_DIMS` is
Megatron/vLLM's split for Llama/Qwen: column-parallel layers split dim 0, row-parallel
layers dim 1, norms replicated.

Names: `NameMapping.bind` matches the subscriber's tensors to the publishers' and returns one
`Binding` per (subscriber tensor, source tensor) part: which box of the source's global tensor
lands in which view of the subscriber's tensor. Beyond renaming, it fuses (the subscriber holds
`qkv_proj`, the trainer sends `q_proj`, `k_proj`, `v_proj`: each part is a dim-0 block of the
fused local tensor, itself TP-split like vLLM's `QKVParallelLinear`) and splits (the trainer
sends `gate_up_proj`, the subscriber holds `gate_proj` and `up_proj`). `LLAMA` (also `QWEN`)
does this for Llama/Qwen-style checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from transfer_queue import SchemaError

from .layout import Box, Layout

__all__ = ["TPShard", "FlatShard", "Binding", "NameMapping", "LLAMA_TP_DIMS", "LLAMA", "QWEN"]

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


@dataclass(frozen=True)
class TPShard:
    """Tensor-parallel rank `rank` of `size`; `dims` maps a name fragment to the split dim."""

    rank: int = 0
    size: int = 1
    dims: Mapping[str, int] = field(default_factory=lambda: dict(LLAMA_TP_DIMS))

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is not in [0, {self.size})")

    def dim(self, name: str) -> int:
        """The dim `name` is split along, or -1 (replicated)."""
        return next((d for frag, d in self.dims.items() if frag in name), -1)

    def box(self, name: str, shape: Sequence[int], origin: Sequence[int] | None = None) -> Box:
        """The box of a global `shape` (placed at `origin`) that this rank holds of `name`."""
        layout = Layout.tp(shape, self.dim(name), self.rank, self.size) if self.dim(name) >= 0 else Layout.full(shape)
        lo, hi = layout.box
        origin = tuple(origin) if origin is not None else (0,) * len(lo)
        return tuple(a + o for a, o in zip(lo, origin)), tuple(b + o for b, o in zip(hi, origin))

    def layout(self, name: str, local: torch.Tensor) -> Layout:
        """The layout of a trainer rank's local `name`, split evenly (global = local × size)."""
        dim = self.dim(name)
        shape = list(local.shape)
        if 0 <= dim < len(shape):
            shape[dim] *= self.size
        layout = Layout.tp(shape, dim, self.rank, self.size) if dim >= 0 else Layout.full(shape)
        if layout.local_shape != tuple(local.shape):
            raise SchemaError(f"{name}: local shape {tuple(local.shape)} is not an even TP shard of {tuple(shape)}")
        return layout


@dataclass(frozen=True)
class FlatShard:
    """FSDP1-style rank `rank` of `size`: each tensor's flat range, `shapes` giving global shapes."""

    rank: int
    size: int
    shapes: Mapping[str, Sequence[int]]

    def layout(self, name: str, local: torch.Tensor) -> Layout:
        """The layout of this rank's flat shard of `name` (`local` must hold exactly it)."""
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
        self, sources: Mapping[str, Sequence[int]], targets: Mapping[str, torch.Tensor], shard: TPShard
    ) -> list[Binding]:
        """One `Binding` per part of every target tensor.

        `sources` maps trainer names to global shapes. Raises `SchemaError` when a target has
        no source or its local shape does not match what its TP slice should be.
        """
        by_name: dict[str, str] = {}
        for source in sources:
            name = self.rename(source)
            if name is not None:
                by_name[name] = source
        out: list[Binding] = []
        for target, tensor in targets.items():
            parts = self._parts(target, by_name, sources, targets, shard)
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
        self, target, by_name, sources, targets, shard
    ) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None:
        """(source, origin, shape) of each region of a source that makes up `target`."""
        if target in by_name:
            shape = tuple(sources[by_name[target]])
            return [(by_name[target], (0,) * len(shape), shape)]
        for fused, parts in self.fuse.items():
            if fused in target:  # fuse: the target is the dim-0 concatenation of parts
                names = [target.replace(fused, p) for p in parts]
                if all(n in by_name for n in names):
                    return [(by_name[n], (0,) * len(sources[by_name[n]]), tuple(sources[by_name[n]])) for n in names]
            for part in parts:  # split: the target is a dim-0 block of the fused source
                fused_name = target.replace(part, fused)
                if part in target and fused_name in by_name:
                    return [self._block(target, part, parts, fused, by_name[fused_name], sources, targets, shard)]
        return None

    def _block(self, target, part, parts, fused, source, sources, targets, shard):
        """Region of fused `source` that part `part` of `target` is, sized from its siblings."""
        offset = 0
        shape = tuple(sources[source])
        for sibling in parts:
            tensor = targets.get(target.replace(part, sibling))
            if tensor is None:
                raise SchemaError(f"{target}: splitting {source} needs its sibling {target.replace(part, sibling)}")
            rows = tensor.shape[0] * (shard.size if shard.dim(target.replace(part, sibling)) == 0 else 1)
            if sibling == part:
                return source, (offset, *(0,) * (len(shape) - 1)), (rows, *shape[1:])
            offset += rows
        raise AssertionError("part is one of parts")


def strip_wrappers(name: str) -> str:
    """Drop prefixes that DDP, torch.compile and FSDP add to parameter names."""
    for prefix in ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


LLAMA = NameMapping(fuse={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
"""Llama-style checkpoints: HF names, fused into (or split from) vLLM's qkv_proj/gate_up_proj."""
QWEN = LLAMA
"""Qwen2/Qwen3 use the same projection names (plus q/k/v biases, fused the same way)."""
