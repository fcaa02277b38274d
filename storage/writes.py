"""Checking a `Write` before anything is allocated, and the shm reservations it may create.

`field_sizes` computes the bytes each field of a Write must carry from its specs and ragged
lengths, and `check_frames` compares them with the data frames that came with it, so a
malformed write fails with a `SchemaError` that says which field is wrong, before the unit
allocates or stores anything. A `Shape` is what the arena must find for a checked write: those
sizes, and where each row ends, for a field placed in several extents.

A `Reservation` is a shm write in progress: its chunks are allocated and their offsets handed
to the co-located client, which copies the bytes in itself and then commits (rows become
readable) or aborts. A timer frees it if the client never comes back.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import Write
from transfer_queue.wire.meta import RAGGED, FieldSpec

from .arena import Chunk

__all__ = ["field_sizes", "check_frames", "frame_nbytes", "Shape", "Reservation"]

_LISTED = 10


def field_sizes(msg: Write) -> list[int]:
    """Bytes each field of `msg` holds, in `msg.fields` order; `SchemaError` if inconsistent."""
    n = len(msg.indexes)
    if len(set(msg.indexes)) != n:
        dup = sorted(i for i, k in Counter(msg.indexes).items() if k > 1)
        raise SchemaError(f"write to partition {msg.partition!r} lists indexes more than once: {dup[:_LISTED]}")
    sizes: list[int] = []
    ragged: set[str] = set()
    for name, spec in msg.fields.items():
        _check_spec(name, spec)
        if not spec.ragged:
            sizes.append(n * spec.row_bytes)
            continue
        ragged.add(name)
        lengths = msg.lengths.get(name)
        if lengths is None:
            raise SchemaError(f"ragged field {name!r} needs per-row lengths in Write.lengths")
        if len(lengths) != n:
            raise SchemaError(f"ragged field {name!r} has {len(lengths)} lengths for {n} rows")
        if lengths and min(lengths) < 0:
            raise SchemaError(f"ragged field {name!r} has a negative length")
        sizes.append(sum(lengths) * spec.row_bytes)
    extra = sorted(set(msg.lengths) - ragged)
    if extra:
        raise SchemaError(f"lengths were given for fields that are not ragged fields of this write: {extra}")
    return sizes


def _check_spec(name: str, spec: FieldSpec) -> None:
    try:
        _ = spec.itemsize  # unsupported dtypes have none
    except KeyError:
        raise SchemaError(f"field {name!r} has unsupported dtype {spec.dtype!r}") from None
    dims = spec.shape[1:] if spec.ragged else spec.shape
    if any(d < 0 for d in dims):
        raise SchemaError(
            f"field {name!r} has invalid shape {list(spec.shape)}: only the first per-sample "
            f"dimension may be ragged ({RAGGED}); every other dimension must be >= 0"
        )


def frame_nbytes(frame: Any) -> int:
    """Bytes in a received data frame (a zmq Frame or any buffer)."""
    return memoryview(frame).nbytes


def check_frames(msg: Write, frames: Sequence[Any], sizes: Sequence[int]) -> None:
    """`SchemaError` unless the data frames match the write: one per field, of the right size."""
    if msg.via == "shm":
        if frames:
            raise SchemaError(f"a shm write carries no data frames, got {len(frames)}")
        return
    if len(frames) != len(sizes):
        raise SchemaError(
            f"write to partition {msg.partition!r} has {len(msg.fields)} field(s) "
            f"{list(msg.fields)} but {len(frames)} data frame(s): send exactly one frame per field, "
            "in the order of Write.fields"
        )
    n = len(msg.indexes)
    for (name, spec), size, frame in zip(msg.fields.items(), sizes, frames):
        got = frame_nbytes(frame)
        if got != size:
            layout = (
                f"sum of lengths x {spec.row_bytes} bytes per element"
                if spec.ragged
                else f"{n} rows x {spec.row_bytes} bytes"
            )
            raise SchemaError(
                f"field {name!r} ({spec.dtype}, shape {list(spec.shape)}) should carry {size} bytes "
                f"({layout}) but its frame has {got}"
            )


class Shape:
    """What a checked write needs from the arena: `sizes` (bytes per field, in `Write.fields`
    order), and where its rows end within each field (`ends`), so that a field no single free
    extent holds can be placed in several, split between rows (`split`: frame writes only; a
    mapped client copies each field into one extent it was given)."""

    __slots__ = ("msg", "sizes", "split")

    def __init__(self, msg: Write, sizes: list[int]):
        self.msg = msg
        self.sizes = sizes
        self.split = msg.via == "frames"

    @property
    def rows(self) -> int:
        return len(self.msg.indexes)

    def ends(self, field: int) -> np.ndarray:
        """Cumulative byte end of each row of field number `field` (int64, one per row)."""
        name, spec = list(self.msg.fields.items())[field]
        if spec.ragged:
            return np.cumsum(np.asarray(self.msg.lengths[name], dtype=np.int64)) * spec.row_bytes
        return np.arange(1, self.rows + 1, dtype=np.int64) * spec.row_bytes


class Reservation:
    """Chunks allocated for a shm write, waiting for `CommitWrite(token)`."""

    __slots__ = ("token", "msg", "chunks", "timer")

    def __init__(self, token: int, msg: Write, chunks: list[Chunk], timer: asyncio.TimerHandle):
        self.token = token
        self.msg = msg
        self.chunks = chunks
        self.timer = timer

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)
