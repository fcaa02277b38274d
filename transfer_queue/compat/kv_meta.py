"""`KVBatchMeta`: TransferQueue 0.1.11's handle on a batch named by user keys.

A plain dataclass (verl builds, chunks and concatenates these itself): the keys, one tag dict per
key, the partition, the field names and batch-level `extra_info`. It holds no storage location;
`kv_batch_get_by_meta` resolves the keys at the controller's key index.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..wire.errors import SchemaError

__all__ = ["KVBatchMeta"]


@dataclasses.dataclass
class KVBatchMeta:
    """Keys, per-key tags, partition, fields and batch-level info of a batch (TransferQueue's API).

    Raises `SchemaError` (a `ValueError`) when keys and tags differ in length, or a key or a
    field is listed twice.
    """

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise SchemaError(f"keys and tags must have the same length, got {len(self.keys)} and {len(self.tags)}")
        if len(set(self.keys)) != len(self.keys):
            raise SchemaError("KVBatchMeta got duplicate keys")
        if self.fields is not None and len(set(self.fields)) != len(self.fields):
            raise SchemaError("KVBatchMeta got duplicate fields")
        self.tags = copy.deepcopy(self.tags)
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def _with(self, keys: list[str], tags: list[dict]) -> KVBatchMeta:
        return KVBatchMeta(keys, tags, self.partition_id, self.fields, self.extra_info)

    def select_keys(self, keys_to_select: list[str]) -> KVBatchMeta:
        """A batch of `keys_to_select` (in that order); `SchemaError` for duplicates or unknown keys."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise SchemaError("select_keys got duplicate keys")
        where = {key: i for i, key in enumerate(self.keys)}
        unknown = [k for k in keys_to_select if k not in where]
        if unknown:
            raise SchemaError(f"keys {unknown[:5]} are not in this batch")
        return self._with(list(keys_to_select), [self.tags[where[k]] for k in keys_to_select])

    def reorder(self, indexes: list[int]) -> None:
        """Put the samples in the order `indexes` (a permutation), in place."""
        if len(indexes) != self.size or len(set(indexes)) != len(indexes):
            raise SchemaError(f"reorder needs a permutation of {self.size} positions, got {len(indexes)} entries")
        self.keys = [self.keys[i] for i in indexes]
        self.tags = [self.tags[i] for i in indexes]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """`chunks` contiguous parts, the first `size % chunks` one sample longer (some may be empty)."""
        base, extra = divmod(self.size, chunks)
        out, start = [], 0
        for i in range(chunks):
            end = start + base + (1 if i < extra else 0)
            out.append(self._with(self.keys[start:end], self.tags[start:end]))
            start = end
        return out

    @classmethod
    def concat(cls, data: list[KVBatchMeta]) -> KVBatchMeta:
        """One batch of all non-empty parts, in order. They must share partition and fields, and
        agree on every `extra_info` key they share (`SchemaError` otherwise)."""
        parts = [m for m in data if m is not None and m.size]
        if not parts:
            return cls()
        first = parts[0]
        extra: dict[str, Any] = {}
        for m in parts:
            if m.partition_id != first.partition_id:
                raise SchemaError(f"cannot concat partitions {first.partition_id!r} and {m.partition_id!r}")
            if m.fields is not None and set(m.fields) != set(first.fields or ()):
                raise SchemaError(f"cannot concat fields {first.fields} and {m.fields}")
            for key, value in (m.extra_info or {}).items():
                if key in extra and not _same(extra[key], value):
                    raise SchemaError(f"extra_info key {key!r} has conflicting values across the batches")
                extra.setdefault(key, value)
        return cls(
            keys=[k for m in parts for k in m.keys],
            tags=[t for m in parts for t in m.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra or None,
        )


def _same(a: Any, b: Any) -> bool:
    try:
        equal = a == b
        return bool(equal.all()) if hasattr(equal, "all") else bool(equal)
    except (RuntimeError, ValueError, TypeError):
        return a is b
