"""TransferQueue's `save_checkpoint` / `load_checkpoint` for the keyed samples, without pickle.

A checkpoint is a directory: `metadata.json` (`{"format", "storage_saved", "user_metadata"}`,
as TransferQueue writes it) and one `partition-<n>.bin` per partition that has keys, laid out
as Sluice's own checkpoint batch files (`_checkpoint.write_file`): a msgpack header (`KvPartition`:
the keys, their tags, and their fields grouped by which fields each key has, each group's
columns described as `encode_columns` lays them out) followed by the groups' raw bytes (non-tensor
fields as msgpack values, `_objects`). Saving replaces the directory atomically (written to
`<dir>.tmp`, then renamed); loading replaces the keys of each saved partition with the saved ones.

Only keyed samples are checkpointed: samples put through Sluice's own `put` without keys, leases
and versions are not part of TransferQueue's KV state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch
from tensordict import TensorDict

from .._checkpoint import decode_columns, encode_columns, read_file, write_file
from ..wire.errors import SchemaError
from ..wire.meta import FieldSpec
from .face import get_client

__all__ = ["save_checkpoint", "load_checkpoint"]

_FORMAT = "sluice-kv/2"
_METADATA = "metadata.json"


def save_checkpoint(
    checkpoint_dir: str | Path, *, include_storage: bool = True, metadata: dict[str, Any] | None = None
) -> None:
    """Write every partition's keys, tags and data to `checkpoint_dir` (replaced atomically).

    `include_storage` is accepted for TransferQueue's signature; Sluice's storage is in memory,
    so the data is always saved. `metadata` goes to `metadata.json` as `user_metadata`.
    Raises `ClosedError` before `init`, `OSError` when the directory cannot be written.
    """
    client = get_client()
    target = Path(checkpoint_dir)
    tmp = target.parent / f"{target.name}.tmp"
    old = target.parent / f"{target.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for n, (partition, tags_of) in enumerate(sorted(client.kv_list().items())):
            header, buffers = _partition(client, partition, tags_of)
            write_file(tmp / f"partition-{n}.bin", header, buffers)
        meta = {"format": _FORMAT, "storage_saved": True, "user_metadata": metadata or {}}
        (tmp / _METADATA).write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not target.exists():
            old.rename(target)
        raise


def load_checkpoint(checkpoint_dir: str | Path) -> None:
    """Replace the keys of every partition saved in `checkpoint_dir` with the saved keys, data and tags.

    Raises `FileNotFoundError` for a missing directory or `metadata.json`, `SchemaError` for a
    directory that is not a Sluice KV checkpoint, `ClosedError` before `init`.
    """
    client = get_client()
    source = Path(checkpoint_dir)
    old = source.parent / f"{source.name}.old"
    if not source.exists() and old.exists():  # a save died between its two renames
        old.rename(source)
    meta_path = source / _METADATA
    if not meta_path.exists():
        raise FileNotFoundError(f"{_METADATA} not found in {source}")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != _FORMAT:
        raise SchemaError(
            f"{source} is not a Sluice KV checkpoint (format {meta.get('format')!r}, expected {_FORMAT!r})"
        )
    for path in sorted(source.glob("partition-*.bin")):
        header, raw, offset = read_file(path, KvPartition, "a Sluice KV checkpoint partition")
        partition, keys = header.partition, header.keys
        groups: list[tuple[list[str], TensorDict]] = []
        try:
            for group in header.groups:
                group_keys = [keys[p] for p in group.positions]
                data, offset = decode_columns(
                    path, group.fields, len(group_keys), group.sizes, group.lengths, raw, offset
                )
                groups.append((group_keys, data))
        except (IndexError, ValueError, RuntimeError) as exc:  # positions or lengths that do not fit
            raise SchemaError(f"{path} is not a Sluice KV checkpoint partition: {exc}") from exc
        if offset != len(raw) or len(header.tags) != len(keys):
            raise SchemaError(f"{path} is not a Sluice KV checkpoint partition: its header does not describe it")
        current = client.kv_list(partition).get(partition, {})
        if current:
            client.kv_clear(list(current), partition)
        for group_keys, batch in groups:
            client.kv_batch_put(group_keys, partition, batch, None)
        if keys:
            client.kv_batch_put(keys, partition, None, header.tags)


class KvGroup(msgspec.Struct):
    """Keys (by position) that have the same fields, and how their columns lie in the file."""

    positions: list[int]
    fields: dict[str, FieldSpec]
    sizes: list[int]
    lengths: dict[str, list[int]]


class KvPartition(msgspec.Struct):
    """The header of a partition's file: its keys, their tags, their fields by group."""

    partition: str
    keys: list[str]
    tags: list[dict]
    groups: list[KvGroup]


def _partition(client: Any, partition: str, tags_of: dict[str, dict]) -> tuple[KvPartition, list[torch.Tensor]]:
    keys = list(tags_of)
    groups: list[KvGroup] = []
    buffers: list[torch.Tensor] = []
    if keys:
        reply = client.kv_resolve(keys, partition)
        have: list[set[str]] = [set(reply.meta.fields) for _ in keys]
        for name, positions in reply.partial.items():
            for p in positions:
                have[p].add(name)
        by_fields: dict[frozenset[str], list[int]] = {}
        for p, names in enumerate(have):
            by_fields.setdefault(frozenset(names), []).append(p)
        for selected, positions in by_fields.items():
            if not selected:
                continue
            data = client.kv_batch_get([keys[p] for p in positions], partition, sorted(selected))
            fields, sizes, lengths, columns = encode_columns(data)
            groups.append(KvGroup(positions, fields, sizes, lengths))
            buffers.extend(columns)
    return KvPartition(partition, keys, [tags_of[k] for k in keys], groups), buffers
