"""Batch metadata: what a consumer is handed by `get_meta` and hands back to `get_data`/`ack`.

`BatchMeta` is a small msgspec struct of per-sample lists. It never holds tensors, so it is
cheap to send between processes (the trainer's driver can pass it to its workers).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from .errors import SchemaError

__all__ = ["FieldSpec", "BatchMeta", "RAGGED", "ITEMSIZE", "OBJECT_DTYPES"]

RAGGED = -1
"""Marks the first per-sample dimension of a ragged (jagged) field in `FieldSpec.shape`."""

ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "msgpack": 1,
    "msgpack_data": 1,
}
"""Bytes per element of every dtype that may cross the wire, by wire name."""

OBJECT_DTYPES = ("msgpack", "msgpack_data")
"""Wire dtypes of non-tensor fields: each sample's value as msgpack bytes (a ragged uint8 row).
"msgpack" comes back as a `NonTensorStack` (one value per sample), "msgpack_data" as a
`NonTensorData` (one value for the whole batch, stored with every sample). See `_objects`."""


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


class BatchMeta(msgspec.Struct):
    """Which samples a batch holds and where they live; lists are per sample, in batch order.

    `policy_versions` is the version that started each sample (its oldest, staleness is measured
    from it); `version_last` the newest version that touched it (equal unless a partial rollout
    resumed under newer weights). `units` is the storage unit holding each sample.

    The same class is TransferQueue's `BatchMeta` for code written against TransferQueue 0.1.11
    (verl's `tqbridge`): `global_indexes`, `partition_ids`, `field_names`, `is_ready`,
    `select_fields`, `select_samples`, `chunk(chunks=)`, `concat`, `union`, `reorder`, `copy`,
    `empty`, and a settable, batch-level `extra_info` with its `*_extra_info` helpers (never sent
    by Sluice's services; copied along by `select`/`chunk`). tests/verl/test_tq_parity.py holds
    the differences from TransferQueue's `BatchMeta`.
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
    """The lease `get_meta` handed the batch out under (0: none, or unknown for a batch built or
    merged by hand); `ack`/`nack` send it, so that they end this lease and no other."""
    extra_info: dict = {}

    def __len__(self) -> int:
        return len(self.indexes)

    @property
    def size(self) -> int:
        return len(self.indexes)

    @property
    def version_spans(self) -> list[tuple[int, int]]:
        """(first, last) policy version per sample."""
        return list(zip(self.policy_versions, self.version_last))

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """Split into `chunks` contiguous parts (e.g. one per data-parallel rank), the first
        `len(self) % chunks` one sample longer, as TransferQueue splits; they share the lease.
        Raises `SchemaError` unless `chunks` is an int >= 1."""
        if not isinstance(chunks, int) or chunks < 1:
            raise SchemaError(f"chunk needs a number of parts >= 1, got {chunks!r}")
        base, extra = divmod(len(self), chunks)
        bounds = [0]
        for i in range(chunks):
            bounds.append(bounds[-1] + base + (1 if i < extra else 0))
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(chunks)]

    def select(self, positions) -> BatchMeta:
        """A sub-batch with the samples at `positions` (same lease, same fields)."""
        pos = list(positions)
        return msgspec.structs.replace(
            self,
            indexes=[self.indexes[p] for p in pos],
            policy_versions=[self.policy_versions[p] for p in pos],
            version_last=[self.version_last[p] for p in pos],
            groups=[self.groups[p] for p in pos],
            units=[self.units[p] for p in pos],
            extra_info=dict(self.extra_info),
        )

    # -- TransferQueue 0.1.11's BatchMeta operations ------------------------------------------

    @property
    def global_indexes(self) -> list[int]:
        """TransferQueue's name for `indexes`."""
        return list(self.indexes)

    @property
    def partition_ids(self) -> list[str]:
        """The partition of each sample (a Sluice batch always lies in one partition)."""
        return [self.partition] * len(self.indexes)

    @property
    def field_names(self) -> list[str]:
        """The batch's field names, sorted (TransferQueue's order)."""
        return sorted(self.fields)

    @property
    def is_ready(self) -> bool:
        """True for a non-empty batch: Sluice only hands out metas whose fields are all ready."""
        return len(self.indexes) > 0

    def select_fields(self, field_names: list[str]) -> BatchMeta:
        """The same samples with only `field_names`; `SchemaError` names any field the batch lacks
        (with TransferQueue's key API: one that is not ready for every sample)."""
        missing = [f for f in field_names if f not in self.fields]
        if missing:
            raise SchemaError(
                f"field(s) {missing} are not ready for every sample of this batch; it has {sorted(self.fields)}"
            )
        return msgspec.structs.replace(self, fields={f: self.fields[f] for f in field_names})

    def select_samples(self, sample_indices: list[int]) -> BatchMeta:
        """TransferQueue's name for `select`."""
        return self.select(sample_indices)

    def __getitem__(self, item: int | slice) -> BatchMeta:
        """The sample at position `item` (negative counts from the end) or the samples of a slice,
        as a batch (TransferQueue's indexing). `IndexError` out of range, `TypeError` for other keys."""
        if isinstance(item, slice):
            return self.select(range(*item.indices(len(self))))
        if not isinstance(item, int) and not (hasattr(item, "__index__") and not isinstance(item, bool)):
            raise TypeError(f"BatchMeta indexes by int or slice, not {type(item).__name__}")
        position = int(item) + (len(self) if int(item) < 0 else 0)
        if not 0 <= position < len(self):
            raise IndexError(f"position {item} of a batch of {len(self)}")
        return self.select([position])

    def reorder(self, indices: list[int]) -> None:
        """Put the samples in the order `indices` (a permutation of the positions), in place;
        `SchemaError` for anything else."""
        if sorted(indices) != list(range(len(self))):
            raise SchemaError(f"reorder needs a permutation of {len(self)} positions, got {indices[:8]}")
        ordered = self.select(indices)
        for name in ("indexes", "policy_versions", "version_last", "groups", "units"):
            setattr(self, name, getattr(ordered, name))

    def copy(self) -> BatchMeta:
        """An independent copy (TransferQueue's `copy`)."""
        return self.select(range(len(self)))

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One part per partition: a Sluice batch lies in one, so `[self.copy()]` (none if empty)."""
        return [self.copy()] if len(self) else []

    def union(self, other: BatchMeta) -> BatchMeta:
        """The same samples with both batches' fields (`other`'s win) and `extra_info`, under the
        lease either names (none, 0, if they name two); an empty side gives a copy of the other.
        `SchemaError` unless both hold the same samples."""
        if not len(other):
            return self.copy()
        if not len(self):
            return other.copy()
        if (self.partition, self.indexes) != (other.partition, other.indexes):
            raise SchemaError("union needs two batches of the same samples in the same order")
        leases = {self.lease_id, other.lease_id} - {0}  # the same samples: one lease, or unknown
        return msgspec.structs.replace(
            self.copy(),
            fields={**self.fields, **other.fields},
            extra_info={**self.extra_info, **other.extra_info},
            lease_id=leases.pop() if len(leases) == 1 else 0,
        )

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        """`extra_info[key]`, or `default`."""
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        """Set `extra_info[key]`."""
        self.extra_info[key] = value

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        """Merge `info_dict` into `extra_info`."""
        self.extra_info.update(info_dict)

    def has_extra_info(self, key: str) -> bool:
        """Whether `extra_info` holds `key`."""
        return key in self.extra_info

    def remove_extra_info(self, key: str) -> Any:
        """Remove `key` from `extra_info` and return its value (None if absent)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        """Empty `extra_info`."""
        self.extra_info.clear()

    def get_all_extra_info(self) -> dict[str, Any]:
        """A copy of `extra_info`."""
        return dict(self.extra_info)

    @classmethod
    def concat(cls, data: list[BatchMeta], validate: bool = True) -> BatchMeta:
        """One batch of `data`'s samples in order; they must share partition, task and fields
        (`SchemaError` otherwise; `validate=False` skips the check, as in TransferQueue, and the
        first part's fields stand for all). It keeps the parts' lease when they share one, else
        its `lease_id` is 0 (acked or nacked whatever lease its samples are under). Empty parts
        are skipped; no parts give `BatchMeta.empty()`."""
        parts = [m for m in data if m is not None and len(m)]
        if not parts:
            return cls.empty()
        first = parts[0]
        for m in parts[1:] if validate else ():
            if (m.partition, m.task, set(m.fields)) != (first.partition, first.task, set(first.fields)):
                raise SchemaError(
                    f"cannot concat batches of partitions/tasks/fields {(first.partition, first.task, sorted(first.fields))} "
                    f"and {(m.partition, m.task, sorted(m.fields))}"
                )
        return msgspec.structs.replace(
            first,
            indexes=[i for m in parts for i in m.indexes],
            policy_versions=[v for m in parts for v in m.policy_versions],
            version_last=[v for m in parts for v in m.version_last],
            groups=[g for m in parts for g in m.groups],
            units=[u for m in parts for u in m.units],
            extra_info={k: v for m in parts for k, v in m.extra_info.items()},
            lease_id=first.lease_id if all(m.lease_id == first.lease_id for m in parts) else 0,
        )

    @classmethod
    def empty(cls, extra_info: dict | None = None) -> BatchMeta:
        """A batch with no samples (TransferQueue's `BatchMeta.empty`)."""
        return cls("", [], [], [], [], [], {}, extra_info=dict(extra_info or {}))
