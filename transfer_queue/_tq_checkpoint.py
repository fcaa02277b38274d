"""TransferQueue's `save_checkpoint` / `load_checkpoint` for the keyed samples, without pickle.

A checkpoint is a directory: `metadata.json` (`{"format", "storage_saved", "user_metadata"}`,
as TransferQueue writes it) and one `partition-<n>.msgpack` per partition that has keys: the
keys, their tags, and their fields grouped by which fields each key has. Tensors are stored as
raw bytes with dtype and shape (jagged fields as values and offsets), non-tensor fields as
msgpack values (`_objects`). Saving replaces the directory atomically (written to `<dir>.tmp`,
then renamed); loading replaces the keys of each saved partition with the saved ones.

Only keyed samples are checkpointed: samples put through Sluice's own `put` without keys, leases
and versions are not part of TransferQueue's KV state.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from ._errors import SchemaError
from ._objects import pack, unpack
from ._tensors import as_bytes, dtype_name, torch_dtype
from ._tq_face import get_client

__all__ = ["save_checkpoint", "load_checkpoint"]

_FORMAT = "sluice-kv/1"
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
            (tmp / f"partition-{n}.msgpack").write_bytes(pack(_partition_record(client, partition, tags_of)))
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
    for path in sorted(source.glob("partition-*.msgpack")):
        try:
            record = unpack(path.read_bytes())
            partition, keys = record["partition"], record["keys"]
            tags = record["tags"] if keys else None
            groups: list[tuple[list[str], TensorDict]] = []
            for group in record["groups"]:
                group_keys = [keys[p] for p in group["positions"]]
                data = {name: _column_from(col, len(group_keys)) for name, col in group["fields"].items()}
                groups.append((group_keys, TensorDict(data, batch_size=[len(group_keys)])))
        except (msgspec.DecodeError, KeyError, IndexError, TypeError) as exc:
            raise SchemaError(f"{path} is not a Sluice KV checkpoint partition: {exc}") from exc
        current = client.kv_list(partition).get(partition, {})
        if current:
            client.kv_clear(list(current), partition)
        for group_keys, batch in groups:
            client.kv_batch_put(group_keys, partition, batch, None)
        if keys:
            client.kv_batch_put(keys, partition, None, tags)


def _partition_record(client: Any, partition: str, tags_of: dict[str, dict]) -> dict[str, Any]:
    keys = list(tags_of)
    groups: list[dict[str, Any]] = []
    if keys:
        reply = client.kv_resolve(keys, partition)
        have: list[set[str]] = [set(reply.meta.fields) for _ in keys]
        for name, positions in reply.partial.items():
            for p in positions:
                have[p].add(name)
        by_fields: dict[frozenset[str], list[int]] = {}
        for p, names in enumerate(have):
            by_fields.setdefault(frozenset(names), []).append(p)
        for names, positions in by_fields.items():
            if not names:
                continue
            data = client.kv_batch_get([keys[p] for p in positions], partition, sorted(names))
            groups.append({"positions": positions, "fields": {n: _column_record(v) for n, v in data.items()}})
    return {"partition": partition, "keys": keys, "tags": [tags_of[k] for k in keys], "groups": groups}


def _column_record(value: Any) -> dict[str, Any]:
    if isinstance(value, NonTensorData):
        return {"kind": "data", "value": value.data}
    if isinstance(value, NonTensorStack):
        return {"kind": "stack", "values": value.tolist()}
    if value.is_nested:
        values = value.values()
        return {
            "kind": "jagged",
            "dtype": dtype_name(value.dtype),
            "inner": list(values.shape[1:]),
            "offsets": value.offsets().numpy().tobytes(),
            "values": as_bytes(values).numpy().tobytes(),
        }
    return {
        "kind": "dense",
        "dtype": dtype_name(value.dtype),
        "shape": list(value.shape),
        "data": as_bytes(value).numpy().tobytes(),
    }


def _column_from(record: dict[str, Any], n: int) -> Any:
    kind = record["kind"]
    if kind == "data":
        return NonTensorData(record["value"], batch_size=[n])
    if kind == "stack":
        return NonTensorStack(*(NonTensorData(v) for v in record["values"]), stack_dim=0)
    dtype = torch_dtype(record["dtype"])
    if kind == "jagged":
        values = _tensor(record["values"], dtype).reshape(-1, *record["inner"])
        offsets = torch.from_numpy(np.frombuffer(record["offsets"], np.int64).copy())
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return _tensor(record["data"], dtype).reshape(record["shape"])


def _tensor(raw: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not raw:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
