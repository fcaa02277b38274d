"""Messages every service shares, framing and limits, and the error reply <-> exception mapping."""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from ..auth import Credentials, is_loopback
from ..errors import ProtocolError, SchemaError, SluiceError, error_code, error_from_code

log = logging.getLogger("sluice.rpc")

PROTOCOL_VERSION = 1
MAX_BODY_BYTES = 64 << 20
"""Largest message body accepted; data frames never count against it."""
MAX_DATA_FRAMES = 4096
MAX_BATCH = 1 << 20
"""Most samples one request may name (put, get_meta, acquire): services check sizes against it
before allocating anything, so a small message can never make them allocate gigabytes."""
SOCKET_BUFFER_BYTES = 2 << 20
"""Kernel send and receive buffer of every channel and service socket. Left to the kernel,
loopback buffers grow to `tcp_rmem`'s maximum and fall out of cache; much smaller ones make a
stream wait on the socket (`benchmarks/data_plane.py`'s TCP stream shows both)."""

PROBE_AFTER = 1.0
"""Seconds of silence from a peer whose reply a channel awaits before it pings it."""
DEAD_AFTER = 5.0
"""Seconds of silence (pings unanswered) after which a channel reports its peer dead."""
GRACE = 10.0
"""Seconds a channel waits for a reply by default (beyond a request's own timeout)."""

_MAGIC = b"SLC"
_PREFIX = struct.Struct("<3sBQ")


# -- messages ------------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    """Base of every Sluice message: subclass with `tag="name"`.

    A field the receiver does not know makes the message undecodable (`ProtocolError`), so a
    misspelt field is refused rather than dropped (`Free(indices=...)` would free the whole
    partition). Messages still evolve within a protocol version: a new field gets a default that
    keeps the message's meaning, a field at its default is not sent (`omit_defaults`: a peer of
    the release before decodes the message it knows), and a new field or message type goes to a
    peer only when that peer is known to decode it (a request's: once the controller granted
    its feature, `messages.FEATURES`). Never change a field's default: a receiver
    cannot tell a field at its default from one left out, and the controller's journal holds
    `CommitPut`s written by the release before."""


class Cancel(Message, tag="cancel", frozen=True):
    """Withdraw this peer's parked request `request_id` (any service); answered with `Ok`.

    If the request was already answered, that answer arrives before this one's `Ok`."""

    request_id: int


class Ping(Message, tag="ping", frozen=True):
    """Are you alive? Every service answers `Ok` at once."""


class Ok(Message, tag="ok", frozen=True):
    """Done; nothing to return."""


class ErrorReply(Message, tag="error", frozen=True):
    """The request failed with the `tq.*` error whose `code` this is (see `check`)."""

    code: str
    message: str


def error_reply(exc: BaseException) -> ErrorReply:
    """The reply carrying `exc`; a foreign (non-Sluice) exception is a bug, so it is logged."""
    if not isinstance(exc, SluiceError):
        log.error("handler failed", exc_info=exc)
        return ErrorReply(error_code(exc), f"{type(exc).__name__}: {exc}")
    return ErrorReply(exc.code, str(exc))


def check(reply: Any, expected: type) -> Any:
    """`reply` if it is an `expected`.

    Raises:
        SluiceError: the `tq.*` error an `ErrorReply` names (the class the service raised).
        ProtocolError: the reply is of another type.
    """
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise ProtocolError(f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply


# -- framing -------------------------------------------------------------------------------


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
    """Encoder and decoder for one closed union of message types (what this side receives);
    used by one thread (`encode_now` reuses one buffer)."""

    def __init__(self, union: Any, max_body: int = MAX_BODY_BYTES, max_frames: int = MAX_DATA_FRAMES):
        self._decoder = msgspec.msgpack.Decoder(union)
        self._encoder = msgspec.msgpack.Encoder()
        self._body = bytearray(256)
        self.max_body = max_body
        self.max_frames = max_frames

    def encode(self, request_id: int, msg: msgspec.Struct, data: Sequence[Any] = ()) -> list[Any]:
        """Frames for `msg` followed by raw `data` buffers (not copied).

        Raises:
            SchemaError: a field holds a value msgpack cannot carry (e.g. an int beyond 64 bits).
        """
        try:
            body = self._encoder.encode(msg)
        except (msgspec.EncodeError, TypeError, OverflowError, ValueError) as exc:
            raise SchemaError(f"{type(msg).__name__} cannot be sent: {exc}") from exc
        return [pack_prefix(request_id), body, *data]

    def encode_now(self, request_id: int, msg: msgspec.Struct, data: Sequence[Any] = ()) -> list[Any]:
        """`encode` into a body buffer this codec reuses (`encode_into`: no allocation per
        message). Send the frames before this codec encodes anything else: blocking and
        non-blocking sends do (ZeroMQ copies a body under `zmq.COPY_THRESHOLD` on send; a larger
        one is copied here), a pending asyncio send may not: use `encode` there.

        Raises:
            SchemaError: as `encode`.
        """
        try:
            self._encoder.encode_into(msg, self._body)
        except (msgspec.EncodeError, TypeError, OverflowError, ValueError) as exc:
            raise SchemaError(f"{type(msg).__name__} cannot be sent: {exc}") from exc
        body = self._body if len(self._body) < zmq.COPY_THRESHOLD else bytes(self._body)
        return [pack_prefix(request_id), body, *data]

    def decode(self, frames: Sequence[Any]) -> tuple[int, Any, list[Any]]:
        """(request id, message, data frames) from frames without any routing identity.

        Raises:
            ProtocolError: anything malformed, oversized, of another version or type; once the
                prefix was read it carries the `request_id`, so the error reply reaches its caller.
        """
        if len(frames) < 2:
            raise ProtocolError(f"a message needs a prefix and a body, got {len(frames)} frame(s)")
        if len(frames) - 2 > self.max_frames:
            raise ProtocolError(f"{len(frames) - 2} data frames exceed the limit of {self.max_frames}")
        request_id = unpack_prefix(_buffer(frames[0]))
        body = _buffer(frames[1])
        try:
            if len(body) > self.max_body:
                raise ProtocolError(f"message body of {len(body)} bytes exceeds the limit of {self.max_body}")
            try:
                msg = self._decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
                raise ProtocolError(f"undecodable message: {exc}") from exc
        except ProtocolError as exc:
            exc.request_id = request_id
            raise
        return request_id, msg, list(frames[2:])


def _buffer(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)


def refuse_unauthenticated(bind: str, credentials: Credentials | None, local: bool) -> None:
    """Refuse a service that would admit peers its credentials do not check.

    Raises:
        SchemaError: `bind` is beyond loopback without `credentials`, or a `local` lane is asked
            for with them (a lane checks who connects by user, not by key).
    """
    if credentials is not None and local:
        raise SchemaError(
            "a service with CurveZMQ credentials serves no local lane: its same-user check cannot "
            "ask for the keys (serve it with local=False)"
        )
    if credentials is None and not is_loopback(bind):
        raise SchemaError(
            f"refusing to serve on {bind} without CurveZMQ credentials: beyond loopback anyone could "
            "connect; tq.init / `sluice serve` generate them (SLUICE_CREDENTIALS), or bind 127.0.0.1"
        )
