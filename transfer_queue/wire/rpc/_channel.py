"""The blocking client channel: one DEALER to one service, used from one thread."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq

from ..auth import Credentials
from ..errors import ProtocolError, ServiceError, SluiceError, TimeoutError
from ._calls import SyncCalls
from ._codec import DEAD_AFTER, GRACE, Codec, Message, Ping, log
from ._context import monitor, shared_context
from ._peer import _Peer


class Channel(_Peer, SyncCalls):
    """A blocking request/reply channel to one service, used from one thread.

    `send` puts a request on the wire and returns its id; `reply(rid)` waits for that request's
    answer (others that arrive meanwhile are kept for their own `reply`); `call` does both and
    raises an `ErrorReply` as its `tq.*` error; `cancel` withdraws a request at the service.
    With `watch_disconnect`, a peer that drops the connection while a reply is awaited is
    reported at once (`lost`) instead of after `dead_after` s of silence. The socket monitor that
    tells it is attached only while requests await replies: libzmq sends monitor events from the
    process's shared I/O thread and blocks there once a monitor's queue is full, so an idle
    channel's monitor, unread, would stop every socket of the process after a few thousand
    refused reconnects (a peer that drops each connection, e.g. refusing the credentials).
    """

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None = None,
        hint: str = "",
        credentials: Credentials | None = None,
        timeout: float = GRACE,
        connect_timeout: float = DEAD_AFTER,
        dead_after: float = DEAD_AFTER,
        lost: type[SluiceError] = ServiceError,
        late: type[SluiceError] = TimeoutError,
        watch_disconnect: bool = False,
    ):
        super().__init__(
            shared_context(zmq.Context),
            endpoint,
            replies,
            name=name,
            hint=hint,
            credentials=credentials,
            timeout=timeout,
            connect_timeout=connect_timeout,
            dead_after=dead_after,
            lost=lost,
            late=late,
        )
        self._stash: dict[int, tuple[Any, list[Any]]] = {}
        self._expected: set[int] = set()  # ids of requests `send` made; other replies are dropped
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._watch = watch_disconnect
        self._monitor: zmq.Socket | None = None
        self._overdue: set[int] = set()  # expected ids whose `reply` raised: kept for `cancel`, not watched
        self._interrupt: int | None = None

    def interrupt_on(self, fd: int) -> None:
        """End a wait for a reply (raising `lost`) as soon as `fd` is readable: how a driver
        closed from another thread stops the call waiting here (the channel itself is used by
        one thread at a time; closing its socket under a wait would be undefined in ZeroMQ)."""
        self._interrupt = fd
        self._poller.register(fd, zmq.POLLIN)

    def send(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Send a request; returns its id.

        Raises:
            SchemaError: `msg` cannot be encoded.
            SluiceError: (`lost`) no connection to the peer within `connect_timeout`.
        """
        rid = next(self._ids)
        frames = self.codec.encode_now(rid, msg, data)
        if self._watch:
            self._watching()
        try:
            self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            error = self._unreachable()
            self._settled()
            raise error from None
        except BaseException:
            self._settled()
            raise
        self._expected.add(rid)
        return rid

    def _watching(self) -> None:
        """Attach the disconnect monitor before a request goes out (a drop from then on is
        seen), or drop what an attached one saw before this request: that is history."""
        if self._monitor is None:
            self._monitor = monitor(self.sock, zmq.EVENT_DISCONNECTED)
            self._poller.register(self._monitor, zmq.POLLIN)
        else:
            while self._monitor.poll(0):
                self._monitor.recv_multipart()

    def _settled(self) -> None:
        """Detach the disconnect monitor once no request awaits a reply anyone waits for (one
        whose `reply` raised is left for `cancel`), or the peer was found gone: an idle channel
        must hold no monitor (class docstring)."""
        self._overdue &= self._expected
        if self.dead or self._expected <= self._overdue:
            self._unwatch()

    def _unwatch(self) -> None:
        if self._monitor is not None:
            self._poller.unregister(self._monitor)
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    @property
    def idle(self) -> bool:
        """Whether no request sent here awaits its reply: closing the channel then fails no call
        and drops no posted notice (those ZeroMQ holds go out as its socket lingers, `_Peer`)."""
        return not self._expected

    def post(self, msg: Message, data: Sequence[Any] = ()) -> None:
        """Send a notice: a request nobody awaits an answer to (a refusal, if one comes, is
        dropped; the service reports it its own way).

        Raises:
            SchemaError: `msg` cannot be encoded.
            SluiceError: (`lost`) no connection to the peer within `connect_timeout`.
        """
        try:
            self.sock.send_multipart(self.codec.encode_now(next(self._ids), msg, data), copy=False)
        except zmq.Again:
            raise self._unreachable() from None

    def reply(
        self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request"
    ) -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid`, awaited since `since` (default: now) for at
        most `wait` seconds (None: as long as the peer is alive).

        When this raises, the request stays awaited for `cancel(rid)` or another `reply`;
        `forget(rid)` drops it.

        Raises:
            SluiceError: (`late`) no answer within `wait`; (`lost`) the peer is silent for
                `dead_after` s or dropped the connection.
        """
        since = time.monotonic() if since is None else since
        deadline = self._deadline(since, wait)
        if rid in self._overdue:  # awaited again: watched again (what a monitor holds is news to it)
            self._overdue.discard(rid)
            if self._watch and self._monitor is None:
                self._watching()
        try:
            while rid not in self._stash:
                ping, left = self._step(since, deadline, what)
                if ping:
                    self._ping()
                ready = dict(self._poller.poll(int(left * 1000) + 1))
                if self._monitor is not None and self._monitor in ready:
                    self.dead = True
                    raise self.lost(f"{self.name} dropped the connection (gone?)")
                if self._interrupt in ready:
                    raise self.lost(f"the wait for {self.name} was interrupted: the client is closing")
                while self.sock.poll(0):
                    self._take(self.sock.recv_multipart(copy=False))
            self._expected.discard(rid)
            return self._stash.pop(rid)
        except BaseException:
            self._overdue.add(rid)
            raise
        finally:
            self._settled()

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

    def _ping(self) -> None:
        rid = next(self._ids)  # not expected: its Ok is dropped on arrival
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
        if rid in self._expected:
            self._stash[rid] = (msg, data)

    def close(self) -> None:
        """Close the socket at once; what ZeroMQ holds of what was sent still goes out (`_Peer`)."""
        self._unwatch()
        self.sock.close()
