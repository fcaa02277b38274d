"""A client closed while one of its calls is in flight: the call raises `ClosedError` promptly,
whatever it was doing (parked at the controller, over its lane or over ZeroMQ), and nothing
else (`SchemaError`, `IndexError`) leaks out of sockets closed under it: the sockets are closed
by the call once it stopped, never under it."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest

import transfer_queue as tq
from tests.helpers import eventually
from transfer_queue._client_core import ClientCore
from transfer_queue.compat.client import TransferQueueClient
from transfer_queue.wire.rpc import AsyncLocalChannel, Channel, LocalChannel, _peer

_PARK = 3600.0
"""A get_meta's timeout no test reaches: only the close can end its wait."""


@pytest.fixture
def no_pings(monkeypatch):
    """A parked call wakes for nothing but its reply or the close: no liveness ping would end
    its wait (it would find its socket closed, and the test would pass by the ping's clock)."""
    monkeypatch.setattr(_peer, "PROBE_AFTER", _PARK)


def _close_while_parked(cluster: tq.Cluster, call: Callable[[], Any], close: Callable[[], None]) -> BaseException:
    """Start `call` (a get_meta nothing will satisfy) on a thread, wait until the controller
    holds it parked, `close` from this thread; what the call raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            raised.append(exc)

    with tq.connect(cluster.address) as other:
        thread = threading.Thread(target=run, daemon=True)  # a failed test leaves it parked
        thread.start()
        eventually(lambda: raised or other.status()["counters"]["parked_get_meta"] == 1, 30, "get_meta parked")
        assert not raised, f"the call failed before it parked: {raised[0]!r}"
        close()
        thread.join(60)
        assert not thread.is_alive(), "the parked call went on waiting after its client was closed"
    assert raised, "the parked call returned"
    return raised[0]


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
