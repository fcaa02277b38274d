"""What a flow is (`Call`, `Flow`), and the two flow drivers side by side: `SyncDriver` over
blocking `rpc.Channel`s and `AsyncDriver` over `rpc.AsyncChannel`s (one channel per service). They differ only where
they touch the socket. A failed, timed-out or interrupted step is withdrawn at every service
it reached (`Cancel`; what a reply granted meanwhile is given back with `ControlCore.undo`),
then thrown into the flow so that its own clean-up runs before the error propagates. A closed
driver raises `ClosedError`; ZeroMQ failures and builtin `ValueError`/`TypeError` become
`tq.*` errors (`foreign_error`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from ._errors import ClosedError, SchemaError, ServiceError, SluiceError
from .rpc import GRACE, AsyncChannel, Channel, Message, Ok

if TYPE_CHECKING:
    from ._control import ControlCore

__all__ = ["CONTROLLER", "Call", "Flow", "SyncDriver", "AsyncDriver", "foreign_error", "follow"]

CONTROLLER = -1
"""`Call.target` of the controller; storage units are addressed by their unit id."""


@dataclass(frozen=True)
class Call:
    """One request of a flow: `msg` (and raw `data` frames) to `target`, awaited `wait` s."""

    target: int
    msg: Message
    data: Sequence[Any] = ()
    wait: float | None = GRACE
    """Seconds to wait for the reply (None: as long as the service is alive)."""
    notice: bool = False
    """Posted, not awaited: the service answers only a refusal, and reports that its own way
    (a put's write fails its commit). Its reply in the flow is `(None, [])`."""


Flow = Generator[list[Call], list[tuple[Any, list[Any]]], Any]

_NOTICED: tuple[Any, list[Any]] = (None, [])
"""The reply a flow gets for a notice."""


def foreign_error(exc: BaseException) -> BaseException:
    """`exc` as the `tq.*` error a caller expects: ZeroMQ failures are `ServiceError`, a builtin
    `ValueError`/`TypeError` from bad input is `SchemaError`; anything else as it is."""
    if isinstance(exc, SluiceError):
        return exc
    if isinstance(exc, zmq.ZMQError):
        return ServiceError(f"ZeroMQ failed: {exc}; is the cluster still running?")
    if isinstance(exc, (ValueError, TypeError)):
        return SchemaError(f"{type(exc).__name__}: {exc}")
    return exc


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class _InFlight:
    """A flow whose current calls are on the wire: (channel, request id) per call."""

    __slots__ = ("flow", "calls", "sent", "result", "since")

    def __init__(
        self,
        flow: Flow,
        calls: list[Call] | None,
        sent: list[tuple[Channel, int | None]],
        result: Any = None,
        since: float = 0.0,
    ):
        self.flow, self.calls, self.sent, self.result, self.since = flow, calls, sent, result, since


class _Driver:
    """What both drivers hold: the flows' core, one channel per service address, open or closed."""

    def __init__(self, core: ControlCore):
        self._core = core
        self._state = _State.OPEN

    @property
    def address(self) -> str:
        """The controller's endpoint."""
        return self._core.address

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED


class SyncDriver(_Driver):
    """Drives flows over one blocking `rpc.Channel` per service; the base of `Client` and
    `ControlClient`. A failed, timed-out or interrupted step is withdrawn at every service it
    reached (`Cancel`, and what a reply granted meanwhile is given back), then thrown into the
    flow so that its own clean-up runs before the error propagates."""

    def __init__(self, core: ControlCore):
        super().__init__(core)
        self._channels: dict[str, Channel] = {}

    def _channel(self, target: int) -> Channel:
        address = self._core.target_address(target)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._core.channel(target)
        return channel

    def _run(self, flow: Flow) -> Any:
        try:
            return self._finish(self._start(flow))
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            mapped = foreign_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    def _start(self, flow: Flow, replies: list | None = None, error: BaseException | None = None) -> _InFlight:
        if self._state is _State.CLOSED:
            flow.close()
            raise ClosedError("this client was closed; connect a new one")
        try:
            if error is not None:
                calls = flow.throw(error)
            else:
                calls = next(flow) if replies is None else flow.send(replies)
        except StopIteration as stop:
            return _InFlight(flow, None, [], stop.value)
        since = time.monotonic()
        sent: list[tuple[Channel, int | None]] = []
        try:
            for call in calls:
                channel = self._channel(call.target)
                if call.notice:
                    channel.post(call.msg, call.data)
                    sent.append((channel, None))
                else:
                    sent.append((channel, channel.send(call.msg, call.data)))
        except BaseException as exc:
            self._abandon(_InFlight(flow, calls[: len(sent)], sent), close=False)
            return self._start(flow, error=exc)
        return _InFlight(flow, calls, sent, since=since)

    def _finish(self, inflight: _InFlight) -> Any:
        while inflight.calls is not None:
            try:
                replies = [
                    _NOTICED if rid is None else channel.reply(rid, call.wait, inflight.since, type(call.msg).__name__)
                    for call, (channel, rid) in zip(inflight.calls, inflight.sent)
                ]
            except BaseException as exc:  # a timeout, a dead service, Ctrl-C: let the flow clean up
                self._abandon(inflight, close=False)
                inflight = self._start(inflight.flow, error=exc)
                continue
            inflight = self._start(inflight.flow, replies)
        return inflight.result

    def _abandon(self, inflight: _InFlight, close: bool = True) -> None:
        """Withdraw calls still in flight (skipping services reported dead); give back anything
        they were granted meanwhile; with `close`, end the flow too."""
        if inflight.calls is not None and self._state is _State.OPEN:
            for call, (channel, rid) in zip(inflight.calls, inflight.sent):
                if rid is None:  # a notice: nothing to withdraw
                    continue
                if channel.dead:
                    channel.forget(rid)
                    continue
                try:
                    got = channel.cancel(rid)
                    undo = None if got is None else self._core.undo(got[0])
                    if undo is not None:
                        self._run(self._core.one(call.target, undo, Ok))
                except SluiceError:  # that service is gone; its own timers free what it held
                    channel.forget(rid)
        if close:
            inflight.flow.close()

    def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards (`ClosedError`)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


def follow(driver: SyncDriver, after: int, timeout: float) -> Iterator[int]:
    """The blocking `versions` iterator, for `ControlClient` and `Client`."""
    while True:
        for version in driver._run(driver._core.versions_after(after, timeout)):
            yield version
            after = version


class AsyncDriver(_Driver):
    """Drives flows over one `rpc.AsyncChannel` per service (the asyncio twin of
    `_control.SyncDriver`): a failed, timed-out or cancelled step is withdrawn at every service
    it reached, then thrown into the flow so that its clean-up runs before the error propagates."""

    def __init__(self, core: ControlCore):
        super().__init__(core)
        self._channels: dict[str, AsyncChannel] = {}

    def _channel(self, target: int) -> AsyncChannel:
        address = self._core.target_address(target)
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = AsyncChannel(
                address, self._core.codec, **self._core.channel_options(target)
            )
        return channel

    async def _call(self, call: Call) -> tuple[Any, list[Any]]:
        channel = self._channel(call.target)
        if call.notice:
            channel.post(call.msg, call.data)
            return _NOTICED
        rid = await channel.send(call.msg, call.data)
        try:
            return await channel.reply(rid, call.wait, what=type(call.msg).__name__)
        except BaseException:
            await self._withdraw(channel, call, rid)
            raise

    async def _withdraw(self, channel: AsyncChannel, call: Call, rid: int) -> None:
        """Cancel `rid` at the service (unless it was reported dead); give back what its reply
        holds if it was already sent."""
        if self._state is _State.CLOSED or channel.dead:
            channel.forget(rid)
            return
        try:
            got = await channel.cancel(rid)
            undo = None if got is None else self._core.undo(got[0])
            if undo is not None:
                await self._run(self._core.one(call.target, undo, Ok))
        except SluiceError:  # that service is gone; its own timers free what it held
            channel.forget(rid)

    async def _run(self, flow: Flow) -> Any:
        try:
            return await self._drive(flow)
        except (zmq.ZMQError, ValueError, TypeError) as exc:
            mapped = foreign_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc

    async def _drive(self, flow: Flow) -> Any:
        if self._state is _State.CLOSED:
            flow.close()
            raise ClosedError("this client was closed; connect a new one")
        replies: list | None = None
        error: BaseException | None = None
        while True:
            try:
                if error is not None:
                    calls = flow.throw(error)
                else:
                    calls = next(flow) if replies is None else flow.send(replies)
            except StopIteration as stop:
                return stop.value
            tasks = [asyncio.ensure_future(self._call(c)) for c in calls]
            try:
                replies, error = list(await asyncio.gather(*tasks)), None
            except BaseException as exc:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each withdraws its call
                replies, error = None, exc

    async def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards (`ClosedError`)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
