"""Batch metadata: what a consumer is handed by `get_meta` and hands back to `get_data`/`ack`.

`BatchMeta` is a small msgspec struct of per-sample lists. It never holds tensors, so it is
cheap to send between processes (the trainer's driver can pass it to its workers).
"""

from __future__ import annotations

import math

import msgspec

from ._errors import SchemaError

__all__ = ["FieldSpec", "BatchMeta", "RAGGED", "ITEMSIZE"]

RAGGED = -1
"""Marks the first per-sample dimension of a ragged (jagged) field in `FieldSpec.shape`."""

ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
}
"""Bytes per element of every dtype that may cross the wire, by wire name."""


class FieldSpec(msgspec.Struct, frozen=True, array_like=True):
    """A column's schema: dtype name and per-sample shape (`RAGGED` as first dim if jagged)."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def ragged(self) -> bool:
        return bool(self.shape) and self.shape[0] == RAGGED

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def inner_numel(self) -> int:
        """Elements per unit of the leading dim: the whole sample if dense, one row if ragged."""
        dims = self.shape[1:] if self.ragged else self.shape
        return math.prod(dims)

    @property
    def row_bytes(self) -> int:
        """Bytes per sample of a dense field (per ragged element for ragged fields)."""
        return self.inner_numel * self.itemsize


class BatchMeta(msgspec.Struct, frozen=True):
    """Which samples a batch holds and where they live; lists are per sample, in batch order.

    `policy_versions` is the version that started each sample (its oldest, staleness is measured
    from it); `version_last` the newest version that touched it (equal unless a partial rollout
    resumed under newer weights). `units` is the storage unit holding each sample.
    """

    partition: str
    indexes: list[int]
    policy_versions: list[int]
    version_last: list[int]
    groups: list[int]
    units: list[int]
    fields: dict[str, FieldSpec]
    task: str = ""
    lease_id: int = 0

    def __len__(self) -> int:
        return len(self.indexes)

    @property
    def size(self) -> int:
        return len(self.indexes)

    @property
    def version_spans(self) -> list[tuple[int, int]]:
        """(first, last) policy version per sample."""
        return list(zip(self.policy_versions, self.version_last))

    def chunk(self, n: int) -> list["BatchMeta"]:
        """Split into `n` contiguous parts (e.g. one per data-parallel rank); they share the lease."""
        if not isinstance(n, int) or n < 1:
            raise SchemaError(f"chunk needs a number of parts >= 1, got {n!r}")
        size = len(self)
        bounds = [size * i // n for i in range(n + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(n)]

    def select(self, positions) -> "BatchMeta":
        """A sub-batch with the samples at `positions` (same lease, same fields)."""
        pos = list(positions)
        return msgspec.structs.replace(
            self,
            indexes=[self.indexes[p] for p in pos],
            policy_versions=[self.policy_versions[p] for p in pos],
            version_last=[self.version_last[p] for p in pos],
            groups=[self.groups[p] for p in pos],
            units=[self.units[p] for p in pos],
        )
