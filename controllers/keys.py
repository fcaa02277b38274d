"""The key index: TransferQueue's user keys and tags over the controller's sample tables.

A key names one sample (one row) of a partition. Each partition has its own `KeyIndex`
(key -> global index, global index -> key, key -> tags); the rows themselves live in the
partition's `table.Partition` like every other sample, so a keyed sample is read, written (new
columns via `put(meta=...)`), leased and freed exactly as Sluice's own samples are. Keyed rows
carry no policy version (never stale) and are committed when created, so their fields become
consumable by `get_meta` as soon as they are ready.

Tags are msgpack-typed metadata (None, bool, int, float, str, lists and dicts of these); they
are merged per key (dict update) and only after the data they describe is written, so a reader
that sees a tag (verl's replay buffer polling `kv_list` for `status: finished`) finds the data.

`KeyService` answers the `Kv*` messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, overload

import numpy as np

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import (
    KvClear,
    KvKeys,
    KvKeysReply,
    KvList,
    KvListReply,
    KvMetaReply,
    KvResolve,
    KvTag,
    Ok,
)
from transfer_queue.wire.meta import BatchMeta

from .ledger import Ledger
from .placement import place_rows
from .records import Keyed, Record, Tagged
from .table import Partition

__all__ = ["KeyIndex", "KeyService"]


class KeyIndex:
    """The keys of one partition object (a cleared and recreated partition starts afresh)."""

    def __init__(self, part: Partition):
        self.part = part
        self.index: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.tags: dict[str, dict[str, Any]] = {}

    def add(self, key: str, gidx: int) -> None:
        self.index[key] = gidx
        self.key_of[gidx] = key
        self.tags[key] = {}

    def drop(self, key: str) -> None:
        gidx = self.index.pop(key)
        del self.key_of[gidx]
        del self.tags[key]

    def live_keys(self) -> list[str]:
        """Keys whose rows are alive; keys of rows freed meanwhile (`clear`) are forgotten."""
        self.lookup(list(self.index))
        return list(self.index)

    def lookup(self, keys: list[str]) -> tuple[list[int], list[str]]:
        """Global indexes of the keys that have a live row, and the keys that have none."""
        known = [k for k in keys if k in self.index]
        if known:
            gidx = np.fromiter((self.index[k] for k in known), np.int64, len(known))
            alive = self.part.holds(gidx)
            for key in [k for k, ok in zip(known, alive.tolist()) if not ok]:
                self.drop(key)  # its row was freed meanwhile (Sluice's `clear`)
        found = [self.index[k] for k in keys if k in self.index]
        return found, [k for k in keys if k not in self.index]


class KeyService:
    """Handlers for `KvResolve`, `KvTag`, `KvList`, `KvKeys` and `KvClear`."""

    def __init__(self, ledger: Ledger, wake: Callable[[str], None], record: Callable[[Record], None]):
        """`wake` re-evaluates the consumers parked on a partition (`Scheduler.wake`); `record`
        journals a change."""
        self.ledger = ledger
        self._wake = wake
        self._record = record
        self.indexes: dict[str, KeyIndex] = {}

    def handlers(self) -> dict[type, Callable]:
        """The requests this part answers, by message type."""
        return {
            KvResolve: self.on_resolve,
            KvTag: self.on_tag,
            KvList: self.on_list,
            KvKeys: self.on_keys,
            KvClear: self.on_clear,
        }

    @overload
    def _index(self, partition: str, create: Literal[True]) -> KeyIndex: ...
    @overload
    def _index(self, partition: str, create: bool) -> KeyIndex | None: ...
    def _index(self, partition: str, create: bool) -> KeyIndex | None:
        part = self.ledger.partitions.get(partition)
        if part is None:
            if not create:
                return None
            part = self.ledger.partition(partition)
        index = self.indexes.get(partition)
        if index is None or index.part is not part:
            index = self.indexes[partition] = KeyIndex(part)
        return index

    def _create_rows(self, index: KeyIndex, keys: list[str]) -> None:
        """New rows without fields for `keys`, spread evenly over the storage units."""
        if not self.ledger.units:
            raise SchemaError("the cluster has no storage units registered yet")
        n = len(keys)
        units = place_rows(self.ledger.unit_bytes, n, 0)
        first = self.ledger.new_rows(index.part, units, {}, {}, {}, committed=True)
        for key, gidx in zip(keys, range(first, first + n)):
            index.add(key, gidx)
        self._record(Keyed(index.part.name, keys, list(range(first, first + n))))

    def restore(self, partition: str, keys: list[str], indexes: list[int]) -> None:
        """Give `keys` to rows already in the table (journal replay)."""
        index = self._index(partition, True)
        for key, gidx in zip(keys, indexes):
            if key in index.index:  # put again after its row was freed: the old entry goes
                index.drop(key)
            index.add(key, gidx)

    def live(self) -> dict[str, KeyIndex]:
        """The key index of each partition that still exists."""
        return {name: i for name, i in self.indexes.items() if self.ledger.partitions.get(name) is i.part}

    def on_resolve(self, msg: KvResolve, data) -> KvMetaReply:
        if len(set(msg.keys)) != len(msg.keys):
            raise SchemaError(
                f"duplicate keys in one request: {sorted({k for k in msg.keys if msg.keys.count(k) > 1})[:5]}"
            )
        index = self._index(msg.partition, msg.create)
        if index is None:
            raise SchemaError(f"no partition named {msg.partition!r} (keys {msg.keys[:5]} not found)")
        _, missing = index.lookup(msg.keys)
        if missing:
            if not msg.create:
                raise SchemaError(f"partition {msg.partition!r} has no key(s) {missing[:5]} ({len(missing)} missing)")
            if index.part.sealed:
                raise SchemaError(f"partition {msg.partition!r} is sealed; no new keys may be added")
            self._create_rows(index, missing)
        part = index.part
        gidx = [index.index[k] for k in msg.keys]
        rows = part.rows_of(gidx)
        fields, partial = {}, {}
        for name, spec in part.schema.items():
            ready = part.ready[name][rows]
            if ready.all():
                fields[name] = spec
            elif ready.any():
                partial[name] = np.flatnonzero(ready).tolist()
        meta = BatchMeta(
            partition=msg.partition,
            indexes=gidx,
            policy_versions=part.v_first[rows].tolist(),
            version_last=part.v_last[rows].tolist(),
            groups=part.group[rows].tolist(),
            units=part.unit[rows].tolist(),
            fields=fields,
        )
        return KvMetaReply(meta, [index.tags[k] for k in msg.keys], partial)

    def on_tag(self, msg: KvTag, data) -> Ok:
        if len(msg.tags) != len(msg.keys):
            raise SchemaError(f"{len(msg.tags)} tags for {len(msg.keys)} keys")
        index = self._index(msg.partition, False)
        _, missing = index.lookup(msg.keys) if index is not None else ([], msg.keys)
        if missing:
            raise SchemaError(f"partition {msg.partition!r} has no key(s) {missing[:5]}; put them first")
        self.tag(msg.partition, msg.keys, msg.tags)
        self._record(Tagged(msg.partition, msg.keys, msg.tags))
        return Ok()

    def tag(self, partition: str, keys: list[str], tags: list[dict[str, Any]]) -> None:
        """Merge `tags` into the tags of `keys`, which `partition` has."""
        index = self._index(partition, False)
        if index is None:
            return
        for key, tag in zip(keys, tags):
            index.tags[key].update(tag)

    def on_list(self, msg: KvList, data) -> KvListReply:
        names = list(self.indexes) if msg.partition is None else [msg.partition]
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for name in names:
            index = self._index(name, False)
            if index is None:
                continue
            keys = index.live_keys()
            if keys or msg.partition is not None:
                out[name] = {k: index.tags[k] for k in keys}
        return KvListReply(out)

    def on_keys(self, msg: KvKeys, data) -> KvKeysReply:
        index = self._index(msg.partition, False)
        key_of = index.key_of if index is not None else {}
        missing = [i for i in msg.indexes if i not in key_of]
        if missing:
            raise SchemaError(f"partition {msg.partition!r} has no keys for global indexes {missing[:5]}")
        return KvKeysReply([key_of[i] for i in msg.indexes])

    def on_clear(self, msg: KvClear, data) -> Ok:
        index = self._index(msg.partition, False)
        if index is None:
            return Ok()
        found, _ = index.lookup(list(dict.fromkeys(msg.keys)))
        for gidx in found:
            index.drop(index.key_of[gidx])
        if found:
            part = index.part
            self.ledger.free_rows(part, part.rows_of(found, alive=False))
            self._wake(part.name)
        return Ok()
