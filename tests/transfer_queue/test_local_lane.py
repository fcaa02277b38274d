"""The asyncio services' local lane (`rpc.Service(local=True)`) and the clients that use it:
served like the ROUTER, ended like it, refused to other users, and left for ZeroMQ when absent."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import eventually_async
from tests.peers import ParkedService
from transfer_queue._async_client import AsyncClient
from transfer_queue._flows import CONTROLLER
from transfer_queue.compat.client import TransferQueueClient
from transfer_queue.wire.auth import Credentials
from transfer_queue.wire.errors import ClosedError, ProtocolError, SchemaError, ServiceError
from transfer_queue.wire.messages import CommitWrite, Free, Read, Reply, StorageRequest, UnitStatus, WaitVersion
from transfer_queue.wire.rpc import (
    MAX_BODY_BYTES,
    AsyncChannel,
    AsyncLocalChannel,
    Channel,
    Codec,
    LocalChannel,
    Ok,
    Ping,
    Service,
    ThreadService,
    _local,
)
from transfer_queue.wire.rpc._local import _HEAD, _LEN, _frame, _offsets

BIG = 8 << 20  # more than a Unix socket's buffer: replies and requests go out in pieces


class _Lane(ParkedService):
    """`ParkedService` with its lane."""

    def __init__(self, max_frame_bytes: int = -1):
        super().__init__(max_frame_bytes, local=True)


def _raw(endpoint: str) -> socket.socket:
    """A plain socket connected to a lane: a peer that writes what it likes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + endpoint.removeprefix("local:"))
    sock.settimeout(60)
    return sock


def _framed(rid: int, msg, data=()) -> bytes:
    return b"".join(bytes(b) for b in _frame(Codec(StorageRequest).encode_now(rid, msg, data)))


def _until_closed(sock: socket.socket) -> bytes:
    """Everything `sock` receives until its peer closes it (fails after its timeout)."""
    got = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


def _exactly(sock: socket.socket, n: int) -> bytes:
    """The next `n` bytes `sock` receives (fewer if its peer closes it first)."""
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            break
        got += chunk
    return bytes(got)


def _replies(stream: bytes) -> list[tuple[int, object]]:
    """(request id, message) of each whole reply in a lane's byte stream."""
    out, at = [], 0
    while len(stream) - at >= _HEAD.size:
        head, body, count = _HEAD.unpack_from(stream, at)
        sizes = [_LEN.unpack_from(stream, at + _HEAD.size + i * _LEN.size)[0] for i in range(count)]
        start = at + _HEAD.size + count * _LEN.size
        rid, msg, _ = Codec(Reply).decode([stream[start : start + head], stream[start + head : start + head + body]])
        out.append((rid, msg))
        at = start + _offsets(head, body, sizes)[-1]
    return out


def _listener() -> tuple[socket.socket, str]:
    """A bare lane listener of this user (a peer that answers as the test says): (socket, endpoint)."""
    name = f"sluice-test-{os.getpid()}-{secrets.token_hex(4)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind("\0" + name)
    sock.listen(1)
    return sock, "local:" + name


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


def test_a_service_with_credentials_refuses_to_serve_a_lane():
    """A lane checks who connects by user, not by key: a service given keys serves none."""
    credentials = Credentials.generate()
    with pytest.raises(SchemaError, match="serves no local lane"):
        ThreadService(Codec(StorageRequest), lambda msg, pending: None, credentials=credentials, local=True)
    with pytest.raises(SchemaError, match="serves no local lane"):
        Service(Codec(StorageRequest), "tcp://127.0.0.1:*", credentials=credentials, local=True)


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


async def test_a_zeromq_channel_with_a_request_in_flight_is_left_for_its_lane_only_once_idle(cluster):
    """A request parked at the controller over ZeroMQ while the hello finds its lane is answered
    there; the first call once that channel is idle goes over the lane."""
    client = AsyncClient(cluster.address)
    try:
        zmq_channel = client._channel(CONTROLLER)
        assert type(zmq_channel) is AsyncChannel
        rid = await zmq_channel.send(WaitVersion(1 << 40, 30))  # answered by the set_version below
        await client.hello()
        await client.set_version((1 << 40) + 1)  # a call while the ZeroMQ channel still awaits a reply
        assert (await zmq_channel.reply(rid, 30))[0].version == (1 << 40) + 1
        await client.status()
        assert isinstance(client._channels[cluster.address], AsyncLocalChannel)
    finally:
        await client.close()


async def test_compat_first_calls_on_one_loop_share_one_client_connected_before_use(cluster):
    client = TransferQueueClient(cluster.address)

    async def first() -> tuple[AsyncClient, bool]:
        got = await client._async_client()
        return got, got._core.config is not None

    try:
        (a, a_connected), (b, b_connected) = await asyncio.gather(first(), first())
        assert a is b and a_connected and b_connected
        assert await asyncio.gather(client.async_kv_list(), client.async_kv_list())
        assert isinstance(a._channels[cluster.address], AsyncLocalChannel)
    finally:
        client.close()


async def test_compat_close_while_a_hello_is_in_flight_closes_that_client_and_stays_closed(cluster, monkeypatch):
    """`close()` while a loop's first call says hello (its controller stopped, so the hello
    waits): the hello's client closes with it and is never published, the call raises
    `ClosedError` (not after the controller answers), and so does every later call."""
    client = TransferQueueClient(cluster.address)
    saying_hello: asyncio.Future[AsyncClient] = asyncio.get_running_loop().create_future()
    hello = AsyncClient.hello

    async def noted(self: AsyncClient) -> Any:
        saying_hello.set_result(self)
        return await hello(self)

    monkeypatch.setattr(AsyncClient, "hello", noted)
    controller = cluster.backend.procs[0]
    controller.send_signal(signal.SIGSTOP)
    try:
        first = asyncio.ensure_future(client.async_kv_list())
        connecting = await asyncio.wait_for(saying_hello, 30)
        client.close()
    finally:
        controller.send_signal(signal.SIGCONT)
    with pytest.raises(ClosedError):
        await first
    assert connecting.closed and not client._loops
    with pytest.raises(ClosedError):
        await client.async_kv_list()
    with pytest.raises(ClosedError):
        client.kv_list()


def test_a_client_falls_back_to_zeromq_when_a_lane_is_absent(cluster):
    """A lane that cannot be reached (gone, or another user's) leaves that service to ZeroMQ."""
    with tq.connect(cluster.address) as client:
        gone = "local:sluice-rpc-gone"
        assert client._core.lanes, "the services on this host advertise their lanes"
        client._core.lanes = dict.fromkeys(client._core.lanes, gone)
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


async def test_a_message_whose_last_data_frame_is_empty_goes_both_ways():
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    got: list[bytes] = []

    def use() -> None:
        client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=30)
        try:
            _, frames = client.reply(client.send(UnitStatus(), [b"x", b""]), 30)
            got.extend(bytes(f) for f in frames)
        finally:
            client.close()

    # a thread of its own: a send that never ends must fail this test, not hang it
    user = threading.Thread(target=use, daemon=True)
    user.start()
    try:
        await asyncio.to_thread(user.join, 60)
        assert got == [b"x", b""]
    finally:
        service.stop()
        await serving


async def test_a_queued_reply_keeps_the_bytes_its_small_frames_had():
    """Replies wait in the service's queue behind a large one its client does not read yet; the
    small frame of each is sent as it was when answered, though its buffer was reused since."""
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())

    def use() -> list[bytes]:
        client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=30)
        try:
            big = client.send(UnitStatus(), [os.urandom(BIG)])
            small = [client.send(CommitWrite(token)) for token in (1, 2, 3)]
            assert len(bytes(client.reply(big, 30)[1][0])) == BIG
            return [bytes(client.reply(rid, 30)[1][0]) for rid in small]
        finally:
            client.close()

    try:
        got = await asyncio.to_thread(use)
        assert got == [t.to_bytes(16, "little") for t in (1, 2, 3)]
    finally:
        service.stop()
        await serving


async def test_one_reply_larger_than_the_queue_bound_arrives_and_a_peer_that_stops_reading_is_cut(monkeypatch):
    monkeypatch.setattr(_local, "_QUEUED_MAX", 1 << 20)  # the bound, scaled down with the replies
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    big = os.urandom(BIG)
    try:
        raw = await asyncio.to_thread(_raw, service.local_endpoint)
        await asyncio.to_thread(raw.sendall, _framed(1, UnitStatus(), [big]))
        await eventually_async(lambda: service.served == 1)  # answered: what the socket did not take is queued
        expected = _framed(1, Ok(), [big])
        assert await asyncio.to_thread(_exactly, raw, len(expected)) == expected
        # two such replies to a peer that reads nothing: the second finds the first queued
        await asyncio.to_thread(raw.sendall, _framed(2, UnitStatus(), [big]) + _framed(3, UnitStatus(), [big]))
        await eventually_async(lambda: service.gone, 30)
        raw.close()
    finally:
        service.stop()
        await serving


async def test_a_header_announcing_a_huge_frame_is_refused_without_allocating_it():
    """A service closes the connection of a peer whose header announces more data than it takes;
    a client raises `ProtocolError` for such a reply. Neither allocates it."""
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    huge = _HEAD.pack(len(b"p"), len(b"b"), 1) + _LEN.pack(1 << 63) + b"pb"
    try:
        raw = await asyncio.to_thread(_raw, service.local_endpoint)
        raw.sendall(huge)
        assert await asyncio.to_thread(_until_closed, raw) == b""
        await eventually_async(lambda: len(service.gone) == 1, 30)
        raw.close()
    finally:
        service.stop()
        await serving

    listener, endpoint = _listener()
    client = LocalChannel(endpoint, Codec(Reply), timeout=30)
    peer, _ = listener.accept()
    try:
        rid = client.send(Ping())
        peer.sendall(huge)
        with pytest.raises(ProtocolError, match="exceed"):
            client.reply(rid, 30)
        assert client.ended
    finally:
        client.close()
        peer.close()
        listener.close()


async def test_an_oversized_request_is_refused_as_over_zeromq_and_the_lane_goes_on():
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    huge = Free("x" * (MAX_BODY_BYTES + (1 << 20)), [1])
    sync = await asyncio.to_thread(LocalChannel, service.local_endpoint, Codec(Reply), timeout=30)
    channel = AsyncLocalChannel(service.local_endpoint, Codec(Reply), timeout=30)
    try:
        with pytest.raises(ProtocolError, match=r"message body of \d+ bytes exceeds the limit of"):
            await asyncio.to_thread(sync.call, huge)
        with pytest.raises(ProtocolError, match=r"message body of \d+ bytes exceeds the limit of"):
            await channel.call(huge)
        assert isinstance(await asyncio.to_thread(sync.call, Ping()), Ok)
        assert isinstance(await channel.call(Ping()), Ok)
    finally:
        sync.close()
        channel.close()
        service.stop()
        await serving


async def test_requests_before_a_malformed_message_in_the_same_read_are_served():
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    try:
        raw = await asyncio.to_thread(_raw, service.local_endpoint)
        # one write: the service reads the Ping and the bad header together
        raw.sendall(_framed(7, Ping()) + _HEAD.pack(1, 1, 1 << 20))
        assert [(rid, type(msg)) for rid, msg in _replies(await asyncio.to_thread(_until_closed, raw))] == [(7, Ok)]
        raw.close()
    finally:
        service.stop()
        await serving


def test_a_reply_that_came_before_its_peer_closed_is_taken():
    """The peer answers one request and closes at once: a request sent then raises `lost`, the
    answer is `ready` and taken all the same, the request the peer left raises `lost`."""
    listener, endpoint = _listener()
    client = LocalChannel(endpoint, Codec(Reply), timeout=30)
    peer, _ = listener.accept()
    try:
        answered, left = client.send(Ping()), client.send(Ping())
        peer.sendall(_framed(answered, Ok()))
        peer.close()
        with pytest.raises(ServiceError, match="dropped the connection"):
            client.send(Ping())
        assert client.ready(answered, 30) == answered
        assert isinstance(client.reply(answered, 30)[0], Ok)
        with pytest.raises(ServiceError, match="dropped the connection"):
            client.reply(left, 30)
        assert client.ended and client.ready() is None
    finally:
        client.close()
        listener.close()


def _answer_and_close(listener: socket.socket, rid: int, size: int) -> None:
    """Accept the client's connection, answer `rid` with `size` bytes of data and close it;
    the kernel holds the whole reply (the lane's buffers), the client has read none of it."""
    peer, _ = listener.accept()
    _local._buffers(peer)
    peer.settimeout(30)
    peer.sendall(_framed(rid, Ok(), [os.urandom(size)]))
    peer.close()


def test_a_reply_larger_than_one_read_that_came_before_its_peer_closed_is_taken():
    """As above with a reply of more than one read's budget: the send that finds the peer gone
    reads on to the end, not only one read's worth."""
    listener, endpoint = _listener()
    client = LocalChannel(endpoint, Codec(Reply), timeout=30)
    try:
        answered = client.send(UnitStatus())
        _answer_and_close(listener, answered, 3 << 20)
        with pytest.raises(ServiceError, match="dropped the connection"):
            client.send(Ping())
        assert client.ready(answered, 30) == answered
        assert len(client.reply(answered, 30)[1][0]) == 3 << 20
    finally:
        client.close()
        listener.close()


async def test_an_async_reply_larger_than_one_read_that_came_before_its_peer_closed_is_taken():
    listener, endpoint = _listener()
    client = AsyncLocalChannel(endpoint, Codec(Reply), timeout=30)
    try:
        answered = await client.send(UnitStatus())
        _answer_and_close(listener, answered, 3 << 20)  # the loop has not read: it runs no callback here
        with pytest.raises(ServiceError, match="dropped the connection"):
            await client.send(Ping())
        assert len((await client.reply(answered, 30))[1][0]) == 3 << 20
    finally:
        client.close()
        listener.close()


def _tokens(client: LocalChannel, first: int, count: int) -> str:
    """Ask `client`'s `_Lane` to echo `count` tokens from `first`; '' if each answer was its own."""
    for token in range(first, first + count):
        _, frames = client.reply(client.send(CommitWrite(token)), 30)
        got = int.from_bytes(bytes(frames[0]), "little")
        if got != token:
            return f"{got} answered {token}"
    return ""


def _fork_and_use(endpoint: str) -> str:
    """Connect, fork, and use the lane from both processes; what went wrong ('' if nothing)."""
    client = LocalChannel(endpoint, Codec(Reply), timeout=30)
    assert not _tokens(client, 0, 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports through the pipe and leaves at once, whatever happens
        try:
            if not client.ended:
                problem = "the parent's connection is open in the child"
            else:
                with pytest.raises(ServiceError, match="forked"):
                    client.send(Ping())
                own = LocalChannel(endpoint, Codec(Reply), timeout=30)
                problem = _tokens(own, 1_000_000, 300)
                own.close()
        except BaseException as exc:  # noqa: BLE001 - anything is the test's failure
            problem = repr(exc)
        os.write(write, problem.encode()[:500])
        os._exit(0)
    os.close(write)
    try:
        problem = _tokens(client, 1, 300)
    finally:
        child = os.read(read, 500).decode()
        os.close(read)
        os.waitpid(pid, 0)
        client.close()
    return "; ".join(p for p in (problem and f"parent: {problem}", child and f"child: {child}") if p)


async def test_a_lane_connection_made_before_a_fork_is_the_parents_alone():
    """The child's copy of a lane connection is ended (it would take the parent's replies); the
    child connects anew, and each process gets its own answers."""
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    try:
        assert await asyncio.to_thread(_fork_and_use, service.local_endpoint) == ""
    finally:
        service.stop()
        await serving


async def test_a_client_connecting_while_the_backlog_is_full_waits_for_the_service():
    service = _Lane()
    waiting: list[socket.socket] = []
    address = "\0" + service.local_endpoint.removeprefix("local:")
    try:
        # nobody accepts yet: fill the listener's backlog
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(address)
            except BlockingIOError:
                sock.close()
                break
            waiting.append(sock)
        assert len(waiting) > 64  # as many as the host lets wait (`somaxconn`)
        connecting = threading.Event()

        def use() -> object:
            connecting.set()
            client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=30, connect_timeout=60)
            try:
                return client.call(Ping())
            finally:
                client.close()

        user = asyncio.ensure_future(asyncio.to_thread(use))
        await asyncio.to_thread(connecting.wait, 30)
        serving = asyncio.ensure_future(service.serve())
        assert isinstance(await asyncio.wait_for(user, 60), Ok)
    finally:
        for sock in waiting:
            sock.close()
        service.stop()
        if "serving" in locals():
            await serving


def _fill_backlog(endpoint: str) -> list[socket.socket]:
    """Connections that fill the backlog of the lane listening at `endpoint` (nobody accepts)."""
    waiting = []
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect("\0" + endpoint.removeprefix("local:"))
        except BlockingIOError:
            sock.close()
            return waiting
        waiting.append(sock)


def test_a_signal_during_a_connect_waiting_for_room_does_not_end_it():
    """A signal interrupts the connect's wait for room in the backlog (the handler makes room):
    the connect goes on and succeeds, instead of taking the unconnected socket for another
    user's and refusing the lane."""
    listener, endpoint = _listener()
    waiting = _fill_backlog(endpoint)
    accepted: list[socket.socket] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: accepted.append(listener.accept()[0]))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        client = LocalChannel(endpoint, Codec(Reply), connect_timeout=60)
        assert accepted and not client.ended
        client.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        for sock in waiting + accepted:
            sock.close()
        listener.close()


class _WatchedSocket(socket.socket):
    """A stdlib socket that notes whether each `connect` was made blocking."""

    blocking: list[bool] = []

    def connect(self, address: Any) -> None:
        _WatchedSocket.blocking.append(self.getblocking())
        super().connect(address)


async def test_an_async_client_finding_the_backlog_full_does_not_stall_its_loop(monkeypatch):
    """The event loop's connect does not wait for room (a blocking connect would hold the loop
    for its whole timeout): it is made non-blocking, raises `lost` at once, and the client goes
    to ZeroMQ."""
    listener, endpoint = _listener()
    waiting = _fill_backlog(endpoint)
    _WatchedSocket.blocking = []
    monkeypatch.setattr(_local.socket, "socket", _WatchedSocket)
    try:
        with pytest.raises(ServiceError, match="cannot be reached"):
            AsyncLocalChannel(endpoint, Codec(Reply))
        assert _WatchedSocket.blocking == [False]
    finally:
        for sock in waiting:
            sock.close()
        listener.close()


def test_an_async_lane_client_built_with_no_loop_running_opens_no_socket():
    listener, endpoint = _listener()
    try:
        with pytest.raises(RuntimeError):
            AsyncLocalChannel(endpoint, Codec(Reply))
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_a_thread_service_queues_replies_for_a_lane_client_that_only_posts():
    """Replies to posted notices that the client does not read yet wait for its socket to take
    them (as the asyncio services' do): the client is not cut off when its buffer fills."""
    service = ThreadService(Codec(StorageRequest), lambda msg, pending: pending.reply(Ok()), local=True)
    client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=60)
    try:
        for _ in range(20_000):  # their replies are more than a socket buffer holds
            client.post(Ping())
        assert isinstance(client.call(Ping(), 60), Ok)
    finally:
        client.close()
        service.close()


_FLOOD = (
    "import socket, sys\n"
    "blob = sys.stdin.buffer.read()\n"
    "sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
    "sock.connect('\\0' + sys.argv[1].removeprefix('local:'))\n"
    "sock.sendall(blob)\n"
)


async def test_a_peer_that_sends_without_pause_leaves_the_others_their_turn():
    """A peer streams notices faster than the service serves them: another peer's `Ping` is
    answered while that stream is still being read, not after it."""
    service = _Lane()
    serving = asyncio.ensure_future(service.serve())
    channel = AsyncLocalChannel(service.local_endpoint, Codec(Reply))
    notice = _framed(1, Free("p", list(range(1000))))
    count = (32 << 20) // len(notice)
    flood = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _FLOOD, service.local_endpoint, stdin=subprocess.PIPE
    )
    try:
        assert flood.stdin is not None
        flood.stdin.write(notice * count)
        await flood.stdin.drain()
        flood.stdin.close()
        await eventually_async(lambda: service.served > 0, 30)
        assert isinstance(await channel.call(Ping(), 30), Ok)
        assert service.served < count, "the Ping waited for the whole stream"
    finally:
        channel.close()
        if flood.returncode is None:
            flood.kill()
        await flood.wait()
        service.stop()
        await serving


_STARVED = """
import asyncio, sys, threading
from tests.peers import ParkedService
from transfer_queue.wire.messages import StorageRequest, UnitStatus, VersionReply
from transfer_queue.wire.rpc import Codec, Ok, ThreadService, _local

_local.ACCEPT_RETRY = float(sys.argv[2])
# UnitStatus is answered with the lane's failed accepts
if sys.argv[1] == "thread":
    lane = []
    service = ThreadService(
        Codec(StorageRequest),
        lambda msg, pending: pending.reply(VersionReply(lane[0].failed) if isinstance(msg, UnitStatus) else Ok()),
        local=True,
    )
    lane.append(service._lane)
    print(service.local_endpoint, flush=True)
    sys.stdin.read()
else:
    async def main():
        service = ParkedService(local=True)
        service.route(UnitStatus, lambda msg, data: VersionReply(service._lane.failed))
        print(service.local_endpoint, flush=True)
        await service.serve()
    asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["asyncio", "thread"])
@pytest.mark.parametrize("resume", ["peer_leaves", "retry"])
def test_a_lane_out_of_descriptors_stops_accepting_without_spinning_and_serves_on(kind, resume):
    """A service whose lane cannot accept (no descriptor left: its RLIMIT_NOFILE lowered under
    it) does not retry while the connection waits (its listener stays readable): it serves its
    other peers meanwhile, its failed accepts (counted as it serves 200 requests) stay a few, and
    it accepts the waiting connection once a lane peer leaves (`peer_leaves`: its retry set to
    an hour, so only that can resume it) or after `ACCEPT_RETRY` s (`retry`: no peer leaves)."""
    retry = 3600.0 if resume == "peer_leaves" else 0.2
    proc = subprocess.Popen(
        [sys.executable, "-c", _STARVED, kind, str(retry)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    first = waiting = None
    try:
        endpoint = proc.stdout.readline().strip()
        first = LocalChannel(endpoint, Codec(Reply), timeout=30)
        assert first.call(UnitStatus()).version == 0
        used = {int(fd) for fd in os.listdir(f"/proc/{proc.pid}/fd")}
        lowest_free = min(set(range(len(used) + 1)) - used)
        limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # its next descriptor fails
        # in the backlog: not accepted, so its pings are not answered until it is (DEAD_AFTER)
        waiting = LocalChannel(endpoint, Codec(Reply), timeout=30, dead_after=30)
        rid = waiting.send(Ping())
        started = time.monotonic()
        failed = [first.call(UnitStatus()).version for _ in range(200)]
        retries = (time.monotonic() - started) / retry
        assert failed[-1] >= 1, "the waiting connection was accepted: the limit did not bite"
        assert failed[-1] <= 2 + retries, f"{failed[-1]} failed accepts while serving 200 requests: it spins"
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        if resume == "peer_leaves":
            first.close()  # a lane peer leaves: the service accepts again at once
        assert isinstance(waiting.reply(rid, 30)[0], Ok)
    finally:
        for channel in (first, waiting):
            if channel is not None:
                channel.close()
        proc.kill()
        proc.wait()


async def test_closing_an_async_lane_channel_drops_no_notice_its_socket_had_not_taken():
    """Notices posted to a lane whose service reads nothing yet (more than the socket holds, so
    most wait in the channel), then the channel is closed: every one still arrives, in order,
    once the service reads, as over a ZeroMQ channel (test_rpc_channel); the connection then
    ends, as the linger does (not when its task is freed: the test holds it)."""
    lane = _local.Lane()
    channel = AsyncLocalChannel(lane.endpoint, Codec(Reply))
    n, frame = 64, bytes(256 << 10)  # 16 MiB: far beyond the socket's buffer
    try:
        for _ in range(n):
            channel.post(Ping(), [frame])
        assert channel._out, "the socket took everything: nothing to linger"
        channel.close()
        tasks = asyncio.all_tasks()  # the linger's among them

        def pings() -> tuple[list[int], bool]:
            peer = lane.accept()
            assert peer is not None
            requests, ids = Codec(StorageRequest), []
            while select.select([peer.sock], [], [], 10)[0]:
                messages, ended = lane.receive(peer)
                ids += [rid for rid, msg, _ in map(requests.decode, messages) if isinstance(msg, Ping)]
                if ended:
                    return ids, True
            return ids, False

        ids, ended = await asyncio.to_thread(pings)
        assert ids == sorted(ids) and len(ids) == n
        assert ended and tasks, "the connection stayed open after the linger"
    finally:
        lane.close()


def test_a_call_submitted_to_a_thread_service_that_raises_leaves_it_serving():
    """A service's own bookkeeping queued with `submit` fails: the failure is logged, and the
    service thread goes on serving its clients."""
    service = ThreadService(Codec(StorageRequest), lambda msg, pending: pending.reply(Ok()), local=True)
    client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=30)
    ran = threading.Event()

    def broken() -> None:
        ran.set()
        raise RuntimeError("a bookkeeping bug")

    try:
        service.submit(broken)
        assert ran.wait(30)
        assert isinstance(client.call(Ping(), 30), Ok)
    finally:
        client.close()
        service.close()


def _lingered(lane: _local.Lane) -> tuple[int, bool]:
    """Read the lane's one peer until its connection ends or nothing comes for 10 s: (the pings
    it sent, whether its connection ended)."""
    peer = lane.accept()
    assert peer is not None
    requests, pings = Codec(StorageRequest), 0
    while select.select([peer.sock], [], [], 10)[0]:
        messages, ended = lane.receive(peer)
        pings += sum(isinstance(msg, Ping) for _, msg, _ in map(requests.decode, messages))
        if ended:
            return pings, True
    return pings, False


def _lingering_channel(lane: _local.Lane, n: int) -> None:
    """Post `n` notices of 256 KiB to `lane` (which reads nothing yet), then close the channel:
    most are still queued in it, and go on going out after the close (`_linger`)."""
    channel = AsyncLocalChannel(lane.endpoint, Codec(Reply))
    for _ in range(n):
        channel.post(Ping(), [bytes(256 << 10)])
    assert channel._out, "the socket took everything: nothing to linger"
    channel.close()
    assert _local._LINGERING, "the closed channel's connection lingers"


async def test_a_child_forked_while_a_closed_channel_lingers_leaves_the_service_its_end():
    """The child closes its copy of the lingering connection (as of every lane connection): the
    service sees the peer gone once the parent's linger has sent everything, though the child lives."""
    lane = _local.Lane()
    hold, release = os.pipe()
    try:
        _lingering_channel(lane, 64)
        pid = os.fork()
        if pid == 0:  # the child holds whatever it inherited until the parent is done
            os.read(hold, 1)
            os._exit(0)
        try:
            pings, ended = await asyncio.to_thread(_lingered, lane)
        finally:
            os.write(release, b"x")
            os.waitpid(pid, 0)
        assert ended, "the connection stayed open after the linger: the child kept it"
        assert pings == 64
    finally:
        os.close(hold)
        os.close(release)
        lane.close()


@contextlib.contextmanager
def _no_resource_warning() -> Iterator[None]:
    """Fail if the block leaves anything to the garbage collector that warns on collection
    (an unclosed socket: `ResourceWarning`)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        yield
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_a_loop_that_stops_while_a_closed_channel_lingers_closes_its_connection():
    """`asyncio.run` ends the linger (a last send of what the socket takes), closing the
    connection itself: nothing is left to the garbage collector (no ResourceWarning)."""
    lane = _local.Lane()

    async def close_lingering() -> None:
        _lingering_channel(lane, 64)

    try:
        with _no_resource_warning():
            asyncio.run(close_lingering())
            gc.collect()
        assert not _local._LINGERING
        pings, ended = _lingered(lane)
        assert ended and 0 < pings < 64
    finally:
        lane.close()


def test_a_channel_closed_while_its_loop_is_not_running_leaves_no_task_pending(caplog):
    """Closed between two runs of its loop (or after the last), the channel sends what the
    socket takes at once and closes the connection: a task would wait for a loop that may never
    run again, and be destroyed pending (logged) with the loop."""
    lane = _local.Lane()
    loop = asyncio.new_event_loop()

    async def open_full() -> AsyncLocalChannel:
        channel = AsyncLocalChannel(lane.endpoint, Codec(Reply))
        for _ in range(64):
            channel.post(Ping(), [bytes(256 << 10)])
        return channel

    try:
        channel = loop.run_until_complete(open_full())
        assert channel._out, "the socket took everything: nothing to linger"
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            channel.close()
            loop.close()
            del loop
            gc.collect()
        assert "Task was destroyed" not in caplog.text
        assert not _local._LINGERING
        pings, ended = _lingered(lane)
        assert ended and 0 < pings < 64
    finally:
        lane.close()


def test_a_blocking_lane_channels_waits_end_at_once_once_its_interrupt_is_readable():
    """What a driver closed from another thread relies on (`interrupt_on`): a wait for a reply
    and a wait for room in a full socket both end with `lost` (the half-sent message ending the
    connection), however long they were to last."""
    lane = _local.Lane()
    wake, woken = socket.socketpair()
    try:
        channel = LocalChannel(lane.endpoint, Codec(Reply), timeout=60)
        channel.interrupt_on(wake.fileno())
        rid = channel.send(Ping())
        woken.send(b"x")
        with pytest.raises(ServiceError, match="interrupted"):
            channel.reply(rid, 60)
        assert not channel.ended, "an interrupted wait for a reply leaves the connection framed"
        with pytest.raises(ServiceError, match="half sent"):
            channel.send(Ping(), [bytes(BIG)])  # more than the socket holds: nobody reads it
        assert channel.ended
    finally:
        wake.close()
        woken.close()
        lane.close()


@pytest.mark.parametrize("began", [True, False], ids=["linger_began", "linger_never_began"])
def test_a_loop_closed_while_a_closed_channel_lingers_closes_its_connection(began):
    """A loop closed without cancelling its tasks (a loop run by hand) drops the linger's task,
    whether it had begun or not: once collected, it closes the connection itself (no
    ResourceWarning), and the service sees the peer gone."""
    lane = _local.Lane()
    loop = asyncio.new_event_loop()

    async def close_lingering() -> None:
        _lingering_channel(lane, 64)

    try:
        with _no_resource_warning():
            if began:  # the loop runs once more after the coroutine: the linger takes its first step
                loop.run_until_complete(close_lingering())
            else:  # the loop stops in the step that closes the channel
                loop.call_soon(_lingering_channel, lane, 64)
                loop.call_soon(loop.stop)
                loop.run_forever()
            loop.close()
            del loop
            gc.collect()
        assert not _local._LINGERING, "the closed loop's linger still holds its connection"
        pings, ended = _lingered(lane)
        assert ended, "the connection stayed open after its loop was closed"
        assert pings < 64
    finally:
        lane.close()
