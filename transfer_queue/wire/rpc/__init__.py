"""Sluice's request/reply kernel: the one implementation every Sluice process speaks.

Public and documented so that every package may use it (`controllers`, `storage`,
`weight_sync`, the CLI, tests); nothing else in Sluice frames, matches or times out requests.

A message on a ZeroMQ socket is multipart::

    [prefix: magic b"SLC", protocol version (u8), request id (u64)]
    [body: msgpack of one tagged `Message` struct]
    [data frame 0] [data frame 1] ...      raw bytes (tensors), sent and received without copies

What lives here (`_codec`, `_service`, `_thread`, `_channel` behind this face):

- `Message`, the base of every message (a tagged, frozen msgspec struct), and the four every
  service understands: `Cancel` (withdraw a parked request), `Ping` (are you alive?), `Ok`
  and `ErrorReply` (a typed error: `error_reply(exc)` builds it, `check(reply, Expected)`
  raises it again as the same `tq.*` class on the caller's side).
- `Codec`: framing plus size limits (`MAX_BODY_BYTES`, `MAX_DATA_FRAMES`, `MAX_BATCH`);
  every socket's kernel buffers are `SOCKET_BUFFER_BYTES`;
  malformed, oversized or unknown input is a `ProtocolError`, never anything else, and nothing
  is ever unpickled.
- Servers: `Service` (asyncio: a handler returns a reply, or a coroutine that parks the request
  as its own task; `current_peer` names the connection a handler serves) and `ThreadService`
  (a thread: a handler answers a `Pending` now or later, `park` bounds the wait, and
  `on_disconnect` reports a client connection that closed, by its `Pending.peer`). Both answer
  `Ping` and `Cancel`, turn every handler failure into an `ErrorReply`, and refuse to bind
  beyond loopback without CurveZMQ `Credentials`.
- Clients: `Channel` (blocking) and `AsyncChannel` (asyncio), one DEALER to one endpoint each:
  request ids, replies matched by id (many requests may be in flight), deadlines, `cancel`, and
  liveness (a silent peer is pinged after `PROBE_AFTER` s and reported dead after `DEAD_AFTER`
  s of silence) written once in their shared base. `LocalChannel` and `AsyncLocalChannel`:
  `Channel`'s and `AsyncChannel`'s calls over a service's local lane (`local=True` on either
  server: a Unix socket its thread or loop reads itself, for clients of its user on its host;
  one thread wake per message instead of three).
- For links that are not ZeroMQ (the weight transports' raw sockets): `error_code` /
  `error_from_code`, the same error mapping as text, and `is_loopback` / `CREDENTIALS_ENV`, the
  rule and the variable that decide when credentials are required.
- `out_of_files`: the `CapacityError` for a descriptor the process could not open (`EMFILE`),
  naming the limit it hit, as a refused ZeroMQ socket raises.
"""

from __future__ import annotations

from ..auth import CREDENTIALS_ENV, Credentials, is_loopback
from ..auth import from_env as credentials_from_env
from ..errors import error_code, error_from_code
from ._async_channel import AsyncChannel
from ._channel import Channel
from ._codec import (
    DEAD_AFTER,
    GRACE,
    MAX_BATCH,
    MAX_BODY_BYTES,
    MAX_DATA_FRAMES,
    PROBE_AFTER,
    PROTOCOL_VERSION,
    SOCKET_BUFFER_BYTES,
    Cancel,
    Codec,
    ErrorReply,
    Message,
    Ok,
    Ping,
    check,
    error_reply,
    pack_prefix,
    unpack_prefix,
)
from ._context import out_of_files
from ._local import AsyncLocalChannel, LocalChannel
from ._service import Handled, Service, current_peer, run_service
from ._thread import Pending, ThreadService

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY_BYTES",
    "MAX_DATA_FRAMES",
    "MAX_BATCH",
    "PROBE_AFTER",
    "DEAD_AFTER",
    "GRACE",
    "SOCKET_BUFFER_BYTES",
    "Credentials",
    "credentials_from_env",
    "CREDENTIALS_ENV",
    "is_loopback",
    "error_code",
    "error_from_code",
    "Message",
    "Cancel",
    "Ping",
    "Ok",
    "ErrorReply",
    "Codec",
    "pack_prefix",
    "unpack_prefix",
    "error_reply",
    "check",
    "Handled",
    "Service",
    "current_peer",
    "run_service",
    "Pending",
    "ThreadService",
    "Channel",
    "AsyncChannel",
    "LocalChannel",
    "AsyncLocalChannel",
    "out_of_files",
]
