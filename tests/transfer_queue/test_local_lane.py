"""The asyncio services' local lane (`rpc.Service(local=True)`) and the clients that use it:
served like the ROUTER, ended like it, refused to other users, and left for ZeroMQ when absent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import eventually_async
from transfer_queue.wire.errors import SchemaError, ServiceError
from transfer_queue.wire.messages import Free, Read, Reply, StorageRequest, UnitStatus
from transfer_queue.wire.rpc import (
    AsyncLocalChannel,
    Channel,
    Codec,
    LocalChannel,
    Ok,
    Ping,
    Service,
    current_peer,
)

BIG = 8 << 20  # more than a Unix socket's buffer: replies and requests go out in pieces


class _Lane(Service):
    """A service with a lane: `Read` parks until released (its peer noted), `Free` is refused
    for an empty partition, `UnitStatus` echoes its data frames."""

    def __init__(self, max_frame_bytes: int = -1):
        super().__init__(Codec(StorageRequest), "tcp://127.0.0.1:*", max_frame_bytes, local=True)
        self.parked: list[asyncio.Future] = []
        self.parkers: list[bytes] = []
        self.cancelled = 0
        self.gone: list[bytes] = []
        self.on_peer_gone = self.gone.append
        self.route(Read, self._read)
        self.route(Free, self._free)
        self.route(UnitStatus, lambda msg, data: (Ok(), data))

    async def _read(self, msg, data):
        fut = asyncio.get_running_loop().create_future()
        self.parked.append(fut)
        self.parkers.append(current_peer.get())
        try:
            await fut
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return Ok()

    def _free(self, msg, data):
        if not msg.partition:
            raise SchemaError("no partition")


async def test_the_lane_serves_answers_errors_parked_and_cancelled_requests_and_a_closing():
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    channel = AsyncLocalChannel(service.local_endpoint, Codec(Reply))
    try:
        assert service.local_endpoint.startswith("local:")
        assert isinstance(await channel.call(Ping()), Ok)
        with pytest.raises(SchemaError, match="no partition"):
            await channel.call(Free("", [1]))
        big = os.urandom(BIG)
        rid = await channel.send(UnitStatus(), [big, b"", b"tail"])
        reply, frames = await channel.reply(rid, 30)
        assert isinstance(reply, Ok) and [bytes(f) for f in frames] == [big, b"", b"tail"]
        # parked, then withdrawn by the caller: the service hears the Cancel over the lane
        call = asyncio.ensure_future(channel.call(Read("p", [0], ["x"]), 30))
        await eventually_async(lambda: len(service.parked) == 1)
        call.cancel()
        await eventually_async(lambda: service.cancelled == 1)
        # parked, then answered
        call = asyncio.ensure_future(channel.call(Read("p", [1], ["x"]), 30))
        await eventually_async(lambda: len(service.parked) == 2)
        service.parked[1].set_result(None)
        assert isinstance(await asyncio.wait_for(call, 30), Ok)
        # parked, then the client goes: its request ends and it is reported gone, once
        left = asyncio.ensure_future(channel.call(Read("p", [2], ["x"]), 30))
        await eventually_async(lambda: len(service.parked) == 3)
        assert service.connections == 1
        channel.close()
        with pytest.raises(ServiceError, match="closed"):
            await left
        await eventually_async(lambda: service.cancelled == 2 and service.gone, 30)
        assert service.gone == [service.parkers[2]] and service.parkers[2].startswith(b"local/")
        assert service.connections == 0
    finally:
        channel.close()
        service.stop()
        await serving


async def test_a_blocking_lane_client_sends_and_takes_frames_and_an_oversized_frame_ends_it():
    """`LocalChannel` from a thread: large frames both ways; a data frame beyond the service's
    `max_frame_bytes` ends the connection (as ZeroMQ's `MAXMSGSIZE` does) and the call says so."""
    service = _Lane(max_frame_bytes=BIG)
    serving = asyncio.ensure_future(service.serve())

    def use() -> None:
        client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=30)
        try:
            big = os.urandom(BIG)
            reply, frames = client.reply(client.send(UnitStatus(), [big]), 30)
            assert isinstance(reply, Ok) and bytes(frames[0]) == big
            with pytest.raises(ServiceError, match="dropped the connection"):
                client.call(UnitStatus(), data=[big + b"!"])
            assert client.ended
        finally:
            client.close()

    try:
        await asyncio.to_thread(use)
    finally:
        service.stop()
        await serving


async def test_the_lane_admits_only_this_user_and_its_clients_talk_only_to_this_users_lanes():
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    other = (
        "import os, socket, sys\n"
        "from transfer_queue.wire.errors import ServiceError\n"
        "from transfer_queue.wire.messages import Reply\n"
        "from transfer_queue.wire.rpc import Codec, LocalChannel\n"
        "os.setuid(65534)  # nobody, once the modules are loaded\n"
        "endpoint = sys.argv[1]\n"
        "try:\n"
        "    LocalChannel(endpoint, Codec(Reply))\n"
        "    sys.exit('a lane client talked to another user')\n"
        "except ServiceError as exc:\n"
        "    assert 'another user' in str(exc), exc\n"
        "raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "raw.connect('\\0' + endpoint[len('local:'):])\n"
        "raw.settimeout(30)\n"
        "assert raw.recv(1) == b'', 'the service kept another user connected'\n"
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            other,
            service.local_endpoint,
            stderr=subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        assert service._lane is not None and service._lane.refused == 2  # the LocalChannel's try, and the raw one
    finally:
        service.stop()
        await serving


def _batch(n: int = 64) -> TensorDict:
    return TensorDict(
        {"x": torch.arange(n * 8, dtype=torch.float32).view(n, 8), "ids": torch.arange(n)}, batch_size=[n]
    )


def test_a_co_located_client_puts_and_gets_over_the_lanes_exactly(cluster):
    """Mapped units and the controller over their lanes; a client sending frames (`use_shm=False`)
    reaches the units over ZeroMQ and only the controller over its lane."""
    data = _batch()
    for use_shm, unit_channel in ((None, LocalChannel), (False, Channel)):
        with tq.connect(cluster.address, use_shm=use_shm) as client:
            meta = client.put(data, "lane")
            got = client.get_data(meta)
            assert torch.equal(got["x"], data["x"]) and torch.equal(got["ids"], data["ids"])
            client.clear(meta)
            kinds = {a: type(c) for a, c in client._channels.items()}
            assert kinds.pop(cluster.address) is LocalChannel
            assert kinds and set(kinds.values()) == {unit_channel}


async def test_an_async_client_puts_and_gets_over_the_lanes_exactly(cluster):
    client = await tq.connect_async(cluster.address)
    try:
        data = _batch()
        meta = await client.put(data, "lane")
        got = await client.get_data(meta)
        assert torch.equal(got["x"], data["x"])
        await client.clear(meta)
        assert client._channels and all(isinstance(c, AsyncLocalChannel) for c in client._channels.values())
    finally:
        await client.close()


def test_a_client_falls_back_to_zeromq_when_a_lane_is_absent(cluster):
    """A lane that cannot be reached (gone, or another user's) leaves that service to ZeroMQ."""
    with tq.connect(cluster.address) as client:
        gone = "local:sluice-rpc-gone"
        assert client._core.lanes, "the services on this host advertise their lanes"
        client._core.lanes = dict.fromkeys(client._core.lanes, gone)
        client._take_lanes()
        for channel in client._channels.values():
            channel.close()
        client._channels.clear()
        data = _batch()
        meta = client.put(data, "zmq")
        assert torch.equal(client.get_data(meta)["x"], data["x"])
        client.clear(meta)
        assert client._channels and all(type(c) is Channel for c in client._channels.values())
        assert not set(client._channels) & set(client._core.lanes), "a lane that failed is not tried again"


def test_a_unit_killed_while_a_lane_client_waits_raises_service_error(cluster):
    """A service that dies ends its lane connections: the call raises at once, never hangs."""
    with tq.connect(cluster.address) as client:
        meta = client.put(_batch(), "dies")
        units = sorted(set(meta.units))
        for unit in units:
            cluster.backend.procs[1 + unit].send_signal(signal.SIGKILL)
        with pytest.raises(ServiceError):
            client.get_data(meta)
        lanes = [c for c in client._channels.values() if isinstance(c, LocalChannel)]
        assert any(c.ended for c in lanes)
