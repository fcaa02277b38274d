"""Tensor bytes in and out of storage: slicing a batch per unit, assembling reads into a batch.

Dense fields travel as the raw bytes of `rows x per-sample shape`; ragged fields (jagged nested
tensors) as their concatenated values plus per-row lengths. Nothing here serializes objects:
a buffer is a byte view of a tensor that already exists.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from tensordict import TensorDict

from ._objects import decode_values, encode_values
from .cuda import check_tensor_device, is_cuda, pinned_source
from .wire.errors import SchemaError
from .wire.meta import ITEMSIZE, OBJECT_DTYPES, RAGGED, FieldSpec
from .wire.sizes import arena_bytes

if TYPE_CHECKING:  # a jagged tensor's class: torch's stubs give `Tensor` no `offsets()`
    from torch.nested._internal.nested_tensor import NestedTensor

# Received frames are read-only buffers; torch warns on viewing them although we only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

__all__ = [
    "Columns",
    "as_bytes",
    "Assembler",
    "BufferPool",
    "torch_dtype",
    "dtype_name",
    "field_spec_of",
    "jagged",
]

_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in ITEMSIZE if name not in OBJECT_DTYPES}
_NAMES = {v: k for k, v in _DTYPES.items()}
_DTYPES.update(dict.fromkeys(OBJECT_DTYPES, torch.uint8))  # non-tensor values travel as msgpack bytes


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name (raises `KeyError` for unsupported names)."""
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (raises `KeyError` for unsupported dtypes)."""
    return _NAMES[dtype]


def field_spec_of(tensor: torch.Tensor) -> FieldSpec:
    """The per-sample `FieldSpec` of a batched tensor (dense, or a jagged nested tensor)."""
    if tensor.is_nested:
        if getattr(tensor, "_ragged_idx", 1) != 1:
            raise ValueError("only nested tensors ragged along dim 1 (per-sample dim 0) are supported")
        return FieldSpec(dtype_name(tensor.dtype), (RAGGED, *tensor.values().shape[1:]))
    return FieldSpec(dtype_name(tensor.dtype), tuple(tensor.shape[1:]))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (copies only if not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _consecutive(pos: np.ndarray) -> bool:
    return len(pos) == 0 or int(pos[-1]) - int(pos[0]) == len(pos) - 1


@dataclass
class _Column:
    spec: FieldSpec
    dense: torch.Tensor | None = None
    values: torch.Tensor | None = None
    offsets: np.ndarray | None = None

    @property
    def lengths(self) -> np.ndarray:
        assert self.offsets is not None  # asked of ragged columns only
        return np.diff(self.offsets)


class Columns:
    """A validated batch to put: per field its schema and tensor, sliceable by batch positions."""

    def __init__(self, data: TensorDict | Mapping[str, torch.Tensor]):
        if isinstance(data, TensorDict):
            if data.batch_dims != 1:
                raise SchemaError(
                    f"put needs a TensorDict with one batch dimension, got batch_size {list(data.batch_size)}"
                )
            items = list(data.items())
            self.n = int(data.batch_size[0])
        else:
            items = list(data.items())
            self.n = _rows(*items[0]) if items else 0
        if self.n <= 0:
            raise SchemaError(f"put needs at least one sample, got batch_size {self.n}")
        if not items:
            raise SchemaError("put needs at least one field")
        self.columns: dict[str, _Column] = {}
        self.device: torch.device | None = None  # the CUDA device of the batch's GPU tensors, if any
        for name, tensor in items:
            if not isinstance(name, str) or not name:
                raise SchemaError(f"field names must be non-empty strings, got {name!r}")
            if not isinstance(tensor, torch.Tensor) or is_non_tensor(tensor):
                self.columns[name] = _object_column(name, tensor, self.n)
                continue
            if tensor.is_nested and tensor.layout != torch.jagged:
                raise SchemaError(
                    f"field {name!r} is a nested tensor of layout {tensor.layout}; only jagged ones are "
                    "supported: build it with torch.nested.nested_tensor(..., layout=torch.jagged)"
                )
            if tensor.dim() == 0:
                raise SchemaError(
                    f"field {name!r} is a 0-dim tensor; a field needs a batch dimension of {self.n} samples"
                )
            try:
                spec = field_spec_of(tensor)
            except (KeyError, ValueError) as exc:
                raise SchemaError(
                    f"field {name!r}: unsupported tensor ({tensor.dtype}, nested={tensor.is_nested}): {exc}"
                ) from exc
            if spec.inner_numel == 0:
                raise SchemaError(
                    f"field {name!r} has per-sample shape {list(tensor.shape[1:])}, which holds no elements; "
                    "drop the field or give it at least one element per sample"
                )
            check_tensor_device(name, tensor)
            if is_cuda(tensor):  # stays in GPU memory: copied once, straight to its destination
                self.device = tensor.device
            if tensor.is_nested:
                if cast("NestedTensor", tensor).lengths() is not None:  # rows with holes between them
                    tensor = tensor.contiguous()  # (torch.nested.narrow's): packed, so offsets say it all
                offsets = cast("NestedTensor", tensor).offsets().cpu().numpy().astype(np.int64)
                if len(offsets) != self.n + 1:
                    raise SchemaError(f"field {name!r} has {len(offsets) - 1} samples, the batch has {self.n}")
                values = tensor.values().contiguous()
                if offsets[0] != 0:
                    values, offsets = values[offsets[0] : offsets[-1]], offsets - offsets[0]
                self.columns[name] = _Column(spec, values=values, offsets=offsets)
            else:
                if tensor.shape[0] != self.n:
                    raise SchemaError(f"field {name!r} has shape {list(tensor.shape)}, the batch has {self.n} samples")
                self.columns[name] = _Column(spec, dense=tensor.contiguous())
        self.specs: dict[str, FieldSpec] = {name: col.spec for name, col in self.columns.items()}
        """Each field's schema, in the batch's order (shared by the messages of one put)."""

    def field_bytes(self) -> dict[str, int]:
        """Each field's arena bytes per sample (ragged fields by their actual size): its bytes
        over all samples rounded up as a unit's arena stores them (`arena_bytes`), then divided
        by the samples, rounded up, so the controller's account of a put (rows x each field's
        bytes) covers what its unit really uses, and writing a field again replaces its count."""
        sizes = {}
        for name, col in self.columns.items():
            if col.dense is not None:
                nbytes = col.spec.row_bytes * self.n
            else:
                assert col.offsets is not None  # a column is dense or ragged
                nbytes = int(col.offsets[-1]) * col.spec.row_bytes
            sizes[name] = -(-arena_bytes(nbytes) // self.n)
        return sizes

    def seqlens(self) -> list[int]:
        """Tokens per sample for seqlen balancing: the longest ragged field, else the sum of an
        `attention_mask`, else 0."""
        ragged = [col.lengths for col in self.columns.values() if col.offsets is not None]
        if ragged:
            return np.max(np.stack(ragged), axis=0).tolist()
        mask = self.columns.get("attention_mask")
        if mask is not None and mask.dense is not None:
            return mask.dense.reshape(self.n, -1).sum(dim=1).tolist()
        return [0] * self.n

    def lengths(self) -> dict[str, list[int]]:
        """Per-row lengths of the ragged fields, all rows (what a write of the whole batch carries)."""
        return {name: col.lengths.tolist() for name, col in self.columns.items() if col.offsets is not None}

    def slice(self, positions: np.ndarray | None = None) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
        """Per field, one byte buffer of the rows at `positions` (in that order; None: all rows),
        and the per-row lengths of the ragged fields. A run of consecutive positions is a view,
        not a copy. A CUDA field's buffer is in GPU memory."""
        if positions is None:
            return self._whole()
        buffers: list[torch.Tensor] = []
        lengths: dict[str, list[int]] = {}
        contiguous = _consecutive(positions)
        for name, col in self.columns.items():
            if col.dense is not None:
                if contiguous:
                    rows = col.dense[int(positions[0]) : int(positions[0]) + len(positions)]
                else:
                    rows = col.dense.index_select(0, torch.from_numpy(positions).to(col.dense.device))
                buffers.append(as_bytes(rows))
                continue
            offs, values = col.offsets, col.values
            assert offs is not None and values is not None  # a column is dense or ragged
            lengths[name] = (offs[positions + 1] - offs[positions]).tolist()
            if contiguous:
                vals = values[int(offs[positions[0]]) : int(offs[positions[-1] + 1])]
            else:
                vals = torch.cat([values[int(offs[p]) : int(offs[p + 1])] for p in positions])
            buffers.append(as_bytes(vals))
        return buffers, lengths

    def _whole(self) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
        """`slice` of all rows: each field's bytes as they are (views, no index work)."""
        buffers: list[torch.Tensor] = []
        lengths: dict[str, list[int]] = {}
        for name, col in self.columns.items():
            if col.dense is not None:
                buffers.append(as_bytes(col.dense))
                continue
            assert col.values is not None and col.offsets is not None  # a column is dense or ragged
            lengths[name] = col.lengths.tolist()
            buffers.append(as_bytes(col.values[: int(col.offsets[-1])]))
        return buffers, lengths


def is_non_tensor(value: Any) -> bool:
    """Whether a TensorDict entry is a `NonTensorData`/`NonTensorStack` (not a tensor's data)."""
    return getattr(value, "_is_non_tensor", False) or type(value).__name__ in ("NonTensorData", "NonTensorStack")


_FIELD_VALUES = (
    "a field holds one row per sample: a tensor with the samples along dim 0, a jagged nested tensor "
    "(torch.nested.nested_tensor([...], layout=torch.jagged)) for ragged rows, or per-sample non-tensor "
    "values as a list, a numpy array or a NonTensorStack (a NonTensorData for one value for the batch)"
)


def _rows(name: str, value: Any) -> int:
    """Samples in the field `name`'s value; 0 for a 0-dim tensor (no batch dimension), refused later.

    Raises:
        SchemaError: the value has no samples to count (a scalar, say)."""
    if isinstance(value, torch.Tensor):  # nested ones too, which have no `shape`
        return int(value.size(0)) if value.dim() > 0 else 0
    if hasattr(value, "shape") and len(value.shape):
        return int(value.shape[0])
    try:
        return len(value)
    except TypeError:
        raise SchemaError(f"field {name!r} is of type {type(value).__name__}; {_FIELD_VALUES}") from None


def _object_column(name: str, value: Any, n: int) -> _Column:
    """A non-tensor field as msgpack rows: `NonTensorData` (one value for the batch) becomes
    "msgpack_data", a `NonTensorStack`, list or numpy array one value per sample ("msgpack")."""
    dtype = "msgpack"
    if type(value).__name__ == "NonTensorData":
        values, dtype = [value.data] * n, "msgpack_data"
    elif type(value).__name__ == "NonTensorStack":
        values = value.tolist()
    elif isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if any(isinstance(v, torch.Tensor) for v in values):
            raise SchemaError(
                f"field {name!r} is a {type(value).__name__} of tensors; a list is read as per-sample non-tensor "
                "values (sent as msgpack: Sluice never pickles), which tensors are not. Pass ragged rows as one jagged "
                "nested tensor, torch.nested.nested_tensor([...], layout=torch.jagged), and rows of one "
                "shape as one tensor (torch.stack([...]))"
            )
    else:
        raise SchemaError(f"field {name!r} is of type {type(value).__name__}; {_FIELD_VALUES}")
    if len(values) != n:
        raise SchemaError(f"field {name!r} has {len(values)} samples, the batch has {n}")
    raw, offsets = encode_values(name, values)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return _Column(FieldSpec(dtype, (RAGGED,)), values=data, offsets=offsets)


_use_count = getattr(torch._C, "_storage_Use_Count", None)


class BufferPool:
    """Reuses the memory of output tensors that their users have dropped.

    A fresh tensor's pages fault in on first touch, which costs far more than a warm copy (docs/architecture.md,
    section 3), and the allocator hands big blocks back to the OS when they are freed, so every
    batch would pay that again. The pool keeps the storages of large outputs (`min_bytes` and up,
    at most `max_bytes` in all, least recently used forgotten first) and hands one out again once
    no tensor uses it any more (its storage use count is back to the pool's own). A tensor made
    from it is an ordinary tensor (not a view) owning a storage of exactly its size.
    """

    def __init__(self, max_bytes: int = 256 << 20, min_bytes: int = 1 << 20):
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self._entries: list[tuple[int, torch.UntypedStorage, int]] = []  # (nbytes, storage, idle count), LRU first
        self._bytes = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Like `torch.empty(shape, dtype=dtype)`, on recycled memory when there is some."""
        nbytes = math.prod(shape) * _ITEMSIZES[dtype]
        if _use_count is None or nbytes < self.min_bytes or nbytes > self.max_bytes:
            return torch.empty(shape, dtype=dtype)
        storage = self._take(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape, _strides(shape))

    def _take(self, nbytes: int) -> torch.UntypedStorage:
        assert _use_count is not None  # `empty` pools only where torch counts storage uses
        entries = self._entries
        for i, (size, storage, idle) in enumerate(entries):
            if size == nbytes and _use_count(storage._cdata) == idle:
                if storage.nbytes() != nbytes:  # resized by a user meanwhile: not ours to reuse
                    del entries[i]
                    self._bytes -= size
                    break
                entries.append(entries.pop(i))
                return storage
        storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        entries.append((nbytes, storage, _use_count(storage._cdata)))
        self._bytes += nbytes
        while self._bytes > self.max_bytes and len(entries) > 1:
            self._bytes -= entries.pop(0)[0]  # a user may still hold it; it is freed with them
        return storage

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


_ITEMSIZES = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in _DTYPES.values()}


class Assembler:
    """Builds the output TensorDict of `get_data` from the runs each unit returns.

    Call `add_unit` once per unit with the batch positions its rows fill (in request order),
    the per-row lengths of ragged fields, and per field the byte runs (frame or arena slices);
    `result()` then returns dense tensors and jagged nested tensors in batch order. Output
    tensors come from `pool` when given (reused warm memory), else from `torch.empty`; a field
    whose every row arrived in one buffer the batch may keep (`owned`: a received frame, not an
    arena view), in batch order, is returned on that buffer's memory instead of copied out (its
    tensor's storage is then not resizable, as with `torch.frombuffer`). With a CUDA `device`,
    tensor fields are allocated there and each run is copied host to device straight from its
    buffer (asynchronously: run it inside `cuda.copies`); non-tensor fields stay on the CPU.
    """

    def __init__(
        self,
        specs: Mapping[str, FieldSpec],
        batch_size: int,
        pool: BufferPool | None = None,
        device: torch.device | None = None,
    ):
        self.specs = dict(specs)
        self.n = batch_size
        self.device = device
        self._host_empty = pool.empty if pool is not None else _plain_empty
        self._empty = self._host_empty if device is None else self._device_empty
        self._parts: list[tuple[np.ndarray, Mapping[str, list[int]], Mapping[str, list[Any]]]] = []
        self._owned = True  # every run is a private buffer the result may keep

    def _device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def add_unit(
        self,
        positions: np.ndarray,
        lengths: Mapping[str, list[int]],
        runs: Mapping[str, list[Any]],
        owned: bool = False,
    ) -> None:
        """Add one unit's rows; `owned`: its runs are buffers nobody else uses or reuses (received
        frames), which the result may keep instead of copying them."""
        self._parts.append((positions, lengths, runs))
        self._owned = self._owned and owned

    def result(self) -> TensorDict:
        out: dict[str, torch.Tensor] = {}
        in_order = self._in_order()
        for name, spec in self.specs.items():
            if spec.dtype in OBJECT_DTYPES:
                out[name] = _objects_of(spec, *self._ragged_parts(name, spec, self._host_empty, in_order))
            elif spec.ragged:
                out[name] = jagged(*self._ragged_parts(name, spec, self._empty, in_order))
            else:
                out[name] = self._dense(name, spec, in_order)
        return TensorDict(out, batch_size=[self.n])

    def _in_order(self) -> bool:
        """Whether one unit's rows fill the whole batch in order (a batch read as it was put)."""
        if len(self._parts) != 1:
            return False
        positions = self._parts[0][0]
        return len(positions) == self.n > 0 and int(positions[0]) == 0 and _consecutive(positions)

    def _kept(self, name: str, nbytes: int, in_order: bool) -> torch.Tensor | None:
        """The one owned run holding all `nbytes` of field `name`'s rows in batch order, which
        the result may keep instead of copying, or None."""
        if not in_order or not self._owned or self.device is not None:
            return None
        srcs = self._parts[0][2][name]
        return srcs[0] if len(srcs) == 1 and srcs[0].numel() == nbytes else None

    def _dense(self, name: str, spec: FieldSpec, in_order: bool) -> torch.Tensor:
        dtype = torch_dtype(spec.dtype)
        whole = self._kept(name, self.n * spec.row_bytes, in_order)
        if whole is not None:
            kept = _on_bytes(whole, (self.n, *spec.shape), dtype)
            if kept is not None:
                return kept
        out = self._empty((self.n, *spec.shape), dtype)
        rb = spec.row_bytes
        flat = out.view(-1).view(torch.uint8) if out.numel() else out.view(torch.uint8).reshape(-1)
        for positions, _, runs in self._parts:
            k = 0
            for src in runs[name]:
                m = src.numel() // rb if rb else 0
                _place(flat, src, positions[k : k + m], rb, in_order)
                k += m
            if k != len(positions):
                raise SchemaError(f"field {name!r}: storage returned {k} rows, expected {len(positions)}")
        return out

    def _ragged_parts(self, name: str, spec: FieldSpec, empty, in_order: bool) -> tuple[torch.Tensor, np.ndarray]:
        lengths = np.zeros(self.n, np.int64)
        for positions, lens, _ in self._parts:
            lengths[positions] = lens[name]
        offsets = np.zeros(self.n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        inner = spec.shape[1:]
        dtype = torch_dtype(spec.dtype)
        whole = self._kept(name, int(offsets[-1]) * spec.row_bytes, in_order)
        if whole is not None:
            kept = _on_bytes(whole, (int(offsets[-1]), *inner), dtype)
            if kept is not None:
                return kept, offsets
        values = empty((int(offsets[-1]), *inner), dtype)
        eb = spec.row_bytes
        flat = values.view(-1).view(torch.uint8) if values.numel() else values.view(torch.uint8).reshape(-1)
        for positions, lens, runs in self._parts:
            row_lens = np.asarray(lens[name], np.int64)
            k = 0
            for src in runs[name]:
                start = k
                budget = src.numel()
                while k < len(positions) and budget >= row_lens[k] * eb and (budget > 0 or row_lens[k] == 0):
                    budget -= row_lens[k] * eb
                    k += 1
                _place_ragged(flat, src, positions[start:k], offsets, row_lens[start:k], eb, in_order)
        return values, offsets


def _objects_of(spec: FieldSpec, values: torch.Tensor, offsets: np.ndarray) -> Any:
    """Decode a non-tensor column: a `NonTensorStack`, or a `NonTensorData` for a "msgpack_data"
    column whose rows all hold the same value."""
    from tensordict import NonTensorData, NonTensorStack

    raw = values.numpy().tobytes()
    rows = decode_values(raw, offsets)
    if spec.dtype == "msgpack_data" and rows:
        first = raw[int(offsets[0]) : int(offsets[1])]
        if all(raw[int(a) : int(b)] == first for a, b in zip(offsets[1:-1], offsets[2:])):
            return NonTensorData(rows[0], batch_size=[len(rows)])
    return NonTensorStack(*(NonTensorData(v) for v in rows), stack_dim=0) if rows else NonTensorStack.from_list([])


def _on_bytes(src: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor of `shape` and `dtype` on the memory of the uint8 tensor `src` (no copy; not a
    view, so it looks like a fresh tensor), or None when `src` is not aligned for `dtype`."""
    itemsize = _ITEMSIZES[dtype]
    if src.storage_offset() % itemsize or src.data_ptr() % itemsize:
        return None
    offset = src.storage_offset() // itemsize
    return torch.empty(0, dtype=dtype).set_(src.untyped_storage(), offset, shape, _strides(shape))


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The contiguous strides of `shape`, which `Tensor.set_` computes itself when given none (its
    type stubs only know the form that is given them)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _plain_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _place(flat: torch.Tensor, src: torch.Tensor, positions: np.ndarray, rb: int, in_order: bool) -> None:
    """Copy `len(positions)` rows of `rb` bytes from `src` to those rows of `flat` (`in_order`:
    the positions are known to be consecutive, a batch read as it was put)."""
    if not len(positions):
        return
    if flat.is_cuda:
        src = pinned_source(src)
    if in_order or _consecutive(positions):
        start = int(positions[0]) * rb
        flat[start : start + src.numel()].copy_(src, non_blocking=flat.is_cuda)
    else:
        if flat.is_cuda:  # one host-to-device copy of the run, scattered on the device
            src = src.to(flat.device, non_blocking=True)
        index = torch.from_numpy(positions).to(flat.device)
        flat.view(-1, rb).index_copy_(0, index, src.view(-1, rb))


def _place_ragged(flat, src, positions, offsets, row_lens, eb, in_order: bool) -> None:
    if not len(positions):
        return
    if flat.is_cuda:
        src = pinned_source(src)
    if in_order or _consecutive(positions):
        start = int(offsets[positions[0]]) * eb
        flat[start : start + src.numel()].copy_(src, non_blocking=flat.is_cuda)
        return
    if flat.is_cuda:  # one host-to-device copy of the run, placed row by row on the device
        src = src.to(flat.device, non_blocking=True)
    cursor = 0
    for pos, length in zip(positions.tolist(), row_lens.tolist()):
        nbytes = length * eb
        start = int(offsets[pos]) * eb
        flat[start : start + nbytes].copy_(src[cursor : cursor + nbytes], non_blocking=flat.is_cuda)
        cursor += nbytes


def jagged(values: torch.Tensor, offsets: np.ndarray) -> torch.Tensor:
    """A jagged nested tensor of `values` split at `offsets`, its longest and shortest row
    recorded: without them torch pads `to_padded_tensor()` to the total length of all rows."""
    lengths = np.diff(offsets)
    return torch.nested.nested_tensor_from_jagged(
        values,
        torch.from_numpy(offsets).to(values.device),
        min_seqlen=int(lengths.min()) if len(lengths) else None,
        max_seqlen=int(lengths.max()) if len(lengths) else None,
    )
