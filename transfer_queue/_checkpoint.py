"""The checkpoint files `save_checkpoint` writes and `restore_checkpoint` reads.

A checkpoint is a directory: `manifest.json` (the trainer version and, per partition, whether it
is sealed, which batch files it has and which samples each consumer task had consumed) and one
file per batch of samples that share their ready fields. A batch file is a little-endian u64
header length, the msgpack header (`BatchHeader`: the samples' `BatchMeta` and each field's byte
size and ragged lengths) and the fields' raw bytes, in header order: the tensors' wire layout,
never pickled. Leased samples are saved as not consumed, so they are delivered again after a
restore; puts not yet committed are not saved (they would have been refused or expired).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

from ._errors import SchemaError
from ._meta import BatchMeta
from ._tensors import Assembler, Columns

__all__ = ["Manifest", "PartitionState", "write_batch", "read_batch", "write_manifest", "read_manifest"]

_LEN = struct.Struct("<Q")


class PartitionState(msgspec.Struct):
    sealed: bool
    batches: list[str]
    consumed: dict[str, list[int]]
    """Consumer task -> global indexes (at save time) it had consumed."""


class Manifest(msgspec.Struct):
    version: int
    partitions: dict[str, PartitionState]


class BatchHeader(msgspec.Struct):
    meta: BatchMeta
    sizes: list[int]
    lengths: dict[str, list[int]]


def write_batch(path: Path, meta: BatchMeta, data: TensorDict) -> None:
    """One batch file: header, then each field's bytes."""
    cols = Columns(data)
    buffers, lengths = cols.slice(np.arange(cols.n))
    header = msgspec.msgpack.encode(BatchHeader(meta, [b.numel() for b in buffers], lengths))
    with open(path, "wb") as f:
        f.write(_LEN.pack(len(header)))
        f.write(header)
        for buf in buffers:
            f.write(buf.numpy().tobytes())


def read_batch(path: Path) -> tuple[BatchMeta, TensorDict]:
    """The batch file's metadata and samples; `SchemaError` if the file is not one."""
    raw = memoryview(Path(path).read_bytes())
    try:
        (size,) = _LEN.unpack(raw[: _LEN.size])
        header = msgspec.msgpack.decode(raw[_LEN.size : _LEN.size + size], type=BatchHeader)
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"{path} is not a Sluice checkpoint batch: {exc}") from exc
    meta, offset = header.meta, _LEN.size + size
    runs = {}
    for name, nbytes in zip(meta.fields, header.sizes):
        runs[name] = [torch.frombuffer(bytearray(raw[offset : offset + nbytes]), dtype=torch.uint8)]
        offset += nbytes
    if offset != len(raw):
        raise SchemaError(f"{path} holds {len(raw)} bytes, its header describes {offset}")
    assembler = Assembler(meta.fields, len(meta))
    assembler.add_unit(np.arange(len(meta)), header.lengths, runs)
    return meta, assembler.result()


def write_manifest(directory: Path, manifest: Manifest) -> None:
    tmp = directory / "manifest.json.tmp"
    tmp.write_bytes(msgspec.json.encode(manifest))
    os.replace(tmp, directory / "manifest.json")  # the manifest appears last, whole


def read_manifest(directory: Path) -> Manifest:
    try:
        return msgspec.json.decode((Path(directory) / "manifest.json").read_bytes(), type=Manifest)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"{directory} holds no Sluice checkpoint (manifest.json): {exc}") from exc
