"""The two drivers of flows and plans (`_flows`), side by side: `SyncDriver` over blocking `rpc.Channel`s and `AsyncDriver` over `rpc.AsyncChannel`s (one channel per service).
They differ only where they touch the socket. A failed, timed-out or interrupted step is
withdrawn at every service it reached (`Cancel`; what a reply granted meanwhile is given back
with `ControlCore.undo`), then thrown into the flow so that its own clean-up runs before the
error propagates. A flow may be launched and left in flight (a stream's next batch): an asyncio
task in one driver, advanced whenever the blocking driver waits for anything in the other.
A closed driver raises `ClosedError`, and so does a call it was running when it was closed
(whatever failed in it then: the error is chained); ZeroMQ failures and builtin
`ValueError`/`TypeError` become `tq.*` errors (`foreign_error`).
"""

from __future__ import annotations

import asyncio
import enum
import errno
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import zmq

from ._flows import NOTICED, Call, Finish, Flow, Give, Launch, Plan, Run, Withdraw
from .wire.errors import ClosedError, SchemaError, ServiceError, SluiceError
from .wire.rpc import AsyncChannel, AsyncLocalChannel, Channel, LocalChannel, Ok, out_of_files

if TYPE_CHECKING:
    from ._control import ControlCore

__all__ = ["SyncDriver", "AsyncDriver", "foreign_error"]

T = TypeVar("T")


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


_ZMQ = (Channel, AsyncChannel)

CLOSE_WAIT = 5.0
"""Seconds `SyncDriver.close` called from another thread waits for the calls in flight to stop
(one waiting for a reply or for room in a lane's socket is woken at once; one in a ZeroMQ send,
a lane's connect or copying data stops once that step ends): the last to stop closes the
sockets, and `close` returns once it has."""


def _closed_error() -> ClosedError:
    return ClosedError("this client was closed; connect a new one")


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class _InFlight:
    """A flow and its current calls on the wire, (channel, request id) each; once the flow has
    ended, its `result` (or the `error` it failed with while nobody waited for it)."""

    __slots__ = ("flow", "calls", "sent", "result", "error", "since")

    def __init__(self, flow: Flow):
        self.flow = flow
        self.calls: list[Call] | None = None
        self.sent: list[tuple[Channel | LocalChannel, int | None]] = []
        """(channel, request id) per call; the id is None for a notice (nothing to await)."""
        self.result: Any = None
        self.error: Exception | None = None
        self.since = 0.0


class _Withdrawn(Exception):
    """Thrown into a launched flow nobody waits for any more, so that its own clean-up runs."""


class _Driver:
    """What both drivers hold: the flows' core, one channel per service address, open or closed."""

    def __init__(self, core: ControlCore):
        self._core = core
        self._state = _State.OPEN
        self._channels: dict[str, Any] = {}  # address -> its channel (of the driver's kind)

    @property
    def address(self) -> str:
        """The controller's endpoint."""
        return self._core.address

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def _replaced(self, address: str, channel: Any) -> bool:
        """Whether `channel` to `address` is to be closed and opened anew: its local lane's
        service went, or it is a ZeroMQ channel (the controller's, used to connect) to a service
        the core has since found a local lane for, and nothing is in flight on it (requests
        still on it keep it until they are answered)."""
        if channel.ended:
            return True
        return isinstance(channel, _ZMQ) and address in self._core.lanes and channel.idle

    def _raised(self, exc: Exception) -> BaseException:
        """What a call that failed with `exc` raises: `ClosedError` once the driver was closed
        meanwhile, else the `tq.*` error for it (`foreign_error`)."""
        if self._state is _State.CLOSED and not isinstance(exc, ClosedError):
            return _closed_error()
        return foreign_error(exc)


class SyncDriver(_Driver):
    """Drives flows over one blocking `rpc.Channel` per service; the base of `Client` and
    `ControlClient`. A failed, timed-out or interrupted step is withdrawn at every service it
    reached (`Cancel`, and what a reply granted meanwhile is given back), then thrown into the
    flow so that its own clean-up runs before the error propagates.

    A flow may also be left in flight (`_launch`: a stream's next batch, its acks). There is no
    thread: such a flow advances whenever this driver takes a reply for anything else, without
    waiting for its own, until `_finish` completes it or `_cancel` withdraws it.

    Calls are made by one thread at a time (the channels are not shared between threads), but
    `close` may come from any thread: it marks the driver closed, wakes the calls in flight
    (each channel's wait also watches an eventfd, `interrupt_on`) and leaves the sockets to the
    last of them to stop (`_release`), so no socket is closed under a thread using it; those
    calls raise `ClosedError`.

    Raises:
        CapacityError: (constructing) the process can open no more files.
    """

    def __init__(self, core: ControlCore):
        super().__init__(core)
        self._channels: dict[str, Channel | LocalChannel] = {}
        self._ahead: list[_InFlight] = []  # launched flows, advanced by `_progress`
        self._progressing = False
        # re-entrant: a signal handler may close the driver while its thread holds the guard
        self._guard = threading.RLock()
        self._stopped = threading.Condition(self._guard)  # notified by `_release`
        self._users = 0  # calls in flight, nested ones included: changed only by the thread making them
        self._owner = 0  # the thread that made the outermost of them
        self._released = False
        self._pid = os.getpid()  # a child forked from here shares `_wake` with this process: it never writes it
        try:
            self._wake = os.eventfd(0)  # written once by `close`: wakes every wait, never drained
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            raise out_of_files("files") from None
        # a client dropped unclosed: its sockets close with them, the eventfd (a bare int) here
        self._close_wake = weakref.finalize(self, os.close, self._wake)

    def _call(self, step: Callable[..., T], *args: Any) -> T:
        """`step(*args)` (a flow, a step of a plan) as a call in flight: refused once the driver is
        closed; what it raises as `_raised`; the last call to stop after a `close` releases the
        sockets. The count takes no lock (only this thread changes it; `close` writes the state
        before it reads the count, a call counts itself before it reads the state, so one of the
        two sees the other), and there is no call between a change of it and the `try` that
        undoes it, nor a loop: where CPython (3.11 on) runs signal handlers, so no Ctrl-C can leave
        it counted. One that skips the release after it leaves that to `close`.

        Raises:
            ClosedError: the driver is closed, or was closed while `step` ran.
        """
        if not self._users:
            self._owner = threading.get_ident()
        self._users += 1
        try:
            if self._state is _State.CLOSED:
                raise _closed_error()
            return step(*args)
        except Exception as exc:
            raised = self._raised(exc)
            if raised is exc:
                raise
            raise raised from exc
        finally:
            self._users -= 1
            if not self._users and self._state is _State.CLOSED:
                self._release()

    def _channel(self, target: int) -> Channel | LocalChannel:
        if self._state is _State.CLOSED:  # a flow cleaning up after a close opens nothing new
            raise _closed_error()
        address = self._core.target_address(target)
        channel = self._channels.get(address)
        if channel is not None and self._replaced(address, channel):
            channel.close()
            channel = None
        if channel is None:
            channel = self._channels[address] = self._core.channel(target)
            channel.interrupt_on(self._wake)
        return channel

    def _run(self, flow: Flow) -> Any:
        return self._call(self._drive, flow)

    def _drive(self, flow: Flow) -> Any:
        return self._finish(self._start(flow))

    def _start(self, flow: Flow) -> _InFlight:
        inflight = _InFlight(flow)
        self._step(inflight)
        return inflight

    def _launch(self, flow: Flow) -> _InFlight:
        """Start `flow` and leave it in flight; `_finish` or `_cancel` it."""
        inflight = self._start(flow)
        if inflight.calls is not None:
            self._ahead.append(inflight)
        return inflight

    def _step(self, inflight: _InFlight, replies: list | None = None, error: BaseException | None = None) -> None:
        """Send the flow its `replies` (or throw `error` into it) and put the calls it yields
        next on the wire; a call that cannot be sent withdraws those sent and is thrown in."""
        flow = inflight.flow
        if self._state is _State.CLOSED:
            flow.close()
            raise _closed_error()
        while True:
            try:
                if error is not None:
                    calls = flow.throw(error)
                else:
                    calls = next(flow) if replies is None else flow.send(replies)
            except StopIteration as stop:
                inflight.calls, inflight.sent, inflight.result = None, [], stop.value
                return
            except BaseException:  # the flow failed: it has ended, nothing of it is in flight
                inflight.calls, inflight.sent = None, []
                raise
            inflight.since = time.monotonic()
            inflight.calls, inflight.sent = calls, []
            try:
                for call in calls:
                    channel = self._channel(call.target)
                    if call.notice:
                        channel.post(call.msg, call.data)
                        inflight.sent.append((channel, None))
                    else:
                        inflight.sent.append((channel, channel.send(call.msg, call.data)))
                return
            except BaseException as exc:
                inflight.calls = calls[: len(inflight.sent)]
                self._abandon(inflight)
                replies, error = None, exc

    def _finish(self, inflight: _InFlight) -> Any:
        """Drive `inflight` to its end, advancing launched flows as replies come; its result.

        Raises:
            SluiceError: what the flow raised (or raised while it was left in flight).
        """
        if inflight in self._ahead:
            self._ahead.remove(inflight)
        while inflight.calls is not None:
            replies: list[Any] = []
            try:
                for call, (channel, rid) in zip(inflight.calls, inflight.sent):
                    what = type(call.msg).__name__
                    replies.append(NOTICED if rid is None else channel.reply(rid, call.wait, inflight.since, what))
            except BaseException as exc:  # a timeout, a dead service, Ctrl-C: let the flow clean up
                self._abandon(inflight, taken=replies)
                self._step(inflight, error=exc)
                continue
            self._progress()
            self._step(inflight, replies)
        if inflight.error is not None:
            raise inflight.error
        return inflight.result

    def _progress(self) -> None:
        """Advance the launched flows whose replies have all come, without waiting; a flow that
        fails keeps its error for `_finish`."""
        if self._progressing or not self._ahead or self._state is _State.CLOSED:
            return
        self._progressing = True
        try:
            self._call(self._advance)
        finally:
            self._progressing = False

    def _advance(self) -> None:
        for inflight in list(self._ahead):
            while inflight.calls is not None and all(
                rid is None or ch.ready(rid) is not None for ch, rid in inflight.sent
            ):
                replies = [NOTICED if rid is None else channel.reply(rid) for channel, rid in inflight.sent]
                try:
                    self._step(inflight, replies)
                except Exception as exc:  # noqa: BLE001 - raised by `_finish`
                    inflight.calls, inflight.error = None, exc
            if inflight.calls is None:
                self._ahead.remove(inflight)

    def _cancel(self, inflight: _InFlight) -> Any:
        """Withdraw a launched flow nobody waits for any more, letting its own clean-up run (a
        lease it won is given back); the result if it had already ended, else None."""
        if inflight in self._ahead:
            self._ahead.remove(inflight)
        if inflight.calls is None:
            return None if inflight.error is not None else inflight.result
        self._abandon(inflight)
        try:
            self._step(inflight, error=_Withdrawn())
            self._finish(inflight)
        except (_Withdrawn, SluiceError):  # withdrawn; or a service is gone and its timers free the rest
            pass
        return None

    def _iterate(self, plan: Plan) -> Iterator[Any]:
        """Drive `plan`, yielding what it gives; an error of a step is thrown into it."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.send(value) if error is None else plan.throw(error)
            except StopIteration:
                return
            value, error = None, None
            try:
                if isinstance(step, Give):
                    self._progress()  # what came while the item was made
                    yield step.item  # not as a call: the caller may close the driver meanwhile
                else:
                    value = self._call(self._take, step)
            except BaseException as exc:  # GeneratorExit included: the plan cleans up, then ends
                error = exc

    def _take(self, step: Run | Launch | Finish | Withdraw) -> Any:
        """Take one step of a plan (`_iterate`) other than `Give`."""
        if isinstance(step, Run):
            return self._run(step.flow)
        if isinstance(step, Launch):
            return self._launch(step.flow)
        if isinstance(step, Finish):
            return self._finish(step.task)
        return self._cancel(step.task)

    def _abandon(self, inflight: _InFlight, taken: Sequence[Any] = ()) -> None:
        """Withdraw the flow's calls still in flight (skipping services reported dead) and give
        back anything they were granted meanwhile, as well as what the replies already `taken`
        (those of its first calls, which the flow will never see) hold."""
        if inflight.calls is None or self._state is _State.CLOSED:
            return
        for i, (call, (channel, rid)) in enumerate(zip(inflight.calls, inflight.sent)):
            if i < len(taken):
                self._give_back(call, taken[i][0])
                continue
            if rid is None:  # a notice: nothing to withdraw
                continue
            if channel.dead:
                channel.forget(rid)
                continue
            try:
                got = channel.cancel(rid)
            except SluiceError:  # that service is gone; its own timers free what it held
                channel.forget(rid)
                continue
            if got is not None:
                self._give_back(call, got[0])

    def _give_back(self, call: Call, reply: Any) -> None:
        """Give back what `reply` to `call` granted (a lease, a grant, arena space), once its
        flow will never see it; a service that is gone frees it with its own timers."""
        undo = self._core.undo(reply)
        if undo is None:
            return
        try:
            self._run(self._core.one(call.target, undo, Ok))
        except SluiceError:
            pass

    def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards (`ClosedError`). Called from
        another thread while a call runs, it wakes that call (which raises `ClosedError`) and
        returns once the sockets are closed: when the call has stopped, or after `CLOSE_WAIT` s
        (the call then closes them as it stops). Called by a signal handler interrupting a call
        of its thread, it only wakes that call. In a child forked while calls ran, those calls
        were the parent's: the child closes its copies at once, wakes nothing, and takes no guard.

        Raises:
            Exception: what closing a channel or a launched flow raised (the wake-up eventfd and a
                `Client`'s arenas are closed all the same)."""
        if os.getpid() != self._pid:  # not under the guard: a parent's thread may have held it at the fork
            self._state = _State.CLOSED
            if not self._released:
                self._released = True
                self._free()
            return
        with self._guard:
            if self._state is not _State.CLOSED:
                self._state = _State.CLOSED
                if self._users:  # under the guard: `_release` cannot close `_wake` meanwhile
                    os.eventfd_write(self._wake, 1)
            if self._users:
                if self._owner == threading.get_ident():  # a handler: the call goes on once it returns
                    return
                self._stopped.wait_for(lambda: self._released or not self._users, CLOSE_WAIT)
            if not self._users:
                self._release()

    def _release(self) -> None:
        """Close the sockets and end the launched flows, once closed and no call is in flight; once."""
        with self._guard:
            if self._released:
                return
            self._released = True
            try:
                self._free()
            finally:
                self._stopped.notify_all()

    def _free(self) -> None:
        """What `_release` closes; the eventfd even if closing a flow or a channel raised."""
        try:
            for inflight in self._ahead:
                inflight.flow.close()
            self._ahead.clear()
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        finally:
            self._close_wake()


class AsyncDriver(_Driver):
    """Drives flows over one `rpc.AsyncChannel` per service (the asyncio twin of
    `_control.SyncDriver`): a failed, timed-out or cancelled step is withdrawn at every service
    it reached, then thrown into the flow so that its clean-up runs before the error propagates."""

    def __init__(self, core: ControlCore):
        super().__init__(core)
        self._channels: dict[str, AsyncChannel | AsyncLocalChannel] = {}

    def _channel(self, target: int) -> AsyncChannel | AsyncLocalChannel:
        address = self._core.target_address(target)
        channel = self._channels.get(address)
        if channel is not None and self._replaced(address, channel):
            channel.close()
            channel = None
        if channel is None:
            channel = self._channels[address] = self._core.async_channel(target)
        return channel

    async def _call(self, call: Call) -> tuple[Any, list[Any]]:
        channel = self._channel(call.target)
        if call.notice:
            channel.post(call.msg, call.data)
            return NOTICED
        rid = await channel.send(call.msg, call.data)
        try:
            return await channel.reply(rid, call.wait, what=type(call.msg).__name__)
        except BaseException:
            await self._withdraw(channel, call, rid)
            raise

    async def _withdraw(self, channel: AsyncChannel | AsyncLocalChannel, call: Call, rid: int) -> None:
        """Cancel `rid` at the service (unless it was reported dead); give back what its reply
        holds if it was already sent."""
        if self._state is _State.CLOSED or channel.dead:
            channel.forget(rid)
            return
        try:
            got = await channel.cancel(rid)
        except SluiceError:  # that service is gone; its own timers free what it held
            channel.forget(rid)
            return
        if got is not None:
            await self._give_back(call, got[0])

    async def _give_back(self, call: Call, reply: Any) -> None:
        """Give back what `reply` to `call` granted (a lease, a grant, arena space), once its
        flow will never see it; a service that is gone frees it with its own timers."""
        undo = self._core.undo(reply)
        if undo is None or self._state is _State.CLOSED:
            return
        try:
            await self._run(self._core.one(call.target, undo, Ok))
        except SluiceError:
            pass

    async def _run(self, flow: Flow) -> Any:
        try:
            return await self._drive(flow)
        except Exception as exc:
            raised = self._raised(exc)
            if raised is exc:
                raise
            raise raised from exc

    async def _drive(self, flow: Flow) -> Any:
        if self._state is _State.CLOSED:
            flow.close()
            raise _closed_error()
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
            except BaseException as exc:  # a call failed, or this flow was cancelled (perhaps
                # after its replies came, before it resumed): the flow sees none of them
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each withdraws its call
                for call, task in zip(calls, tasks):
                    if not task.cancelled() and task.exception() is None:
                        await self._give_back(call, task.result()[0])
                replies, error = None, exc

    def _launch(self, flow: Flow) -> asyncio.Future:
        """Start `flow` as a task of its own; `_finish` or `_cancel` it (as `SyncDriver._launch`)."""
        return asyncio.ensure_future(self._run(flow))

    async def _finish(self, task: asyncio.Future) -> Any:
        """The launched flow's result, once it has ended."""
        return await task

    async def _cancel(self, task: asyncio.Future) -> Any:
        """Withdraw a launched flow nobody waits for any more, letting its own clean-up run (a
        lease it won is given back); the result if it had already ended, else None."""
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
        return None if task.cancelled() or task.exception() is not None else task.result()

    async def _iterate(self, plan: Plan) -> AsyncIterator[Any]:
        """Drive `plan`, yielding what it gives (as `SyncDriver._iterate`)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.send(value) if error is None else plan.throw(error)
            except StopIteration:
                return
            value, error = None, None
            try:
                if isinstance(step, Give):
                    yield step.item
                elif isinstance(step, Run):
                    value = await self._run(step.flow)
                elif isinstance(step, Launch):
                    value = self._launch(step.flow)
                elif isinstance(step, Finish):
                    value = await self._finish(step.task)
                else:
                    value = await self._cancel(step.task)
            except BaseException as exc:  # GeneratorExit included: the plan cleans up, then ends
                error = exc

    async def close(self) -> None:
        """Close the sockets; the client cannot be used afterwards (`ClosedError`)."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
