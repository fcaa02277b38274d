"""Non-tensor fields without pickle: each sample's value as msgpack bytes.

A non-tensor column (a `NonTensorStack`, a `NonTensorData`, a list or a numpy object/string
array in a put) travels as a ragged uint8 field whose wire dtype is "msgpack" or
"msgpack_data" (`_meta.OBJECT_DTYPES`): one msgpack document per sample. Values may be
None, bool, int, float, str, bytes, numpy arrays (any numeric, bool or fixed-width string
dtype, and object arrays of these values) and numpy scalars, and lists and dicts of all
of these; they come back equal and of the same types (tuples come back as lists). Anything
else raises `SchemaError` naming the field and the type: Sluice never pickles, so an
arbitrary Python object cannot cross its sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from .wire.errors import SchemaError

__all__ = ["encode_values", "decode_values", "ALLOWED"]

ALLOWED = "None, bool, int, float, str, bytes, numpy arrays and scalars, and lists/dicts of these"

_EXT_ARRAY = 1  # [dtype.str, shape, raw bytes]
_EXT_OBJECTS = 2  # [shape, [values...]] of a numpy object array
_EXT_SCALAR = 3  # [dtype.str, raw bytes] of a numpy scalar


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            return msgspec.msgpack.Ext(_EXT_OBJECTS, _ENCODER.encode([list(obj.shape), obj.ravel().tolist()]))
        if obj.dtype.kind in "biufcSU":
            data = np.ascontiguousarray(obj).tobytes()
            return msgspec.msgpack.Ext(_EXT_ARRAY, _ENCODER.encode([obj.dtype.str, list(obj.shape), data]))
    elif isinstance(obj, np.generic) and obj.dtype.kind in "biufcSU":
        return msgspec.msgpack.Ext(_EXT_SCALAR, _ENCODER.encode([obj.dtype.str, obj.tobytes()]))
    raise TypeError(type(obj).__name__)


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_ARRAY:
        dtype, shape, raw = _DECODER.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    if code == _EXT_OBJECTS:
        shape, values = _DECODER.decode(data)
        out = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):
            out[i] = value
        return out.reshape(shape)
    if code == _EXT_SCALAR:
        dtype, raw = _DECODER.decode(data)
        return np.frombuffer(raw, dtype=np.dtype(dtype))[0]
    raise SchemaError(f"unknown msgpack extension type {code} in a non-tensor field")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode_values(name: str, values: Sequence[Any]) -> tuple[bytes, np.ndarray]:
    """The msgpack bytes of every value, concatenated, and the row offsets (len(values) + 1).

    Raises `SchemaError` naming the field, the sample and the type when a value holds
    something msgpack cannot carry without pickle.
    """
    parts = []
    for i, value in enumerate(values):
        try:
            parts.append(_ENCODER.encode(value))
        except (TypeError, OverflowError) as exc:
            what = type(value).__name__
            what = what if str(exc) == what else f"{what} holding a {exc}"
            raise SchemaError(
                f"field {name!r}, sample {i}: a {what} cannot be sent; "
                f"Sluice never pickles, so non-tensor fields may hold only {ALLOWED}"
            ) from exc
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    return b"".join(parts), offsets


def decode_values(buffer: memoryview | bytes, offsets: np.ndarray) -> list[Any]:
    """The values `encode_values` encoded, from the concatenated bytes and row offsets."""
    view = memoryview(buffer)
    return [_DECODER.decode(view[int(a) : int(b)]) for a, b in zip(offsets[:-1], offsets[1:])]
