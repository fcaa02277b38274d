"""Samplers: which of the ready samples a `get_meta` call gets, and in what order.

A sampler sees the candidate rows (ready for the task, in arrival order) and per-row columns,
and returns the rows to lease, or None when it cannot fill a batch yet. Write your own by
subclassing `Sampler`, then start the cluster with `tq.init(samplers=["my.module:MySampler"])`;
the controller imports it at start and serves it under `MySampler.name`.

    class Newest(Sampler):
        name = "newest"
        def sample(self, ready, batch_size, view, options, partial):
            if len(ready) < batch_size and not partial:
                return None
            return ready[::-1][:batch_size]
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from transfer_queue.wire.errors import SchemaError

__all__ = ["Sampler", "SampleView", "FifoSampler", "GroupSampler", "SeqlenBalancedSampler", "SamplerRegistry"]


@dataclass(frozen=True)
class SampleView:
    """Per-row columns a sampler may read (index them with the candidate rows)."""

    groups: np.ndarray
    seqlens: np.ndarray
    versions: np.ndarray


class Sampler(ABC):
    """Choose rows for one batch. `partial=True` means: return the best batch you can, even short
    (the caller timed out with `allow_partial`, or the partition is sealed and drained)."""

    name: ClassVar[str]

    @abstractmethod
    def sample(
        self,
        ready: np.ndarray,
        batch_size: int,
        view: SampleView,
        options: Mapping[str, int | float | str],
        partial: bool,
    ) -> np.ndarray | None: ...


def _count_option(options: Mapping[str, int | float | str], sampler: str, name: str, default: int | None) -> int:
    """Option `name` of `sampler`: a positive integer (`default` when absent; None: required).

    Raises:
        SchemaError: it is absent and required, or not a positive integer (a string, a
            fraction, a bool, zero or below)."""
    value = options.get(name, default)
    if type(value) is not int or value <= 0:
        raise SchemaError(f"{sampler} needs {name} as a positive integer, got {value!r}")
    return value


class FifoSampler(Sampler):
    """Oldest first."""

    name = "fifo"

    def sample(self, ready, batch_size, view, options, partial):
        if len(ready) < batch_size and not partial:
            return None
        return ready[:batch_size]


class GroupSampler(Sampler):
    """Only whole groups of `group_size` samples (GRPO): a group's samples are leased together."""

    name = "grpo_group"

    def sample(self, ready, batch_size, view, options, partial):
        size = _count_option(options, self.name, "group_size", None)
        if batch_size % size:
            raise SchemaError(f"grpo_group needs group_size dividing batch_size ({batch_size}), got {size}")
        groups = view.groups[ready]
        ids, first, counts = np.unique(groups, return_index=True, return_counts=True)
        complete = np.flatnonzero(counts >= size)
        complete = complete[np.argsort(first[complete], kind="stable")][: batch_size // size]
        if len(complete) * size < batch_size and not partial:
            return None
        picked = [ready[groups == gid][:size] for gid in ids[complete]]
        return np.concatenate(picked) if picked else ready[:0]


class SeqlenBalancedSampler(Sampler):
    """Oldest `batch_size` samples, ordered so that `meta.chunk(dp_size)` gives every
    data-parallel rank the same number of samples and nearly the same number of tokens."""

    name = "seqlen_balanced"

    def sample(self, ready, batch_size, view, options, partial):
        dp = _count_option(options, self.name, "dp_size", 1)
        if len(ready) < batch_size and not partial:
            return None
        rows = ready[:batch_size]
        lengths = view.seqlens[rows]
        bins: list[list[int]] = [[] for _ in range(dp)]
        room = [len(rows) * (i + 1) // dp - len(rows) * i // dp for i in range(dp)]
        load = np.zeros(dp, np.int64)
        for pos in np.argsort(-lengths, kind="stable"):  # longest first, into the lightest bin
            open_bins = [b for b in range(dp) if len(bins[b]) < room[b]]
            b = min(open_bins, key=lambda i: load[i])
            bins[b].append(int(rows[pos]))
            load[b] += lengths[pos]
        return np.array([r for b in bins for r in sorted(b)], dtype=np.int64)


class SamplerRegistry:
    """Samplers by name; refuses two with one name."""

    def __init__(self) -> None:
        self._samplers: dict[str, Sampler] = {}
        for cls in (FifoSampler, GroupSampler, SeqlenBalancedSampler):
            self.register(cls())

    def register(self, sampler: Sampler) -> None:
        if sampler.name in self._samplers:
            raise ValueError(f"a sampler named {sampler.name!r} is already registered")
        self._samplers[sampler.name] = sampler

    def load(self, path: str) -> None:
        """Import "module:Class" and register an instance."""
        module, _, attr = path.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if not (isinstance(cls, type) and issubclass(cls, Sampler)):
            raise TypeError(f"{path} is not a Sampler subclass")
        self.register(cls())

    def get(self, name: str) -> Sampler:
        try:
            return self._samplers[name]
        except KeyError:
            raise SchemaError(f"unknown sampler {name!r}; known: {sorted(self._samplers)}") from None
