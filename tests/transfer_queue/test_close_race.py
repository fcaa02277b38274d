"""A client closed while one of its calls is in flight: the call raises `ClosedError` promptly,
whatever it was doing (parked at the controller, over its lane or over ZeroMQ), and nothing
else (`SchemaError`, `IndexError`) leaks out of sockets closed under it: the sockets are closed
by the call once it stopped, never under it."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import transfer_queue as tq
from tests.helpers import eventually
from transfer_queue._client_core import ClientCore
from transfer_queue._control_client import ControlClient
from transfer_queue._drivers import SyncDriver
from transfer_queue._flows import Call
from transfer_queue.compat.client import TransferQueueClient
from transfer_queue.wire.rpc import AsyncLocalChannel, Channel, LocalChannel, _local, _peer
from transfer_queue.wire.rpc._codec import Ping

_PARK = 3600.0
"""A get_meta's timeout no test reaches: only the close can end its wait."""


@pytest.fixture
def no_pings(monkeypatch):
    """A parked call wakes for nothing but its reply or the close: no liveness ping would end
    its wait (it would find its socket closed, and the test would pass by the ping's clock)."""
    monkeypatch.setattr(_peer, "PROBE_AFTER", _PARK)


def _park(other: tq.Client, call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start `call` (a get_meta of "x", which nothing satisfies until a put) on a thread and wait
    until the controller holds it parked (`other` looks); the thread, and what the call returned
    or raised once it has."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)  # a failed test leaves it parked
    thread.start()
    eventually(lambda: outcome or other.status()["counters"]["parked_get_meta"] == 1, 30, "get_meta parked")
    assert not outcome, f"the call ended before it parked: {outcome[0]!r}"
    return thread, outcome


def _close_while_parked(cluster: tq.Cluster, call: Callable[[], Any], close: Callable[[], None]) -> BaseException:
    """Start `call` (a get_meta nothing will satisfy) on a thread, wait until the controller
    holds it parked, `close` from this thread; what the call raised."""
    with tq.connect(cluster.address) as other:
        thread, outcome = _park(other, call)
        close()
        thread.join(60)
        assert not thread.is_alive(), "the parked call went on waiting after its client was closed"
    assert isinstance(outcome[0], BaseException), f"the parked call returned {outcome[0]!r}"
    return outcome[0]


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "zeromq"])
def test_a_call_parked_at_the_controller_raises_closed_error_when_another_thread_closes_the_client(
    cluster, no_pings, lane
):
    client = tq.connect(cluster.address)
    if not lane:
        client._core.lanes.clear()  # the controller's ZeroMQ channel (the hello's) stays in use
    client.status()
    assert type(client._channels[cluster.address]) is (LocalChannel if lane else Channel)
    error = _close_while_parked(cluster, lambda: client.get_meta(["x"], 1, "t", "p", timeout=_PARK), client.close)
    assert isinstance(error, tq.ClosedError), repr(error)
    assert not client._channels, "the call that stopped closed the sockets"
    with pytest.raises(tq.ClosedError):
        client.status()


def test_a_compat_call_parked_on_another_thread_raises_closed_error_when_the_client_closes(cluster, no_pings):
    """The reviewer's race made deterministic: `TransferQueueClient.close()` closes the blocking
    client another thread is calling through."""
    client = TransferQueueClient(cluster.address)
    parked = functools.partial(ClientCore.get_meta, timeout=_PARK)
    error = _close_while_parked(cluster, lambda: client._blocking(parked, ["x"], 1, "t", "p"), client.close)
    assert isinstance(error, tq.ClosedError), repr(error)
    with pytest.raises(tq.ClosedError):
        client.kv_list()


async def test_an_async_call_in_flight_raises_closed_error_when_its_client_closes(cluster):
    client = await tq.connect_async(cluster.address)
    other = await tq.connect_async(cluster.address)
    try:
        parked = asyncio.ensure_future(client.get_meta(["x"], 1, "t", "p", timeout=_PARK))
        while (await other.status())["counters"]["parked_get_meta"] != 1:
            await asyncio.sleep(0.02)  # a look at observable state, as `eventually`
        assert type(client._channels[cluster.address]) is AsyncLocalChannel
        await client.close()
        with pytest.raises(tq.ClosedError):
            await asyncio.wait_for(parked, 60)
    finally:
        await other.close()
        await client.close()


def test_a_close_by_the_thread_holding_the_guard_reenters_it(cluster):
    """What a signal handler closing the client relies on: it runs on a thread that may be
    inside the guard (releasing, say), and `close` re-enters the guard rather than wait for itself."""
    client = tq.connect(cluster.address)
    client.status()

    def handler() -> None:
        with client._guard:  # where the interrupted thread was
            client.close()

    thread = threading.Thread(target=handler, daemon=True)  # a deadlocked one is left behind
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "close() waited for the guard its own thread held"
    assert not client._channels, "the sockets were closed"
    with pytest.raises(tq.ClosedError):
        client.status()


def test_a_close_that_a_call_ending_at_that_moment_releases_under_raises_nothing(cluster, no_pings):
    """The call in flight gets its reply (and stops, releasing the sockets) just as `close`
    wakes it: the wake is written while the call cannot release, never to a closed descriptor."""
    client = tq.connect(cluster.address)
    with tq.connect(cluster.address) as other:
        thread, outcome = _park(other, lambda: client.get_meta(["x"], 1, "t", "p", timeout=_PARK))

        def at_the_wake(frame: Any, event: str, arg: Any) -> None:
            if event == "c_call" and getattr(arg, "__name__", "") == "eventfd_write":
                sys.setprofile(None)
                other.put({"x": torch.arange(1)}, "p")  # the parked call is answered
                # it stops now, unless it must wait for the wake to be written: a wait for what
                # must not happen, so it lasts its full 2 s whenever the test passes
                thread.join(2)

        sys.setprofile(at_the_wake)
        try:
            client.close()
        finally:
            sys.setprofile(None)
        thread.join(60)
        assert not thread.is_alive()
    assert isinstance(outcome[0], (tq.BatchMeta, tq.ClosedError)), repr(outcome[0])
    assert not client._channels


def _close_in_child(client: tq.Client) -> int:
    """Fork; the child closes its copy of `client` and exits 0 if that left it closed with no
    channel (2 if not, 1 if `close` raised). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            client.close()
            code = 0 if client.closed and not client._channels else 2
        finally:
            os._exit(code)
    return pid


def test_a_child_closing_a_client_it_inherited_with_a_call_in_flight_leaves_the_parents_alone(cluster, no_pings):
    """The child shares the wake descriptor with its parent: its `close` (an atexit, a `with`
    block) closes its copies and writes nothing, so the parent's call waits on for its reply."""
    client = tq.connect(cluster.address)
    with tq.connect(cluster.address) as other:
        thread, outcome = _park(other, lambda: client.get_meta(["x"], 1, "t", "p", timeout=_PARK))
        pid = _close_in_child(client)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child's close failed: {status}"
        assert not select.select([client._wake], [], [], 0)[0], "the child woke the parent's calls"
        assert not client.closed and thread.is_alive()
        other.put({"x": torch.arange(1)}, "p")
        thread.join(60)
    assert isinstance(outcome[0], tq.BatchMeta), f"the parent's call failed: {outcome[0]!r}"
    client.close()
    assert not client._channels


def test_close_from_another_thread_returns_once_the_sockets_are_closed(cluster, no_pings):
    """`close` returns after the call it woke has released the sockets (and, for a `Client`,
    unmapped its arenas, the last of it), not merely once that call stopped."""
    client = tq.connect(cluster.address)
    returned = threading.Event()
    early: list[bool] = []
    unmap = client._core.close_arenas

    def last_of_release() -> None:
        # holds the release until `close` returned, or 1 s: a wait for what must not happen,
        # so it lasts its full 1 s whenever the test passes
        early.append(returned.wait(1))
        unmap()

    client._core.close_arenas = last_of_release  # type: ignore[method-assign]
    with tq.connect(cluster.address) as other:
        thread, outcome = _park(other, lambda: client.get_meta(["x"], 1, "t", "p", timeout=_PARK))
        client.close()
        returned.set()
        thread.join(60)
    assert early == [False], "close() returned while the call was still releasing"
    assert isinstance(outcome[0], tq.ClosedError), repr(outcome[0])


def test_a_ctrl_c_anywhere_in_a_call_leaves_no_call_counted():
    """Ctrl-C (raised here at every function call, return and builtin call of a call in turn,
    the points where Python runs signal handlers) never leaves the count of calls in flight
    behind, which would keep `close` waiting and the sockets open."""

    def flow() -> Any:
        return 1
        yield

    here = sys._getframe().f_code  # its own calls (setting the profile) are not the call's

    def interrupt_at(at: int) -> tuple[Callable[[Any, str, Any], None], list[int]]:
        """A profile function raising KeyboardInterrupt at the call's `at`-th event; the events seen."""
        seen = [0]

        def interrupt(frame: Any, event: str, arg: Any) -> None:
            if frame.f_code is here:
                return
            seen[0] += 1
            if seen[0] == at:
                sys.setprofile(None)
                raise KeyboardInterrupt

        return interrupt, seen

    at = 0
    while True:
        at += 1
        driver = SyncDriver(None)  # type: ignore[arg-type]
        interrupt, seen = interrupt_at(at)
        try:
            sys.setprofile(interrupt)
            assert driver._run(flow()) == 1
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(None)
        assert driver._users == 0, f"a Ctrl-C at event {at} left a call counted"
        driver.close()
        assert driver._released
        if seen[0] < at:  # the call ran to its end: every point was tried
            break
    assert at > 5


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "zeromq"])
def test_a_signal_handler_closing_the_client_during_a_call_of_its_thread_returns_at_once(cluster, no_pings, lane):
    """A real signal interrupts a parked call; its handler (run on the calling thread) closes
    the client: that close only wakes the call (it cannot wait for a call that goes on only once
    the handler returns), and the call then raises `ClosedError` and closes the sockets."""
    client = tq.connect(cluster.address)
    if not lane:
        client._core.lanes.clear()
    client.status()
    waited: list[Any] = []
    client._stopped.wait_for = lambda *args: waited.append(args)  # type: ignore[method-assign]
    in_handler: list[tuple[bool, bool]] = []

    def handler(signum: int, frame: Any) -> None:
        client.close()
        in_handler.append((client.closed, bool(client._channels)))

    with tq.connect(cluster.address) as other:

        def interrupt_once_parked() -> None:
            eventually(lambda: other.status()["counters"]["parked_get_meta"] == 1, 30, "get_meta parked")
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

        assert threading.current_thread() is threading.main_thread(), "Python runs handlers on the main thread"
        previous = signal.signal(signal.SIGUSR1, handler)
        try:
            threading.Thread(target=interrupt_once_parked, daemon=True).start()
            with pytest.raises(tq.ClosedError):
                client.get_meta(["x"], 1, "t", "p", timeout=60)  # only the close ends it before 60 s
        finally:
            signal.signal(signal.SIGUSR1, previous)
    assert in_handler == [(True, True)], "the handler's close returned before the call let go of the sockets"
    assert not waited, "the handler's close waited for the call it interrupted"
    assert not client._channels and client._released


def test_a_call_waiting_for_room_in_a_full_lane_socket_raises_closed_error_when_closed():
    """A notice larger than the socket holds, to a lane nobody reads: the call waits for room,
    another thread closes the client, and the call raises `ClosedError` (the cut-off send's
    `ServiceError` chained), not the bare `ServiceError`."""
    lane = _local.Lane()
    client = ControlClient("tcp://127.0.0.1:9")  # never dialled: its one service is the lane
    client._core.lanes[client.address] = lane.endpoint

    def flow() -> Any:
        yield [Call(-1, Ping(), [bytes(64 << 20)], _PARK, notice=True)]
        return "sent"

    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(client._run(flow()))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        assert select.select([lane.listener], [], [], 30)[0], "the call never connected"
        peer = lane.accept()
        assert peer is not None
        assert select.select([peer.sock], [], [], 30)[0], "the call sent nothing"
        assert not outcome, f"the socket took 64 MiB at once: {outcome!r}"
        client.close()
        thread.join(60)
        assert not thread.is_alive(), "the send went on waiting after its client was closed"
    finally:
        lane.close()
    assert isinstance(outcome[0], tq.ClosedError), repr(outcome[0])
    assert isinstance(outcome[0].__cause__, tq.ServiceError), repr(outcome[0].__cause__)


def test_clients_dropped_without_close_leave_no_descriptor_behind(cluster):
    """A client that goes out of scope unclosed closes what it holds once collected: its
    sockets close with them, and its wake-up eventfd (a bare descriptor) with a finalizer."""

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    def use_and_drop() -> None:
        client = tq.connect(cluster.address)
        client.status()

    use_and_drop()  # what the first client opens for good (ZeroMQ's threads, say)
    gc.collect()
    before = descriptors()
    for _ in range(20):
        use_and_drop()
    gc.collect()
    assert descriptors() <= before, "unclosed clients left descriptors open"


def test_a_close_whose_channel_fails_to_close_still_closes_the_rest(cluster):
    """A channel's `close` raising leaves neither the wake-up eventfd nor the arenas open: the
    error reaches the caller of `close` once they are closed too."""
    client = tq.connect(cluster.address)
    client.put({"x": torch.arange(4)}, "p")
    meta = client.get_meta(["x"], 4, "t", "p", timeout=30)
    assert torch.equal(client.get_data(meta)["x"], torch.arange(4))
    assert client._core._arenas, "nothing was mapped: the test shows nothing"
    channel = next(iter(client._channels.values()))
    close_channel = channel.close

    def failing_close() -> None:
        close_channel()
        raise RuntimeError("a channel failed to close")

    channel.close = failing_close  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="failed to close"):
        client.close()
    assert not client._close_wake.alive, "the eventfd stayed open"
    assert not client._core._arenas, "the arenas stayed mapped"
    client.close()  # closed once: nothing more to do, nothing raised


def test_a_child_forked_while_a_thread_holds_the_guard_closes_its_copies(cluster):
    """In the child the guard may be held by a thread of the parent that the child does not
    have: the child's `close` does not take it (it would wait forever)."""
    client = tq.connect(cluster.address)
    client.status()
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with client._guard:
            held.set()
            done.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert held.wait(30)
        pid = _close_in_child(client)

        def reaped() -> tuple[int] | None:
            got, status = os.waitpid(pid, os.WNOHANG)
            return (status,) if got == pid else None

        try:
            (status,) = eventually(reaped, 30, "the child's close")
        except AssertionError:  # it waits for the guard
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
    finally:
        done.set()
        holder.join(60)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"the child's close failed: {status}"
    client.close()
    assert not client._channels
