"""The thread service loop, for processes that are not asyncio (the trainer's weight channel)."""

from __future__ import annotations

import heapq
import itertools
import math
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ..auth import REFUSALS, Credentials, secure_server
from ..errors import ProtocolError, SchemaError, TimeoutError
from . import _local
from ._codec import Cancel, Codec, Message, Ok, Ping, error_reply, log, refuse_unauthenticated
from ._context import monitor, shared_context, socket
from ._local import Lane, supported
from ._peers import RecentlyGone, hung_up
from ._service import refusals

# -- thread service ------------------------------------------------------------------------

_LONGEST_WAIT = 86400.0
"""Most seconds the server thread sleeps in one poll (zmq takes milliseconds as a C int, which
overflows past 24.8 days): a request parked longer, or for ever, is looked at again daily."""


class Pending:
    """A request being served by a `ThreadService`: answer it once (from the server thread)."""

    __slots__ = ("_server", "_key", "done")

    def __init__(self, server: ThreadService, identity: bytes, rid: int):
        self._server, self._key = server, (identity, rid)
        self.done = False

    @property
    def peer(self) -> bytes:
        """The connection the request came over (its ROUTER identity): what a service that
        hands out something held per client keys it by, for `on_disconnect`."""
        return self._key[0]

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

    With `on_disconnect`, a client connection that closes (its process exited or died, or it
    closed the channel) is reported in the server thread as `on_disconnect(peer)` (the
    `Pending.peer` of its requests), after its open requests are dropped: a service frees what
    it held for that client at once instead of at a timeout. The connection of each request is
    known from its socket (`SRCFD`) and the closings from the socket's monitor, read before a
    request is served, so a descriptor reused by a new connection is never mistaken for the old.
    A request read after its connection's closing was seen is dropped unanswered (the latest
    closed peers are remembered): what its handler hands out is not always its connection's (a
    network reader's weight lease), so reporting the peer gone again would not free it. A
    connection's first request read once its descriptor is closed or hung up (`hung_up`), before
    that closing was seen, is served as any first request, and its peer reported gone right
    after it is handled (its later ones are then dropped): a notice such as a `Release` posted
    over a fresh connection that closes at once still counts, and what the request holds for its
    connection is let go at once. The one request this may still misplace is a connection's
    first, read once its connection ended on this side (an error, not its peer, closed it) or
    its descriptor went to a new connection: it is taken for the descriptor's next connection,
    and what it is given waits for that one's closing or its own timeout.

    With `local` (on Linux), the thread also serves a Unix socket of its own (`local_endpoint`,
    "" without it; clients: `LocalChannel`), for clients on this host: no ZeroMQ I/O thread
    between the socket and this thread or the client, so each message wakes one thread. Its
    requests are served like the ROUTER's, and a connection that closes is reported through
    `on_disconnect` the same way, after whatever it sent before closing.

    Raises:
        SchemaError: `bind` is beyond loopback and no `credentials` were given, or `local`
            with `credentials`.
    """

    def __init__(
        self,
        codec: Codec,
        handler: ThreadHandler,
        bind: str = "tcp://127.0.0.1:*",
        credentials: Credentials | None = None,
        name: str = "sluice-rpc",
        on_disconnect: Callable[[bytes], None] | None = None,
        local: bool = False,
    ):
        refuse_unauthenticated(bind, credentials, local)
        self._codec = codec
        self._handler = handler
        self._on_disconnect = on_disconnect
        self._peers: dict[int, set[bytes]] = {}
        """Socket descriptor -> the peers (identities) whose requests came over it."""
        self._gone = RecentlyGone()
        """Peers reported closed: a request of theirs still queued behind the closing is
        dropped, not served."""
        self._sock: zmq.Socket = socket(shared_context(zmq.Context), zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.auth_refused = 0
        self._auth: Any = None
        self._monitor: zmq.Socket | None = None
        events = zmq.EVENT_DISCONNECTED if on_disconnect is not None else 0
        if credentials is not None:
            self._auth = secure_server(self._sock, credentials)
            events |= REFUSALS
        if events:
            self._monitor = monitor(self._sock, events)
        self._sock.bind(bind)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lane = Lane() if local and supported() else None
        self.local_endpoint = self._lane.endpoint if self._lane is not None else ""
        """Where clients on this host reach the local lane ("" without one)."""
        self._poller = zmq.Poller()  # the server thread's alone
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._calls: deque[Callable[[], None]] = deque()
        self._parked: list[tuple[float, int, Pending, str]] = []
        self._open: dict[tuple[bytes, int], Pending] = {}
        self._seq = itertools.count()
        self._closed = False
        self._lane_retry = 0.0  # when a paused lane accepts again (monotonic)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn()` in the server thread soon (callable from any thread); an exception it
        raises is logged, and the service goes on."""
        self._calls.append(fn)
        os.write(self._wake_w, b"x")

    def park(self, pending: Pending, timeout: float, what: str) -> None:
        """Keep `pending` for up to `timeout` seconds (inf: until it is answered or its peer
        goes), then fail it with `TimeoutError(what)`.

        Raises:
            SchemaError: `timeout` is not a number (NaN): the request gets it as its answer.
        """
        if math.isnan(timeout):
            raise SchemaError("a request's timeout must be a number of seconds, not NaN")
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
        if self._lane is not None and identity in self._lane.peers:
            stuck = self._lane.send(identity, self._codec.encode_now(rid, msg))
            if stuck is not None:  # queued (bounded: `Lane.send` cuts a peer that stopped reading)
                self._poller.register(stuck.sock.fileno(), zmq.POLLIN | zmq.POLLOUT)
            return
        try:
            self._sock.send_multipart([identity, *self._codec.encode_now(rid, msg)], copy=False)
        except zmq.ZMQError:
            log.debug("reply to a vanished peer dropped")

    def _loop(self) -> None:
        poller = self._poller
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        lane = self._lane
        if lane is not None:
            poller.register(lane.listener.fileno(), zmq.POLLIN)
        try:
            while not self._closed:
                timeout: int | None = None
                due = [self._parked[0][0]] if self._parked else []
                if lane is not None and lane.paused:
                    due.append(self._lane_retry)
                if due:  # in ms, a C int: a wait of days (or inf) wakes daily to look again
                    timeout = int(min(max(0.0, min(due) - time.monotonic()), _LONGEST_WAIT) * 1000)
                ready = dict(poller.poll(timeout))
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                while self._calls:
                    call = self._calls.popleft()
                    try:
                        call()
                    except Exception:  # noqa: BLE001 - one failed call must not end the service
                        log.exception("a call submitted to the %s service failed", self._thread.name)
                if self._monitor is not None and self._monitor in ready:
                    self._events()
                while self._sock.poll(0, zmq.POLLIN):
                    self._serve(self._sock.recv_multipart(copy=False))
                if lane is not None:
                    self._serve_lane(lane, poller, ready)
                self._expire()
        finally:
            if lane is not None:
                lane.close()
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._sock.close(linger=0)

    def _events(self) -> None:
        """Take the monitor's events: refused handshakes, and closed connections."""
        assert self._monitor is not None  # called only with a monitor
        while self._monitor.poll(0):
            frames = self._monitor.recv_multipart()
            self.auth_refused += refusals(frames)
            event, fd = struct.unpack("=Hi", bytes(frames[0])[:6])
            if event == zmq.EVENT_DISCONNECTED:
                self._disconnected(fd)

    def _disconnected(self, fd: int) -> None:
        """The connection on descriptor `fd` closed: drop its peers' open requests, report them."""
        for peer in self._peers.pop(fd, ()):
            self._gone.add(peer)
            self._peer_gone(peer)

    def _peer_gone(self, peer: bytes) -> None:
        """Drop `peer`'s open requests and report it (`on_disconnect`)."""
        for key in [k for k in self._open if k[0] == peer]:
            self._open.pop(key).done = True
        if self._on_disconnect is None:
            return
        try:
            self._on_disconnect(peer)
        except Exception:  # noqa: BLE001 - the service's cleanup failing must not end the loop
            log.exception("cleaning up after a disconnected client failed")

    def _serve_lane(self, lane: Lane, poller: zmq.Poller, ready: dict) -> None:
        """Take the local lane's new connections, send what waits for a peer's socket, serve
        what its peers sent."""
        # the poller names plain sockets by their descriptors
        for fd in [k for k in ready if isinstance(k, int) and k in lane.by_fd]:
            peer = lane.by_fd[fd]
            if ready[fd] & zmq.POLLOUT and not lane.flush(peer):
                poller.register(fd, zmq.POLLIN)  # all sent: wait for its requests alone again
            messages, closed = lane.receive(peer)
            for frames in messages:
                self._dispatch(peer.identity, frames)
            if closed:
                poller.unregister(fd)
                lane.drop(peer)
                self._peer_gone(peer.identity)
                self._lane_retry = 0.0  # its descriptor is free: a paused lane tries again now
        listener = lane.listener.fileno()
        if lane.paused and time.monotonic() >= self._lane_retry:
            lane.resume()
            poller.register(listener, zmq.POLLIN)
        elif listener not in ready:
            return
        while (joined := lane.accept()) is not None:
            poller.register(joined.sock.fileno(), zmq.POLLIN)
        if lane.paused:  # it stays readable while a connection waits: not watched until the retry
            poller.unregister(listener)
            self._lane_retry = time.monotonic() + _local.ACCEPT_RETRY

    def _serve(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        if self._on_disconnect is not None and len(frames) > 1:
            # closings seen before this request are settled first: its descriptor may be one
            # a closed connection freed (that closing is in the monitor by now)
            self._events()
            if identity in self._gone:
                return  # sent before its connection closed: nobody is left to answer
            fd = frames[1].get(zmq.SRCFD)
            if identity not in self._peers.get(fd, ()) and fd >= 0 and hung_up(fd):
                # its first, read once its connection closed: served (a notice such as a
                # `Release` still counts), then its peer reported gone, so that what it was
                # given is let go at once
                self._gone.add(identity)
                self._dispatch(identity, frames[1:])
                self._peer_gone(identity)
                return
            self._peers.setdefault(fd, set()).add(identity)
        self._dispatch(identity, frames[1:])

    def _dispatch(self, identity: bytes, frames: list[Any]) -> None:
        """Serve one request (its frames after the identity) from `identity`."""
        rid = 0
        try:
            rid, msg, _ = self._codec.decode(frames)
        except ProtocolError as exc:
            self._send(identity, exc.request_id or rid, error_reply(exc))
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
