"""Framing of one message on a ZeroMQ socket.

A message is a multipart ZeroMQ message::

    [prefix: magic b"SLC", protocol version (u8), request id (u64)]
    [body: msgpack of one tagged msgspec struct]
    [data frame 0] [data frame 1] ...      raw tensor bytes, sent and received without copies

Decoding checks the magic and version, the body size and the number of frames before msgspec
parses the body into one type of a closed union, so garbage, oversized or unknown messages
become a `ProtocolError` and nothing else. Nothing here ever unpickles anything.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

import msgspec

from ._errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY_BYTES",
    "MAX_DATA_FRAMES",
    "MAX_BATCH",
    "Codec",
    "pack_prefix",
    "unpack_prefix",
]

PROTOCOL_VERSION = 1
MAX_BODY_BYTES = 64 << 20
"""Largest metadata body accepted; tensors never count against it."""
MAX_DATA_FRAMES = 4096
MAX_BATCH = 1 << 20
"""Most samples one request may name (put, get_meta, acquire): services check sizes against it
before allocating anything, so a small message can never make them allocate gigabytes."""

_MAGIC = b"SLC"
_PREFIX = struct.Struct("<3sBQ")


def pack_prefix(request_id: int) -> bytes:
    return _PREFIX.pack(_MAGIC, PROTOCOL_VERSION, request_id)


def unpack_prefix(frame: bytes | memoryview) -> int:
    """The request id in a prefix frame; `ProtocolError` if it is not a Sluice v1 prefix."""
    if len(frame) != _PREFIX.size:
        raise ProtocolError(f"bad prefix frame of {len(frame)} bytes (not a Sluice peer?)")
    magic, version, request_id = _PREFIX.unpack(frame)
    if magic != _MAGIC:
        raise ProtocolError("bad magic in prefix frame (not a Sluice peer?)")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})")
    return request_id


class Codec:
    """Encoder and decoder for one closed union of message types."""

    def __init__(self, union: Any, max_body: int = MAX_BODY_BYTES, max_frames: int = MAX_DATA_FRAMES):
        self._decoder = msgspec.msgpack.Decoder(union)
        self._encoder = msgspec.msgpack.Encoder()
        self.max_body = max_body
        self.max_frames = max_frames

    def encode(self, request_id: int, msg: msgspec.Struct, data: Sequence[Any] = ()) -> list[Any]:
        """Frames for `msg` followed by raw `data` buffers (not copied)."""
        return [pack_prefix(request_id), self._encoder.encode(msg), *data]

    def decode(self, frames: Sequence[Any]) -> tuple[int, Any, list[Any]]:
        """(request id, message, data frames); raises `ProtocolError` on anything malformed.

        `frames` are zmq Frames or bytes, without any routing identity.
        """
        if len(frames) < 2:
            raise ProtocolError(f"a message needs a prefix and a body, got {len(frames)} frame(s)")
        if len(frames) - 2 > self.max_frames:
            raise ProtocolError(f"{len(frames) - 2} data frames exceed the limit of {self.max_frames}")
        request_id = unpack_prefix(_buffer(frames[0]))
        body = _buffer(frames[1])
        if len(body) > self.max_body:
            raise ProtocolError(f"message body of {len(body)} bytes exceeds the limit of {self.max_body}")
        try:
            msg = self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"undecodable message: {exc}") from exc
        return request_id, msg, list(frames[2:])


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
