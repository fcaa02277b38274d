"""The calls a client channel builds on its own `send` and `reply`: `call`, `cancel` and
`forget`, once for the blocking channels (`Channel`, `LocalChannel`) and once for the asyncio
ones (`AsyncChannel`, `AsyncLocalChannel`), whatever carries their messages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError, error_from_code
from ._codec import GRACE, Cancel, ErrorReply, Message


class SyncCalls:
    """`call`, `cancel` and `forget` over a blocking channel's `send` and `reply`; the channel
    keeps the ids it awaits in `_expected` and replies that came before they were asked for
    in `_stash`."""

    timeout: float
    _expected: set[int]
    _stash: dict[int, tuple[Any, list[Any]]]

    if TYPE_CHECKING:  # the channel's own

        def send(self, msg: Message, data: Sequence[Any] = ()) -> int: ...

        def reply(
            self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request"
        ) -> tuple[Any, list[Any]]: ...

    def call(self, msg: Message, timeout: float | None = None, data: Sequence[Any] = ()) -> Any:
        """Send `msg` and return its reply, waiting at most `timeout` s (default: the channel's).

        Raises:
            SluiceError: the `tq.*` error the service answered with, or as `send` and `reply`.
        """
        rid = self.send(msg, data)
        try:
            reply, _ = self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        except BaseException:
            self.forget(rid)  # nobody else knows `rid`: its late reply is dropped
            raise
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    def cancel(self, rid: int) -> tuple[Any, list[Any]] | None:
        """Withdraw request `rid` at the service; its reply if that had already been sent (the
        caller gives back what it holds), else None: it will never come.

        Raises:
            SluiceError: as `send` and `reply` (the peer is gone: its own timers free what it held).
        """
        self.call(Cancel(rid), GRACE)
        answer = self._stash.pop(rid, None)
        self.forget(rid)
        return answer

    def forget(self, rid: int) -> None:
        """Drop `rid`'s reply if it came (the request was abandoned without a cancel)."""
        self._expected.discard(rid)
        self._stash.pop(rid, None)
        self._settled()

    def _settled(self) -> None:
        """What a channel does once fewer requests await replies (nothing, unless it says)."""


class AsyncCalls:
    """`call`, `cancel` and `forget` over an asyncio channel's `send`, `reply` and `post`; the
    channel keeps a future per awaited id in `_waiting`, and says whether it is `closed` and
    its peer `dead`."""

    timeout: float
    dead: bool
    _waiting: dict[int, asyncio.Future]

    if TYPE_CHECKING:  # the channel's own

        @property
        def closed(self) -> bool: ...

        async def send(self, msg: Message, data: Sequence[Any] = ()) -> int: ...

        def post(self, msg: Message, data: Sequence[Any] = ()) -> None: ...

        def _step(self, since: float, deadline: float | None, what: str) -> tuple[bool, float]: ...

        def _deadline(self, since: float, wait: float | None) -> float | None: ...

    async def _ping(self) -> None:
        """Send the peer a `Ping` without waiting for room (its `Ok` finds no future and is
        dropped: hearing it is enough)."""
        raise NotImplementedError

    async def reply(
        self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request"
    ) -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid` (see `Channel.reply`: pings after a silence,
        `late` at the deadline, `lost` once the peer is silent for `dead_after` s); when this
        raises (or is cancelled), `cancel(rid)` or `forget(rid)` the request.

        Raises:
            ProtocolError: `rid` was not sent here, or its reply was taken.
        """
        fut = self._waiting.get(rid)
        if fut is None:
            raise ProtocolError(f"request {rid} was not sent on this channel, or its reply was taken")
        since = time.monotonic() if since is None else since
        deadline = self._deadline(since, wait)
        while True:
            ping, left = self._step(since, deadline, what)
            if ping:
                await self._ping()
            done, _ = await asyncio.wait({fut}, timeout=left)
            if done:
                self._waiting.pop(rid, None)
                return fut.result()

    async def call(self, msg: Message, timeout: float | None = None, data: Sequence[Any] = ()) -> Any:
        """Send `msg` and return its reply (see `SyncCalls.call`); a call cancelled by its caller
        withdraws its request at the service (`Cancel`), so nothing parked there outlives it.

        Raises:
            SluiceError: the `tq.*` error the service answered with, or as `send` and `reply`.
        """
        rid = await self.send(msg, data)
        try:
            reply, _ = await self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        except asyncio.CancelledError:
            if not self.dead and not self.closed and not isinstance(msg, Cancel):
                self.post(Cancel(rid))
            raise
        finally:
            self._waiting.pop(rid, None)
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    async def cancel(self, rid: int) -> tuple[Any, list[Any]] | None:
        """Withdraw request `rid` (see `SyncCalls.cancel`)."""
        fut = self._waiting.get(rid)
        try:
            await self.call(Cancel(rid), GRACE)
        finally:
            self._waiting.pop(rid, None)
        return fut.result() if fut is not None and fut.done() and not fut.cancelled() else None

    def forget(self, rid: int) -> None:
        """Stop awaiting `rid`'s reply."""
        self._waiting.pop(rid, None)
