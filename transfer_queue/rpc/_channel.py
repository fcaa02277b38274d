"""Client channels: one DEALER to one service each, blocking (`Channel`) or asyncio
(`AsyncChannel`), sharing ids, deadlines and liveness (`_Peer`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from .._auth import Credentials, secure_client
from .._errors import ProtocolError, ServiceError, SluiceError, TimeoutError, error_from_code
from ._codec import DEAD_AFTER, GRACE, PROBE_AFTER, Cancel, Codec, ErrorReply, Message, Ping, log

# -- client channels -----------------------------------------------------------------------


class _Peer:
    """One DEALER to one endpoint, and what both channels decide without I/O: ids, liveness,
    deadlines. `lost` is raised when the peer is unreachable or silent for `dead_after` s (pinged
    after `PROBE_AFTER` s), `late` at a deadline."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None,
        hint: str,
        credentials: Credentials | None,
        timeout: float,
        connect_timeout: float,
        dead_after: float,
        lost: type[SluiceError],
        late: type[SluiceError],
    ):
        self.endpoint = endpoint
        self.name = name or f"the service at {endpoint}"
        self.codec = replies
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.dead_after = dead_after
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

        Raises `late` at `deadline`, `lost` once the peer is silent for `dead_after` s."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self.late(f"{self.name} did not answer {what} within {deadline - since:g}s; is it still running?")
        quiet = now - max(self.heard, since)
        if quiet > self.dead_after:
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
    reported at once (`lost`) instead of after `dead_after` s of silence.
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
            zmq.Context.instance(),
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
        self._expected.add(rid)
        return rid

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

        Raises:
            SluiceError: (`late`) no answer within `wait`; (`lost`) the peer is silent for
                `dead_after` s or dropped the connection.
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
        self._expected.discard(rid)
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
        self._expected.discard(rid)
        return self._stash.pop(rid, None)

    def forget(self, rid: int) -> None:
        """Drop `rid`'s reply if it came (the request was abandoned without a cancel)."""
        self._expected.discard(rid)
        self._stash.pop(rid, None)

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
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)


class AsyncChannel(_Peer):
    """The asyncio twin of `Channel`: one reader task resolves the future of whichever request
    a reply answers, so any number of coroutines may share it. Replies nobody awaits (to
    `post`ed requests) go to `on_reply`."""

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
        on_reply: Callable[[Any], None] | None = None,
    ):
        super().__init__(
            zmq.asyncio.Context.instance(),
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
        self._waiting: dict[int, asyncio.Future] = {}
        self._on_reply = on_reply
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
        if self.sock.closed:
            raise self.lost(f"the channel to {self.name} was closed")
        rid = next(self._ids)
        frames = self.codec.encode(rid, msg, data)
        self._waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            await self.sock.send_multipart(frames, copy=False)
        except zmq.Again:
            self._waiting.pop(rid, None)
            raise self._unreachable() from None
        return rid

    def post(self, msg: Message, data: Sequence[Any] = ()) -> None:
        """Send a request whose reply nobody awaits (it goes to `on_reply`) without blocking: at
        once when the peer takes it, else queued on the socket, in order, until it does (or the
        channel closes). Nothing posted is dropped (a lost `Free` would leak a unit's bytes, a
        lost `Ping` make a busy unit look dead), and the send goes through the asyncio socket so
        that it never swallows the readiness event the reader waits on. A closed channel drops it:
        its peer is gone."""
        if self.sock.closed:
            return
        sent = self.sock.send_multipart(self.codec.encode(next(self._ids), msg, data), copy=False)
        sent.add_done_callback(_retrieve)

    async def reply(
        self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request"
    ) -> tuple[Any, list[Any]]:
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
        """Send `msg` and return its reply (see `Channel.call`); a call cancelled by its caller
        withdraws its request at the service (`Cancel`), so nothing parked there outlives it."""
        rid = await self.send(msg, data)
        try:
            reply, _ = await self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        except asyncio.CancelledError:
            if not self.dead and not self.sock.closed and not isinstance(msg, Cancel):
                self.post(Cancel(rid))
            raise
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
        """Close the socket; requests still awaiting replies fail with `lost` at once."""
        self._reader.cancel()
        self.sock.close(linger=0)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self.lost(f"the channel to {self.name} was closed"))


def _retrieve(sent: asyncio.Future) -> None:
    """Done-callback of a posted send: one ended by `close()` has nothing to report."""
    if not sent.cancelled():
        sent.exception()
