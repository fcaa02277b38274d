"""The checkpoint files `save_checkpoint` writes and `restore_checkpoint` reads.

A checkpoint is a directory: `manifest.json` (the trainer version and, per partition, whether it
is sealed, which batch files it has and which samples each consumer task had consumed) and one
file per batch of samples that share their ready fields. A batch file is a little-endian u64
header length, the msgpack header (`BatchHeader`: the samples' `BatchMeta` and each field's byte
size and ragged lengths, and per sample whether it has a policy version and which prompt it came
from, for the `requeue` policy) and the fields' raw bytes, in header order: the tensors' wire
layout, never pickled. A partial rollout's version span (first, last) is kept per sample. Leased samples are saved as not consumed, so they are delivered again after a
restore; puts not yet committed are not saved (they would have been refused or expired).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

from ._tensors import Assembler, Columns
from .wire.errors import SchemaError
from .wire.messages import ExportRows
from .wire.meta import BatchMeta, FieldSpec

__all__ = [
    "Manifest",
    "PartitionState",
    "write_batch",
    "read_batch",
    "write_file",
    "read_file",
    "encode_columns",
    "decode_columns",
    "write_manifest",
    "read_manifest",
    "restore_order",
    "RestorePut",
    "restore_puts",
]

_LEN = struct.Struct("<Q")
_Header = TypeVar("_Header")


class PartitionState(msgspec.Struct):
    sealed: bool
    batches: list[str]
    consumed: dict[str, list[int]]
    """Consumer task -> global indexes (at save time) it had consumed."""
    sources: list[str] = []
    """Partitions holding the prompts its samples came from (restored first)."""


class Manifest(msgspec.Struct):
    version: int
    partitions: dict[str, PartitionState]


class BatchHeader(msgspec.Struct):
    meta: BatchMeta
    sizes: list[int]
    lengths: dict[str, list[int]]
    rows: ExportRows | None = None
    """Per sample: versioned or not, prompt source (into `sources`) and its index."""
    sources: list[tuple[str, str]] = []
    """(partition, task) of the prompt batches the samples came from."""


def write_batch(
    path: Path,
    meta: BatchMeta,
    data: TensorDict,
    rows: ExportRows | None = None,
    sources: Sequence[tuple[str, str]] = (),
) -> None:
    """One batch file: header, then each field's bytes."""
    _, sizes, lengths, buffers = encode_columns(data)
    write_file(path, BatchHeader(meta, sizes, lengths, rows, list(sources)), buffers)


def read_batch(path: Path) -> tuple[BatchHeader, TensorDict]:
    """The batch file's header and samples; `SchemaError` if the file is not one."""
    header, raw, offset = read_file(path, BatchHeader, "a Sluice checkpoint batch")
    meta = header.meta
    data, offset = decode_columns(path, meta.fields, len(meta), header.sizes, header.lengths, raw, offset)
    if offset != len(raw):
        raise SchemaError(f"{path} holds {len(raw)} bytes, its header describes {offset}")
    return header, data


# -- the file layout and the column encoding, shared with TransferQueue's KV checkpoint -------


def write_file(path: Path, header: msgspec.Struct, buffers: list[torch.Tensor]) -> None:
    """A little-endian u64 header length, the msgpack `header`, then the `buffers`' bytes."""
    encoded = msgspec.msgpack.encode(header)
    with open(path, "wb") as f:
        f.write(_LEN.pack(len(encoded)))
        f.write(encoded)
        for buf in buffers:
            f.write(buf.numpy().tobytes())


def read_file(path: Path, kind: type[_Header], what: str) -> tuple[_Header, memoryview, int]:
    """A file `write_file` wrote: its header (of type `kind`), all its bytes and where the
    buffers start; `SchemaError` saying the file is not `what` otherwise."""
    raw = memoryview(Path(path).read_bytes())
    try:
        (size,) = _LEN.unpack(raw[: _LEN.size])
        header = msgspec.msgpack.decode(raw[_LEN.size : _LEN.size + size], type=kind)
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"{path} is not {what}: {exc}") from exc
    return header, raw, _LEN.size + size


def encode_columns(
    data: TensorDict,
) -> tuple[dict[str, FieldSpec], list[int], dict[str, list[int]], list[torch.Tensor]]:
    """A batch's columns in their wire layout (never pickled; non-tensor fields as msgpack):
    each field's schema, byte size and per-sample ragged lengths, and its bytes."""
    cols = Columns(data)
    buffers, lengths = cols.slice(np.arange(cols.n))
    return cols.specs, [b.numel() for b in buffers], lengths, buffers


def decode_columns(
    path: Path,
    fields: dict[str, FieldSpec],
    n: int,
    sizes: list[int],
    lengths: dict[str, list[int]],
    raw: memoryview,
    offset: int,
) -> tuple[TensorDict, int]:
    """The `n` samples `encode_columns` laid out at `offset` of `raw` (the file `path`), and the
    offset after them; `SchemaError` if the file is shorter than that."""
    end = offset + sum(sizes)
    if len(sizes) != len(fields) or end > len(raw):
        raise SchemaError(f"{path} holds {len(raw)} bytes, its header describes {end} ({len(sizes)} fields)")
    runs = {}
    for name, nbytes in zip(fields, sizes):
        runs[name] = [torch.frombuffer(bytearray(raw[offset : offset + nbytes]), dtype=torch.uint8)]
        offset += nbytes
    assembler = Assembler(fields, n)
    assembler.add_unit(np.arange(n), lengths, runs)
    return assembler.result(), offset


def restore_order(manifest: Manifest) -> list[str]:
    """Partitions in an order that restores prompt partitions before the samples made from them
    (a cycle is broken in name order; a missing source just loses the link)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order or name in visiting or name not in manifest.partitions:
            return
        visiting.add(name)
        for src in manifest.partitions[name].sources:
            visit(src)
        order.append(name)

    for name in sorted(manifest.partitions):
        visit(name)
    return order


class RestorePut(msgspec.Struct):
    """One put of a restore: samples of a batch file sharing a version span and a prompt source."""

    positions: list[int]
    policy_version: tuple[int, int] | None
    """(first, last); None for samples put without a version (prompts: never stale)."""
    source: BatchMeta | None
    """The restored prompts they came from (new indexes), for the `requeue` policy."""


def restore_puts(header: BatchHeader, restored: dict[str, dict[int, int]]) -> list[RestorePut]:
    """Split a batch file's samples into puts that keep each sample's version span, whether it
    is versioned, and its prompt source mapped to the prompt's new index in `restored`
    (partition -> old index -> new index); a prompt that is not there loses the link."""
    meta, rows = header.meta, header.rows
    groups: dict[tuple, RestorePut] = {}
    for p in range(len(meta)):
        span: tuple[int, int] | None = (meta.policy_versions[p], meta.version_last[p])
        if rows is not None and not rows.versioned[p]:
            span = None
        src_key, src_index = None, -1
        if rows is not None and rows.source[p] >= 0:
            src_part, src_task = header.sources[rows.source[p]]
            src_index = restored.get(src_part, {}).get(rows.source_index[p], -1)
            if src_index >= 0:
                src_key = (src_part, src_task)
        group = groups.setdefault((span, src_key), RestorePut([], span, None))
        group.positions.append(p)
        if src_key is not None:
            if group.source is None:
                group.source = BatchMeta(src_key[0], [], [], [], [], [], {}, task=src_key[1])
            group.source.indexes.append(src_index)
    return list(groups.values())


def write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / "manifest.json.tmp"
    tmp.write_bytes(msgspec.json.encode(manifest))
    os.replace(tmp, directory / "manifest.json")  # the manifest appears last, whole


def read_manifest(directory: Path) -> Manifest:
    try:
        return msgspec.json.decode((Path(directory) / "manifest.json").read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"{directory} holds no Sluice checkpoint (manifest.json): {exc}") from exc
