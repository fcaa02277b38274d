"""The asyncio service loop (controller, storage units)."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import signal
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from ..auth import REFUSALS, Credentials, secure_server
from ..errors import ProtocolError
from . import _local
from ._codec import SOCKET_BUFFER_BYTES, Cancel, Codec, Message, Ok, Ping, error_reply, log, refuse_unauthenticated
from ._context import monitor, shared_context, socket
from ._local import Lane, _LanePeer, supported
from ._peers import PEER_EVENTS, PeerWatch

# -- asyncio service -----------------------------------------------------------------------

HANDLING_KEPT = 4096
"""Requests whose handling time a `Service` keeps (`handling`), for its status's percentiles."""

current_peer: contextvars.ContextVar[bytes] = contextvars.ContextVar("current_peer", default=b"")
"""The routing identity of the connection whose request a `Service` handler is running (one per
connection: a handler may count what each peer holds)."""

Handled = Message | tuple[Message, list[Any]]
Handler = Callable[[Any, list[Any]], Handled | Awaitable[Handled | None] | None]


class Service:
    """A ROUTER socket bound to `bind`, dispatching decoded requests to typed handlers (asyncio).

    A handler returns a reply (optionally with data frames) at once, or a coroutine when it must
    wait (for samples, budget, space): that coroutine runs as its own task, so a parked request
    never delays anyone else, and a `Cancel` from its client cancels it. A handler of a notice
    (a message its sender posts and needs no answer to) returns None: only a refusal is answered. Malformed input gets an
    `ErrorReply` and is counted (`rejected`). With `credentials` it is a CurveZMQ server
    admitting only the cluster's clients (refused handshakes counted in `auth_refused`).

    The ROUTER is read without a future per message: the event loop watches its file descriptor
    and a callback drains every queued request with non-blocking reads; replies are non-blocking
    sends (this halves the CPU a request costs compared with `zmq.asyncio` awaits).

    With `local` (on Linux) the loop also serves a local lane (`local_endpoint`, "" without it;
    clients: `LocalChannel`, `AsyncLocalChannel`): a Unix socket for clients of this user on
    this host, read by the loop itself, so each message wakes one thread instead of three. Its
    requests are served exactly as the ROUTER's (the same handlers, errors, parked requests and
    `Cancel`, `current_peer` naming the connection, `max_frame_bytes` bounding each data frame),
    and a connection that closes ends its parked requests and is reported to `on_peer_gone`
    after whatever it sent before closing.

    Raises:
        SchemaError: `bind` is beyond loopback and no `credentials` were given, or `local`
            with `credentials`.
    """

    def __init__(
        self,
        codec: Codec,
        bind: str,
        max_frame_bytes: int = -1,
        credentials: Credentials | None = None,
        local: bool = False,
    ):
        refuse_unauthenticated(bind, credentials, local)
        self.codec = codec
        self.handlers: dict[type, Handler] = {}
        self.ctx = shared_context(zmq.asyncio.Context)
        self.sock = socket(self.ctx, zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if max_frame_bytes > 0:
            self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.auth_refused = 0
        self._auth = None
        if credentials is not None:
            self._auth = secure_server(self.sock, credentials)
        events = monitor(self.sock, PEER_EVENTS | (REFUSALS if credentials is not None else 0))
        self._monitor: zmq.Socket = zmq.Socket.shadow(events.underlying)
        self._monitor_owner = events  # keeps the monitor socket open as long as the service
        self.peers = PeerWatch(self._peer_gone, self._read_events)
        self.on_peer_gone: Callable[[bytes], None] | None = None
        """Called with the routing identity of a peer whose connection closed (`current_peer`
        named it to the handlers), after its parked requests were withdrawn; called again after
        each message of that peer read once its close was (`PeerWatch.seen`), so that what the
        message made it hold is let go at once: it must free whatever the peer holds *now*."""
        self.sock.bind(bind)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lane = Lane(max_frame_bytes) if local and supported() else None
        self.local_endpoint = self._lane.endpoint if self._lane is not None else ""
        """Where clients on this host reach the local lane ("" without one)."""
        self._lane_retry: asyncio.TimerHandle | None = None  # a paused lane's next accept
        self._plain: zmq.Socket = zmq.Socket.shadow(self.sock.underlying)  # the same socket, without futures
        self._drain_pending = False
        self._draining = False
        self.rejected = 0
        self.served = 0
        self._tasks: dict[tuple[bytes, int], asyncio.Task] = {}
        self._serving: asyncio.Task | None = None
        self.handling: deque[int] = deque(maxlen=HANDLING_KEPT)
        """Nanoseconds the loop spent on each of the last `HANDLING_KEPT` requests: decoding,
        the handler's own step (not what a parked request waits for) and the reply."""

    def _read_events(self) -> None:
        """Take every queued monitor event: refused handshakes are counted, connections' ends
        reported (`PeerWatch`). Edge-triggered like the ROUTER: read until empty."""
        while not self._monitor.closed:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed underneath us: the service is stopping
                return
            if refusals(frames):
                self.auth_refused += 1
            else:
                self.peers.event(frames)

    def _peer_gone(self, identity: bytes) -> None:
        for key in [k for k in self._tasks if k[0] == identity]:
            self._tasks.pop(key).cancel()  # nobody is left to answer
        if self.on_peer_gone is not None:
            self.on_peer_gone(identity)

    @property
    def connections(self) -> int:
        """Client connections open now: the ROUTER's peers that sent something, and the lane's."""
        return len(self.peers) + (len(self._lane.peers) if self._lane is not None else 0)

    def route(self, msg_type: type, handler: Handler) -> None:
        self.handlers[msg_type] = handler

    def stop(self) -> None:
        if self._serving is not None:
            self._serving.cancel()

    async def serve(self) -> None:
        """Serve until `stop()` (or until the task running this is cancelled)."""
        self._serving = asyncio.current_task()
        loop = asyncio.get_running_loop()
        fd: int = self.sock.getsockopt(zmq.FD)
        events: int = self._monitor.getsockopt(zmq.FD)  # type: ignore[assignment]
        loop.add_reader(fd, self._drain)
        loop.add_reader(events, self._read_events)
        if self._lane is not None:
            loop.add_reader(self._lane.listener.fileno(), self._lane_accept)
        try:
            self._read_events()
            self._drain()  # requests that came before the reader was registered
            await loop.create_future()  # until cancelled
        except asyncio.CancelledError:
            pass
        finally:
            loop.remove_reader(fd)
            loop.remove_reader(events)
            if self._lane_retry is not None:
                self._lane_retry.cancel()
            if self._lane is not None:
                for peer_fd in [self._lane.listener.fileno(), *self._lane.by_fd]:
                    loop.remove_reader(peer_fd)
                    loop.remove_writer(peer_fd)
                self._lane.close()
            for task in list(self._tasks.values()):
                task.cancel()
            if self._auth is not None:
                self._auth.stop()
            self.sock.disable_monitor()
            self._monitor_owner.close(linger=0)
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
                self._dispatch(frames[0], frames[1:])
        finally:
            self._draining = False
        self._schedule_drain()  # budget used up: let timers and tasks run, then go on

    def _schedule_drain(self) -> None:
        if not self._drain_pending and self._serving is not None:
            self._drain_pending = True
            self._serving.get_loop().call_soon(self._drain)

    def _lane_accept(self) -> None:
        """Take the local lane's new connections (those of this user) and read each as it comes.
        A lane that cannot accept now (`Lane.paused`) is not watched until `_lane_resume`."""
        assert self._lane is not None and self._serving is not None
        loop = self._serving.get_loop()
        while (peer := self._lane.accept()) is not None:
            loop.add_reader(peer.sock.fileno(), self._lane_read, peer)
        if self._lane.paused:
            loop.remove_reader(self._lane.listener.fileno())
            self._lane_retry = loop.call_later(_local.ACCEPT_RETRY, self._lane_resume)

    def _lane_resume(self) -> None:
        """Watch a paused lane's listener again and accept what waits (its retry is due, or one
        of its peers left)."""
        assert self._lane is not None and self._serving is not None
        if self._lane_retry is not None:
            self._lane_retry.cancel()
            self._lane_retry = None
        self._lane.resume()
        self._serving.get_loop().add_reader(self._lane.listener.fileno(), self._lane_accept)
        self._lane_accept()

    def _lane_read(self, peer: _LanePeer) -> None:
        """Serve what a lane peer sent; once its connection closed, end it as the ROUTER's
        closings are (`_peer_gone`), after those requests."""
        assert self._lane is not None and self._serving is not None
        messages, closed = self._lane.receive(peer)
        for frames in messages:
            self._dispatch(peer.identity, frames)
        if closed:
            loop = self._serving.get_loop()
            loop.remove_reader(peer.sock.fileno())
            loop.remove_writer(peer.sock.fileno())
            self._lane.drop(peer)
            self._peer_gone(peer.identity)
            if self._lane.paused:  # its descriptor is free
                self._lane_resume()

    def _lane_flush(self, peer: _LanePeer) -> None:
        """Send the replies queued for a lane peer now its socket is writable; stop watching it
        once they are all sent."""
        assert self._lane is not None and self._serving is not None
        if not self._lane.flush(peer):
            self._serving.get_loop().remove_writer(peer.sock.fileno())

    def _dispatch(self, identity: Any, body: list[Any]) -> None:
        """Serve one request: its frames after the identity (a ROUTER frame, or a lane peer's bytes)."""
        started = time.perf_counter_ns()
        try:
            self._handle(identity, body)
        finally:
            self.handling.append(time.perf_counter_ns() - started)

    def _handle(self, identity: Any, body: list[Any]) -> None:
        lane = isinstance(identity, bytes)
        key: bytes = identity if lane else identity.bytes
        if body and len(body[0].bytes if hasattr(body[0], "bytes") else body[0]) == 0:
            body = body[1:]  # REQ peers add an empty delimiter
        request_id = 0
        closed = False  # its connection closed before this was read: reported gone once served
        try:
            request_id, msg, data = self.codec.decode(body)
            closed = not lane and self.peers.seen(identity)
            if isinstance(msg, Cancel):
                parked = (key, msg.request_id)
                task = self._tasks.get(parked)
                if task is not None and task.done():
                    # done, its answer not yet sent (its callback is still queued): it goes
                    # first, so that the caller gives back what it holds
                    self._finish(parked, identity, msg.request_id, task)
                elif task is not None:
                    del self._tasks[parked]
                    task.cancel()
                self._reply(identity, request_id, Ok())
                return
            if isinstance(msg, Ping):
                self._reply(identity, request_id, Ok())
                return
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{type(msg).__name__} is not served here")
            current_peer.set(key)  # seen by the handler and by the task of its coroutine
            result = handler(msg, data)
        except ProtocolError as exc:
            self.rejected += 1
            self._reply(identity, exc.request_id or request_id, error_reply(exc))
            return
        except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
            self._reply(identity, request_id, error_reply(exc))
            return
        else:
            if result is None:  # a notice, taken
                self.served += 1
            elif inspect.isawaitable(result):
                # the handler's coroutine is the task: a `Cancel` that comes before its first step
                # still closes it (a wrapper task cancelled that early would leave it never awaited)
                parked = (key, request_id)
                task = asyncio.ensure_future(result)
                self._tasks[parked] = task
                task.add_done_callback(lambda done: self._finish(parked, identity, request_id, done))
            else:
                self._reply(identity, request_id, result)
        finally:
            if closed:  # what it was just given (a put, a parked request) is let go at once
                self._peer_gone(key)

    def _finish(self, key: tuple[bytes, int], identity: Any, request_id: int, task: asyncio.Future) -> None:
        """Answer a parked request once its task is done: with its result, or its error as an
        `ErrorReply`; nothing when it was withdrawn (`Cancel`), the service stopped, or it
        took a notice (None), or a `Cancel` that came once it was done answered it already."""
        if self._tasks.pop(key, None) is None:
            return
        if task.cancelled():
            return
        exc = task.exception()
        result = task.result() if exc is None else error_reply(exc)
        if result is not None:
            self._reply(identity, request_id, result)

    def _reply(self, identity: Any, request_id: int, result: Handled) -> None:
        msg, data = result if isinstance(result, tuple) else (result, [])
        self.served += 1
        if isinstance(identity, bytes):  # a lane peer: the reply goes to its socket, or waits for it
            assert self._lane is not None and self._serving is not None
            stuck = self._lane.send(identity, self.codec.encode_now(request_id, msg, data))
            if stuck is not None:
                self._serving.get_loop().add_writer(stuck.sock.fileno(), self._lane_flush, stuck)
            return
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


def refusals(frames: list[Any]) -> int:
    """1 if the monitor event (its frames) is a refused handshake, else 0."""
    (event,) = struct.unpack("=H", bytes(frames[0])[:2])
    return 1 if event & REFUSALS else 0
