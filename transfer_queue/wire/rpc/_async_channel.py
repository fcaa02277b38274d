"""The asyncio client channel: one DEALER to one service, shared by any number of coroutines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..auth import Credentials
from ..errors import ProtocolError, ServiceError, SluiceError, TimeoutError
from ._calls import AsyncCalls
from ._codec import DEAD_AFTER, GRACE, Codec, Message, Ping, log
from ._context import shared_context
from ._peer import _Peer


class AsyncChannel(_Peer, AsyncCalls):
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
            shared_context(zmq.asyncio.Context),
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
        self._posting = 0  # posted requests the socket has not taken yet
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
        except BaseException:  # cancelled, or the channel closed underneath
            self._waiting.pop(rid, None)
            raise
        return rid

    def post(self, msg: Message, data: Sequence[Any] = ()) -> None:
        """Send a request whose reply nobody awaits (it goes to `on_reply`) without blocking: at
        once when the peer takes it, else queued on the socket, in order, until it does (or the
        channel closes). Nothing posted is dropped while the channel is open (a lost `Free` would
        leak a unit's bytes, a lost `Ping` make a busy unit look dead), and the send goes through
        the asyncio socket so that it never swallows the readiness event the reader waits on.
        `close` drops the posts not yet handed to ZeroMQ (its high-water mark reached, or no
        connection up: `IMMEDIATE`; a client leaves a channel for its lane only once `idle`), and
        a closed channel drops a new post: its peer is gone."""
        if self.sock.closed:
            return
        sent = self.sock.send_multipart(self.codec.encode(next(self._ids), msg, data), copy=False)
        self._posting += 1
        sent.add_done_callback(self._posted)

    def _posted(self, sent: asyncio.Future) -> None:
        self._posting -= 1
        _retrieve(sent)

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self.sock.closed

    @property
    def idle(self) -> bool:
        """Whether nothing sent here is in flight: no request awaits its reply (or is being
        sent), no posted one waits to be handed to ZeroMQ. Closing the channel then fails no
        call and drops no notice (those ZeroMQ holds go out as its socket lingers, `_Peer`)."""
        return not self._waiting and not self._posting

    async def _ping(self) -> None:
        try:
            await self.sock.send_multipart(self.codec.encode(next(self._ids), Ping()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no connection: the silence tells

    def close(self) -> None:
        """Close the socket; requests still awaiting replies fail with `lost` at once, posts not
        yet handed to ZeroMQ (waiting for its high-water mark, or for a connection under
        `IMMEDIATE`) are dropped, those it holds still go out (`_Peer`)."""
        self._reader.cancel()
        self.sock.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self.lost(f"the channel to {self.name} was closed"))
                fut.exception()  # retrieved: whoever still awaits it gets it, nobody else is warned


def _retrieve(sent: asyncio.Future) -> None:
    """Done-callback of a posted send: one ended by `close()` has nothing to report."""
    if not sent.cancelled():
        sent.exception()
