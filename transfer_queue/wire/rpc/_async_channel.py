"""The asyncio client channel: one DEALER to one service, shared by any number of coroutines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from ..auth import Credentials
from ..errors import ProtocolError, ServiceError, SluiceError, TimeoutError, error_from_code
from ._codec import DEAD_AFTER, GRACE, Cancel, Codec, ErrorReply, Message, Ping, log
from ._context import shared_context
from ._peer import _Peer


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
                fut.exception()  # retrieved: whoever still awaits it gets it, nobody else is warned


def _retrieve(sent: asyncio.Future) -> None:
    """Done-callback of a posted send: one ended by `close()` has nothing to report."""
    if not sent.cancelled():
        sent.exception()
