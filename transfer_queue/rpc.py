"""Sluice's request/reply kernel: the one implementation every Sluice process speaks.

Public and documented so that every package may use it (`controllers`, `storage`,
`weight_sync`, the CLI, tests); nothing else in Sluice frames, matches or times out requests.

A message on a ZeroMQ socket is multipart::

    [prefix: magic b"SLC", protocol version (u8), request id (u64)]
    [body: msgpack of one tagged `Message` struct]
    [data frame 0] [data frame 1] ...      raw bytes (tensors), sent and received without copies

What lives here, top to bottom:

- `Message`, the base of every message (a tagged, frozen msgspec struct), and the four every
  service understands: `Cancel` (withdraw a parked request), `Ping` (are you alive?), `Ok`
  and `ErrorReply` (a typed error: `error_reply(exc)` builds it, `check(reply, Expected)`
  raises it again as the same `tq.*` class on the caller's side).
- `Codec`: framing plus size limits (`MAX_BODY_BYTES`, `MAX_DATA_FRAMES`, `MAX_BATCH`);
  malformed, oversized or unknown input is a `ProtocolError`, never anything else, and nothing
  is ever unpickled.
- Servers: `Service` (asyncio: a handler returns a reply, or a coroutine that parks the request
  as its own task) and `ThreadService` (a thread: a handler answers a `Pending` now or later,
  `park` bounds the wait). Both answer `Ping` and `Cancel`, turn every handler failure into an
  `ErrorReply`, and refuse to bind beyond loopback without CurveZMQ `Credentials`.
- Clients: `Channel` (blocking) and `AsyncChannel` (asyncio), one DEALER to one endpoint each:
  request ids, replies matched by id (many requests may be in flight), deadlines, `cancel`, and
  liveness (a silent peer is pinged after `PROBE_AFTER` s and reported dead after `DEAD_AFTER`
  s of silence) written once in their shared base.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import os
import signal
import struct
import sys
import threading
import time
from collections import deque
from typing import Any, Awaitable, Callable, Sequence

import msgspec
import zmq
import zmq.asyncio

from ._auth import Credentials, from_env, is_loopback, secure_client, secure_server
from ._errors import ProtocolError, SchemaError, ServiceError, SluiceError, TimeoutError, error_code, error_from_code

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_BODY_BYTES",
    "MAX_DATA_FRAMES",
    "MAX_BATCH",
    "PROBE_AFTER",
    "DEAD_AFTER",
    "GRACE",
    "Credentials",
    "credentials_from_env",
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
    "run_service",
    "Pending",
    "ThreadService",
    "Channel",
    "AsyncChannel",
]

log = logging.getLogger("sluice.rpc")

credentials_from_env = from_env
"""The CurveZMQ credentials in `SLUICE_CREDENTIALS`, or None (a cluster bound to loopback)."""

PROTOCOL_VERSION = 1
MAX_BODY_BYTES = 64 << 20
"""Largest message body accepted; data frames never count against it."""
MAX_DATA_FRAMES = 4096
MAX_BATCH = 1 << 20
"""Most samples one request may name (put, get_meta, acquire): services check sizes against it
before allocating anything, so a small message can never make them allocate gigabytes."""

PROBE_AFTER = 1.0
"""Seconds of silence from a peer whose reply a channel awaits before it pings it."""
DEAD_AFTER = 5.0
"""Seconds of silence (pings unanswered) after which a channel reports its peer dead."""
GRACE = 10.0
"""Seconds a channel waits for a reply by default (beyond a request's own timeout)."""

_MAGIC = b"SLC"
_PREFIX = struct.Struct("<3sBQ")


# -- messages ------------------------------------------------------------------------------


class Message(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    """Base of every Sluice message: subclass with `tag="name"`; new fields need defaults."""


class Cancel(Message, tag="cancel"):
    """Withdraw this peer's parked request `request_id` (any service); answered with `Ok`.

    If the request was already answered, that answer arrives before this one's `Ok`."""

    request_id: int


class Ping(Message, tag="ping"):
    """Are you alive? Every service answers `Ok` at once."""


class Ok(Message, tag="ok"):
    """Done; nothing to return."""


class ErrorReply(Message, tag="error"):
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


def _refuse_unauthenticated(bind: str, credentials: Credentials | None) -> None:
    if credentials is None and not is_loopback(bind):
        raise SchemaError(
            f"refusing to serve on {bind} without CurveZMQ credentials: beyond loopback anyone could "
            "connect; tq.init / `sluice serve` generate them (SLUICE_CREDENTIALS), or bind 127.0.0.1"
        )


# -- asyncio service -----------------------------------------------------------------------

Handled = Message | tuple[Message, list[Any]]
Handler = Callable[[Any, list[Any]], Handled | Awaitable[Handled]]


class Service:
    """A ROUTER socket bound to `bind`, dispatching decoded requests to typed handlers (asyncio).

    A handler returns a reply (optionally with data frames) at once, or a coroutine when it must
    wait (for samples, budget, space): that coroutine runs as its own task, so a parked request
    never delays anyone else, and a `Cancel` from its client cancels it. Malformed input gets an
    `ErrorReply` and is counted (`rejected`). With `credentials` it is a CurveZMQ server
    admitting only the cluster's clients (refused handshakes counted in `auth_refused`).

    The ROUTER is read without a future per message: the event loop watches its file descriptor
    and a callback drains every queued request with non-blocking reads; replies are non-blocking
    sends (this halves the CPU a request costs compared with `zmq.asyncio` awaits).

    Raises:
        SchemaError: `bind` is beyond loopback and no `credentials` were given.
    """

    def __init__(self, codec: Codec, bind: str, max_frame_bytes: int = -1, credentials: Credentials | None = None):
        _refuse_unauthenticated(bind, credentials)
        self.codec = codec
        self.handlers: dict[type, Handler] = {}
        self.ctx = zmq.asyncio.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if max_frame_bytes > 0:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.auth_refused = 0
        self._guard = None
        if credentials is not None:
            auth, monitor = secure_server(self.sock, credentials)
            self._guard = auth, asyncio.ensure_future(self._count_refusals(monitor))
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._plain = zmq.Socket.shadow(self.sock.underlying)  # the same socket, without futures
        self._drain_pending = False
        self._draining = False
        self.rejected = 0
        self.served = 0
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}
        self._serving: asyncio.Task | None = None

    async def _count_refusals(self, monitor: Any) -> None:
        while True:
            try:
                frames = await monitor.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self.auth_refused += _refusals(frames)

    def route(self, msg_type: type, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.cancel()

    async def serve(self) -> None:
        """Serve until `stop()` (or until the task running this is cancelled)."""
        self._serving = asyncio.current_task()
        loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        try:
            self._drain()  # requests that came before the reader was registered
            await loop.create_future()  # until cancelled
        except asyncio.CancelledError:
            pass
        finally:
            loop.remove_reader(fd)
            for task in list(self._tasks.values()):
                task.cancel()
            if self._guard is not None:
                auth, monitor = self._guard
                monitor.cancel()
                auth.stop()
            self.sock.close(linger=0)

    def _drain(self, budget: int = 64) -> None:
        """Dispatch every queued request (at most `budget`, then yield to the loop and go on).

        ZeroMQ's descriptor is edge-triggered, so this reads until the queue is empty; a send
        made elsewhere can swallow the edge of a request arriving meanwhile, so `_reply`
        schedules another drain after it (`_schedule_drain`).
        """
        self._drain_pending = False
        if self.sock.closed:
            return
        self._draining = True
        try:
            for _ in range(budget):
                try:
                    frames = self._plain.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                except zmq.ZMQError:  # closed underneath us: the service is stopping
                    return
                self._dispatch(frames)
        finally:
            self._draining = False
        self._schedule_drain()  # budget used up: let timers and tasks run, then go on

    def _schedule_drain(self) -> None:
        if not self._drain_pending and self._serving is not None:
            self._drain_pending = True
            self._serving.get_loop().call_soon(self._drain)

    def _dispatch(self, frames: list[Any]) -> None:
        identity, body = frames[0], frames[1:]
        if body and len(body[0].bytes if hasattr(body[0], "bytes") else body[0]) == 0:
            body = body[1:]  # REQ peers add an empty delimiter
        request_id = 0
        try:
            request_id, msg, data = self.codec.decode(body)
            if isinstance(msg, Cancel):
                task = self._tasks.pop((identity.bytes, msg.request_id), None)
                if task is not None:
                    task.cancel()
                self._reply(identity, request_id, Ok())
                return
            if isinstance(msg, Ping):
                self._reply(identity, request_id, Ok())
                return
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not served here")
            result = handler(msg, data)
        except ProtocolError as exc:
            self.rejected += 1
            self._reply(identity, getattr(exc, "request_id", request_id), error_reply(exc))
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
            self._reply(identity, request_id, error_reply(exc))
            return
        if inspect.isawaitable(result):
            key = (identity.bytes, request_id)
            task = asyncio.ensure_future(self._finish(identity, request_id, result))
            self._tasks[key] = task
            task.add_done_callback(lambda _: self._tasks.pop(key, None))
        else:
            self._reply(identity, request_id, result)

    async def _finish(self, identity: Any, request_id: int, pending: Awaitable[Handled]) -> None:
        try:
            result = await pending
        except asyncio.CancelledError:
            return  # withdrawn by the client (Cancel) or the service is stopping: no answer
        except Exception as exc:  # noqa: BLE001
            result = error_reply(exc)
        self._reply(identity, request_id, result)

    def _reply(self, identity: Any, request_id: int, result: Handled) -> None:
        msg, data = result if isinstance(result, tuple) else (result, [])
        self.served += 1
        frames = [identity, *self.codec.encode_now(request_id, msg, data)]
        try:
            # ROUTER (not mandatory) never blocks: it drops a reply to a peer that is gone or full
            self._plain.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # the peer is gone; nothing to tell it
            log.debug("reply to a vanished peer dropped")
        if not self._draining:
            self._schedule_drain()


def run_service(make: Callable[[], Awaitable[Service]], announce: Callable[[Service], str]) -> None:
    """Process entry point: build the service, print its address line, serve until SIGTERM/SIGINT."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    async def main() -> None:
        service = await make()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.stop)
        print(announce(service), flush=True)
        await service.serve()

    asyncio.run(main())


def _refusals(frames: list[Any]) -> int:
    (event,) = struct.unpack("=H", bytes(frames[0])[:2])
    return 1 if event else 0


# -- thread service ------------------------------------------------------------------------


class Pending:
    """A request being served by a `ThreadService`: answer it once (from the server thread)."""

    __slots__ = ("_server", "_key", "done")

    def __init__(self, server: ThreadService, identity: bytes, rid: int):
        self._server, self._key = server, (identity, rid)
        self.done = False

    def reply(self, msg: Message) -> None:
        """Send `msg` as the answer (a second answer, or one to a cancelled request, is dropped)."""
        if self.done:
            return
        self.done = True
        self._server._open.pop(self._key, None)
        self._server._send(*self._key, msg)

    def fail(self, exc: BaseException) -> None:
        """Answer with the `ErrorReply` carrying `exc`."""
        self.reply(error_reply(exc))


ThreadHandler = Callable[[Any, Pending], None]


class ThreadService:
    """A ROUTER socket served by one thread, for processes that are not asyncio (a trainer).

    `handler(msg, pending)` runs in the server thread and either answers at once or keeps
    `pending` to answer later (`park` bounds the wait: the request fails with `TimeoutError`
    at its deadline). It must never block: other threads hand results back with `submit`,
    which wakes the loop through a pipe; nothing here polls on a timer. `Ping` and `Cancel`
    are answered here; a handler's exception becomes the request's `ErrorReply`.

    Raises:
        SchemaError: `bind` is beyond loopback and no `credentials` were given.
    """

    def __init__(
        self, codec: Codec, handler: ThreadHandler, bind: str = "tcp://127.0.0.1:*",
        credentials: Credentials | None = None, name: str = "sluice-rpc",
    ):
        _refuse_unauthenticated(bind, credentials)
        self._codec = codec
        self._handler = handler
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.auth_refused = 0
        self._auth, self._monitor = secure_server(self._sock, credentials) if credentials is not None else (None, None)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._calls: deque[Callable[[], None]] = deque()
        self._parked: list[tuple[float, int, Pending, str]] = []
        self._open: dict[tuple[bytes, int], Pending] = {}
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn()` in the server thread soon (callable from any thread)."""
        self._calls.append(fn)
        os.write(self._wake_w, b"x")

    def park(self, pending: Pending, timeout: float, what: str) -> None:
        """Keep `pending` for up to `timeout` seconds, then fail it with `TimeoutError(what)`."""
        heapq.heappush(self._parked, (time.monotonic() + timeout, next(self._seq), pending, what))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _send(self, identity: bytes, rid: int, msg: Message) -> None:
        try:
            self._sock.send_multipart([identity, *self._codec.encode_now(rid, msg)], copy=False)
        except zmq.ZMQError:
            log.debug("reply to a vanished peer dropped")

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._closed:
                timeout = None
                if self._parked:
                    timeout = max(0.0, (self._parked[0][0] - time.monotonic()) * 1000)
                ready = dict(poller.poll(timeout))
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                while self._calls:
                    self._calls.popleft()()
                if self._monitor is not None and self._monitor in ready:
                    self.auth_refused += _refusals(self._monitor.recv_multipart())
                while self._sock.poll(0, zmq.POLLIN):
                    self._serve(self._sock.recv_multipart(copy=False))
                self._expire()
        finally:
            if self._auth is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._auth.stop()
            self._sock.close(linger=0)

    def _serve(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        rid = 0
        try:
            rid, msg, _ = self._codec.decode(frames[1:])
        except ProtocolError as exc:
            self._send(identity, getattr(exc, "request_id", rid), error_reply(exc))
            return
        if isinstance(msg, Cancel):
            withdrawn = self._open.pop((identity, msg.request_id), None)
            if withdrawn is not None:
                withdrawn.done = True
            self._send(identity, rid, Ok())
            return
        if isinstance(msg, Ping):
            self._send(identity, rid, Ok())
            return
        pending = self._open[(identity, rid)] = Pending(self, identity, rid)
        try:
            self._handler(msg, pending)
        except Exception as exc:  # noqa: BLE001 - a failure is the request's answer, never the loop's end
            pending.fail(exc)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._parked and (self._parked[0][2].done or self._parked[0][0] <= now):
            _, _, pending, what = heapq.heappop(self._parked)
            pending.fail(TimeoutError(what))


# -- client channels -----------------------------------------------------------------------


class _Peer:
    """One DEALER to one endpoint, and what both channels decide without I/O: ids, liveness,
    deadlines. `lost` is raised when the peer is unreachable or silent, `late` at a deadline."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, replies: Codec, *, name: str | None, hint: str,
        credentials: Credentials | None, timeout: float, connect_timeout: float,
        lost: type[SluiceError], late: type[SluiceError],
    ):
        self.endpoint = endpoint
        self.name = name or f"the service at {endpoint}"
        self.codec = replies
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.hint = hint
        self.lost, self.late = lost, late
        self.heard = 0.0  # monotonic time of the peer's last message
        self.dead = False  # reported dead and silent since
        self._pinged = float("-inf")
        self._ids = itertools.count(1)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        self.sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout * 1000))  # ... and never block for it
        if credentials is not None:
            secure_client(self.sock, credentials)
        self.sock.connect(endpoint)

    def _heard(self) -> None:
        self.heard = time.monotonic()
        self.dead = False

    def _unreachable(self) -> SluiceError:
        self.dead = True
        return self.lost(
            f"{self.name} took no message for {self.connect_timeout:g} s: it is down, or it refused this "
            "client's credentials (a cluster bound beyond loopback admits only clients given its "
            "SLUICE_CREDENTIALS)"
        )

    def _step(self, since: float, deadline: float | None, what: str) -> tuple[bool, float]:
        """While awaiting a reply since `since`: (ping the peer now?, seconds to wait next).

        Raises `late` at `deadline`, `lost` once the peer is silent for `DEAD_AFTER` s."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self.late(f"{self.name} did not answer {what} within {deadline - since:g}s; is it still running?")
        quiet = now - max(self.heard, since)
        if quiet > DEAD_AFTER:
            self.dead = True
            raise self.lost(
                f"{self.name} has not answered for {quiet:.1f} s, pings included: it died or hangs{self.hint}, "
                "or it refused this client's credentials (a cluster bound beyond loopback admits only "
                "clients given its SLUICE_CREDENTIALS)"
            )
        ping = quiet >= PROBE_AFTER and now - self._pinged >= PROBE_AFTER
        if ping:
            self._pinged = now
        left = PROBE_AFTER if deadline is None else min(PROBE_AFTER, deadline - now)
        return ping, max(left, 0.0)

    def _deadline(self, since: float, wait: float | None) -> float | None:
        return None if wait is None else since + wait


class Channel(_Peer):
    """A blocking request/reply channel to one service, used from one thread.

    `send` puts a request on the wire and returns its id; `reply(rid)` waits for that request's
    answer (others that arrive meanwhile are kept for their own `reply`); `call` does both and
    raises an `ErrorReply` as its `tq.*` error; `cancel` withdraws a request at the service.
    With `watch_disconnect`, a peer that drops the connection while a reply is awaited is
    reported at once (`lost`) instead of after `DEAD_AFTER` s of silence.
    """

    def __init__(
        self, endpoint: str, replies: Codec, *, name: str | None = None, hint: str = "",
        credentials: Credentials | None = None, timeout: float = GRACE, connect_timeout: float = DEAD_AFTER,
        lost: type[SluiceError] = ServiceError, late: type[SluiceError] = TimeoutError, watch_disconnect: bool = False,
    ):
        super().__init__(
            zmq.Context.instance(), endpoint, replies, name=name, hint=hint, credentials=credentials,
            timeout=timeout, connect_timeout=connect_timeout, lost=lost, late=late,
        )
        self._stash: dict[int, tuple[Any, list[Any]]] = {}
        self._pings: set[int] = set()  # ids of liveness pings whose Ok is dropped on arrival
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._monitor = None
        if watch_disconnect:
            self._monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._poller.register(self._monitor, zmq.POLLIN)

    def send(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Send a request; returns its id.

        Raises:
            SchemaError: `msg` cannot be encoded.
            SluiceError: (`lost`) no connection to the peer within `connect_timeout`.
        """
        rid = next(self._ids)
        frames = self.codec.encode_now(rid, msg, data)
        if self._monitor is not None:
            while self._monitor.poll(0):
                self._monitor.recv_multipart()  # disconnects before this request are history
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            raise self._unreachable() from None
        return rid

    def reply(self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request") -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid`, awaited since `since` (default: now) for at
        most `wait` seconds (None: as long as the peer is alive).

        Raises:
            SluiceError: (`late`) no answer within `wait`; (`lost`) the peer is silent for
                `DEAD_AFTER` s or dropped the connection.
        """
        since = time.monotonic() if since is None else since
        deadline = self._deadline(since, wait)
        while rid not in self._stash:
            ping, left = self._step(since, deadline, what)
            if ping:
                self._ping()
            ready = dict(self._poller.poll(int(left * 1000) + 1))
            if self._monitor is not None and self._monitor in ready:
                self.dead = True
                raise self.lost(f"{self.name} dropped the connection (gone?)")
            while self.sock.poll(0):
                self._take(self.sock.recv_multipart(copy=False))
        return self._stash.pop(rid)

    def ready(self, rid: int | None = None, wait: float = 0.0) -> int | None:
        """The id of an arrived, untaken reply (to `rid` if given; else the oldest), waiting up
        to `wait` s for one; None if none came. The reply stays for `reply`."""
        deadline = time.monotonic() + wait
        while True:
            if rid in self._stash or (rid is None and self._stash):
                return rid if rid is not None else next(iter(self._stash))
            left = deadline - time.monotonic()
            if not self.sock.poll(max(int(left * 1000), 0)):
                return None
            while self.sock.poll(0):
                self._take(self.sock.recv_multipart(copy=False))

    def call(self, msg: Message, timeout: float | None = None, data: Sequence[Any] = ()) -> Any:
        """Send `msg` and return its reply, waiting at most `timeout` s (default: the channel's).

        Raises:
            SluiceError: the `tq.*` error the service answered with, or as `send` and `reply`.
        """
        rid = self.send(msg, data)
        reply, _ = self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    def cancel(self, rid: int) -> tuple[Any, list[Any]] | None:
        """Withdraw request `rid` at the service; its reply if that had already been sent (the
        caller gives back what it holds), else None: it will never come.

        Raises:
            SluiceError: as `send` and `reply` (the peer is gone: its own timers free what it held).
        """
        self.reply(self.send(Cancel(rid)), GRACE, what="Cancel")
        return self._stash.pop(rid, None)

    def forget(self, rid: int) -> None:
        """Drop `rid`'s reply if it came (the request was abandoned without a cancel)."""
        self._stash.pop(rid, None)

    def _ping(self) -> None:
        rid = next(self._ids)
        self._pings.add(rid)
        try:
            self.sock.send_multipart(self.codec.encode_now(rid, Ping()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no connection: the silence tells

    def _take(self, frames: list[Any]) -> None:
        self._heard()
        try:
            rid, msg, data = self.codec.decode(frames)
        except ProtocolError:
            log.warning("%s sent an undecodable reply", self.name)
            return
        if rid in self._pings:
            self._pings.discard(rid)
        else:
            self._stash[rid] = (msg, data)

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)


class AsyncChannel(_Peer):
    """The asyncio twin of `Channel`: one reader task resolves the future of whichever request
    a reply answers, so any number of coroutines may share it. Replies nobody awaits (to
    `post`ed requests) go to `on_reply`."""

    def __init__(
        self, endpoint: str, replies: Codec, *, name: str | None = None, hint: str = "",
        credentials: Credentials | None = None, timeout: float = GRACE, connect_timeout: float = DEAD_AFTER,
        lost: type[SluiceError] = ServiceError, late: type[SluiceError] = TimeoutError,
        on_reply: Callable[[Any], None] | None = None,
    ):
        super().__init__(
            zmq.asyncio.Context.instance(), endpoint, replies, name=name, hint=hint, credentials=credentials,
            timeout=timeout, connect_timeout=connect_timeout, lost=lost, late=late,
        )
        self._waiting: dict[int, asyncio.Future] = {}
        self._on_reply = on_reply
        self._plain = zmq.Socket.shadow(self.sock.underlying)  # the same socket, for sends that never wait
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._heard()
            try:
                rid, msg, data = self.codec.decode(frames)
            except ProtocolError:
                log.warning("%s sent an undecodable reply", self.name)
                continue
            fut = self._waiting.get(rid)  # removed by whoever awaits it (`reply`, `cancel`, `forget`)
            if fut is not None and not fut.done():
                fut.set_result((msg, data))
            elif self._on_reply is not None:
                self._on_reply(msg)

    async def send(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Send a request; returns its id (see `Channel.send`)."""
        rid = next(self._ids)
        frames = self.codec.encode(rid, msg, data)
        self._waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self._waiting.pop(rid, None)
            raise self._unreachable() from None
        return rid

    def post(self, msg: Message) -> bool:
        """Send a request whose reply nobody awaits (it goes to `on_reply`), without blocking;
        False when the peer takes no message now (not connected, or its queue is full)."""
        try:
            self._plain.send_multipart(self.codec.encode_now(next(self._ids), msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def reply(self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request") -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid` (see `Channel.reply`); when this raises
        (or is cancelled), `cancel(rid)` or `forget(rid)` the request."""
        fut = self._waiting.get(rid)
        if fut is None:
            raise ProtocolError(f"request {rid} was not sent on this channel, or its reply was taken")
        since = time.monotonic() if since is None else since
        deadline = self._deadline(since, wait)
        while True:
            ping, left = self._step(since, deadline, what)
            if ping:
                try:
                    # its Ok finds no future and is dropped; hearing it is enough
                    await self.sock.send_multipart(self.codec.encode(next(self._ids), Ping()), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            done, _ = await asyncio.wait({fut}, timeout=left)
            if done:
                self._waiting.pop(rid, None)
                return fut.result()

    async def call(self, msg: Message, timeout: float | None = None, data: Sequence[Any] = ()) -> Any:
        """Send `msg` and return its reply (see `Channel.call`)."""
        rid = await self.send(msg, data)
        try:
            reply, _ = await self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        finally:
            self._waiting.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    async def cancel(self, rid: int) -> tuple[Any, list[Any]] | None:
        """Withdraw request `rid` (see `Channel.cancel`)."""
        fut = self._waiting.get(rid)
        try:
            await self.call(Cancel(rid), GRACE)
        finally:
            self._waiting.pop(rid, None)
        return fut.result() if fut is not None and fut.done() and not fut.cancelled() else None

    def forget(self, rid: int) -> None:
        """Stop awaiting `rid`'s reply."""
        self._waiting.pop(rid, None)

    def close(self) -> None:
        self._reader.cancel()
        self.sock.close(linger=0)
