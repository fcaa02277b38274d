"""The kernel's channels (`transfer_queue.wire.rpc`) against a real peer socket or service."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import queue
import subprocess
import sys
import threading
import warnings

import pytest
import zmq
import zmq.asyncio

from tests.helpers import eventually, eventually_async
from tests.peers import ParkedService
from transfer_queue.wire.errors import InternalError, SchemaError, ServiceError
from transfer_queue.wire.errors import TimeoutError as Late
from transfer_queue.wire.messages import Free, Read, Reply, StorageRequest, UnitStatus
from transfer_queue.wire.rpc import (
    SOCKET_BUFFER_BYTES,
    AsyncChannel,
    Cancel,
    Channel,
    Codec,
    LocalChannel,
    Ok,
    Pending,
    Ping,
    Service,
    ThreadService,
)


async def test_posted_requests_are_queued_not_dropped_when_the_peer_lags():
    """More posts than the socket's queue holds, to a peer that reads nothing yet: every one
    arrives, in order, once it reads (a dropped `Free` would leak a unit's bytes, a dropped
    `Ping` make a busy unit look dead)."""
    peer = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    channel = AsyncChannel(f"tcp://127.0.0.1:{port}", Codec(Reply))
    try:
        n = 3 * channel.sock.getsockopt(zmq.SNDHWM)  # well past what the socket queues
        for _ in range(n):
            channel.post(Ping())
        requests = Codec(StorageRequest)
        ids = []
        while len(ids) < n:
            frames = await asyncio.wait_for(peer.recv_multipart(), 30)
            rid, msg, _ = requests.decode(frames[1:])
            if isinstance(msg, Ping):
                ids.append(rid)
        assert ids == sorted(ids) and len(set(ids)) == n
    finally:
        channel.close()
        peer.close()


def _lagging_peer() -> tuple[zmq.Socket, str]:
    """A ROUTER that takes little before it is read: what a channel sends it waits in the
    channel's ZeroMQ queue, unwritten."""
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.setsockopt(zmq.RCVBUF, 1 << 16)
    return peer, f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"


def _pings(peer: zmq.Socket, n: int) -> int:
    """How many of the next `n` messages `peer` receives are `Ping`s (it stops at a silence of 10 s)."""
    requests, got = Codec(StorageRequest), 0
    while got < n and peer.poll(10_000):
        got += isinstance(requests.decode(peer.recv_multipart(copy=False)[1:])[1], Ping)
    return got


@pytest.mark.parametrize("kind", [Channel, AsyncChannel])
async def test_closing_an_idle_channel_drops_no_posted_notice(kind):
    """Notices posted to a peer that has not read them yet (more than the socket buffers hold,
    so ZeroMQ still holds most, unwritten), then the channel, idle, is closed (as a client
    closes a ZeroMQ channel it leaves for a lane): every notice still arrives."""
    peer, endpoint = _lagging_peer()
    channel = kind(endpoint, Codec(Reply), connect_timeout=30)
    n, frame = 64, bytes(256 << 10)  # 16 MiB: far beyond the two socket buffers
    try:
        for _ in range(n):
            channel.post(Ping(), [frame])
        await eventually_async(lambda: channel.idle, what="every post handed to ZeroMQ")
        channel.close()
        assert _pings(peer, n) == n
    finally:
        peer.close()


async def test_a_cancelled_call_is_withdrawn_and_a_closed_channel_fails_its_calls():
    service = ParkedService()
    serving = asyncio.ensure_future(service.serve())
    channel = AsyncChannel(service.address, Codec(Reply))
    try:
        call = asyncio.ensure_future(channel.call(Read("p", [0], ["x"]), 30))
        await eventually_async(lambda: len(service.parked) == 1)
        call.cancel()
        await eventually_async(lambda: service.cancelled == 1)  # the service heard the Cancel
        second = asyncio.ensure_future(channel.call(Read("p", [0], ["x"]), 30))
        await eventually_async(lambda: len(service.parked) == 2)
        channel.close()
        with pytest.raises(ServiceError, match="closed"):
            await asyncio.wait_for(second, 5)
        channel.post(Ping())  # dropped: the peer is gone as far as this channel knows
    finally:
        channel.close()
        service.stop()
        await serving


async def test_notices_get_no_answer_and_a_refusal_is_dropped():
    """A notice's handler returns None: nothing comes back (a raw socket sees the next request's
    answer first). A refused notice is answered, and a blocking channel drops that answer
    instead of keeping it for nobody."""
    service = ParkedService()
    serving = asyncio.ensure_future(service.serve())
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(service.address)
    requests, replies = Codec(StorageRequest), Codec(Reply)
    channel = Channel(service.address, Codec(Reply))
    try:
        await raw.send_multipart(requests.encode(1, Free("p", [1])))
        await raw.send_multipart(requests.encode(2, Free("", [1])))
        await raw.send_multipart(requests.encode(3, UnitStatus()))
        answers = [replies.decode(await asyncio.wait_for(raw.recv_multipart(), 10))[:2] for _ in range(2)]
        assert [rid for rid, _ in answers] == [2, 3], "the taken notice got no answer"
        assert answers[0][1].code == "schema"
        channel.post(Free("", [1]))  # refused: its answer arrives and is dropped
        await asyncio.to_thread(channel.call, UnitStatus())  # answered after the notice
        assert channel._stash == {}
    finally:
        raw.close()
        channel.close()
        service.stop()
        await serving


async def _withdrawn_at_once() -> bool:
    """One try of the test below: whether the request and its `Cancel` were read in one drain
    (its handler never started). Either way the withdrawn request gets no answer."""
    service = ParkedService()
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    requests, replies = Codec(StorageRequest), Codec(Reply)
    raw.connect(service.address)
    # queued before the connection is up, so they travel in one batch and arrive together (as a
    # rule: a loaded machine may let the connection up between the two)
    await raw.send_multipart(requests.encode(1, Read("p", [0], ["x"])))
    await raw.send_multipart(requests.encode(2, Cancel(1)))
    await asyncio.wait_for(service.sock.poll(), 10)  # in the service's queue: serve now
    serving = asyncio.ensure_future(service.serve())
    try:
        await raw.send_multipart(requests.encode(3, UnitStatus()))
        answers = [replies.decode(await asyncio.wait_for(raw.recv_multipart(), 10))[:2] for _ in range(2)]
        assert [rid for rid, _ in answers] == [2, 3], "the withdrawn request got an answer"
        assert service._tasks == {}  # forgotten
        return service.parked == []  # never started
    finally:
        raw.close()
        service.stop()
        await serving


async def test_a_request_withdrawn_before_its_handler_starts_is_closed_unanswered():
    """A parked request and its `Cancel` read in one drain: the handler's coroutine is cancelled
    before its first step, is closed (never left "never awaited"), and gets no answer."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            if await _withdrawn_at_once():
                break
        else:
            pytest.fail("the request and its Cancel never arrived together in 20 tries")
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


class _Buggy(Service):
    """A service whose handlers fail with errors that are not Sluice's: bugs."""

    def __init__(self):
        super().__init__(Codec(StorageRequest), "tcp://127.0.0.1:*")
        self.route(UnitStatus, self._status)
        self.route(Read, self._read)
        self.route(Free, self._free)

    def _status(self, msg, data):
        return {}["missing"]

    async def _read(self, msg, data):  # its task fails: answered by `Service._finish`
        raise ZeroDivisionError("division by zero")

    def _free(self, msg, data):
        raise ServiceError("storage unit 3 died")


async def test_a_handler_bug_arrives_as_an_internal_error():
    """An exception that is not a Sluice error, from a handler or its task, is a bug in Sluice:
    the caller gets `InternalError` naming it, not the `ServiceError` of a dead or silent peer;
    a handler's own `ServiceError` stays one."""
    service = _Buggy()
    serving = asyncio.ensure_future(service.serve())
    channel = AsyncChannel(service.address, Codec(Reply))
    try:
        with pytest.raises(InternalError, match="KeyError: 'missing'") as info:
            await channel.call(UnitStatus(), 10)
        assert not isinstance(info.value, ServiceError)
        with pytest.raises(InternalError, match="ZeroDivisionError"):
            await channel.call(Read("p", [0], ["x"]), 10)
        with pytest.raises(ServiceError, match="storage unit 3 died"):
            await channel.call(Free("p", [0]), 10)
    finally:
        channel.close()
        service.stop()
        await serving


async def test_channels_and_services_keep_their_socket_buffers_small():
    """Every data-plane socket asks for `SOCKET_BUFFER_BYTES` (left to the kernel, loopback
    buffers grow to 32 MiB and a streamed batch falls out of cache)."""
    service = ParkedService()
    channels = [Channel(service.address, Codec(Reply)), AsyncChannel(service.address, Codec(Reply))]
    try:
        for sock in [service.sock, *(c.sock for c in channels)]:
            assert (sock.getsockopt(zmq.SNDBUF), sock.getsockopt(zmq.RCVBUF)) == (SOCKET_BUFFER_BYTES,) * 2
    finally:
        for channel in channels:
            channel.close()
        service.sock.close(linger=0)


def test_a_thread_service_reports_each_closed_connection_and_drops_its_requests():
    """`on_disconnect(peer)` names the connection a request came over (`Pending.peer`) when it
    closes, once, after its open requests are dropped; a second client's requests are its own."""
    gone: queue.Queue[bytes] = queue.Queue()
    parked: list[Pending] = []
    service = ThreadService(Codec(StorageRequest), lambda msg, pending: parked.append(pending), on_disconnect=gone.put)
    first, second = Channel(service.endpoint, Codec(Reply)), Channel(service.endpoint, Codec(Reply))
    try:
        first.send(Read("p", [0], ["x"]))
        second.send(Read("p", [0], ["x"]))
        assert isinstance(first.call(Ping(), timeout=10), Ok) and isinstance(second.call(Ping(), timeout=10), Ok)
        assert len(parked) == 2 and parked[0].peer != parked[1].peer
        first.close()
        peer = gone.get(timeout=30)
        assert peer in {p.peer for p in parked}
        dropped = next(p for p in parked if p.peer == peer)
        kept = next(p for p in parked if p.peer != peer)
        assert dropped.done and not kept.done
        assert isinstance(second.call(Ping(), timeout=10), Ok)  # the loop goes on; nothing else closed
        assert gone.empty()
    finally:
        first.close()
        second.close()
        service.close()


def test_requests_queued_behind_a_closing_are_never_left_open():
    """A connection that sends two requests and closes while the server thread is busy with the
    first: the second, read after the closing was seen, is dropped unanswered (its peer is
    gone), so once the closing is reported no request of that connection is still open."""
    gone: queue.Queue[bytes] = queue.Queue()
    parked: list[Pending] = []
    busy, release = threading.Event(), threading.Event()

    def handler(msg, pending):  # noqa: ANN001
        parked.append(pending)
        if len(parked) == 2:
            busy.set()
            assert release.wait(30)  # the server thread is held while the client closes

    service = ThreadService(Codec(StorageRequest), handler, on_disconnect=gone.put)
    helper, client = Channel(service.endpoint, Codec(Reply)), Channel(service.endpoint, Codec(Reply))
    try:
        helper.send(Read("p", [0], ["x"]))
        assert isinstance(helper.call(Ping(), timeout=10), Ok)
        client.send(Read("p", [1], ["x"]))  # holds the server thread
        assert busy.wait(30)
        client.send(Read("p", [2], ["x"]))
        client.close()
        # a round trip through another service of the same ZeroMQ context: its I/O thread has
        # handled the closing by then, so the held server sees it before the queued request
        probe = ThreadService(Codec(StorageRequest), lambda msg, pending: None)
        with contextlib.closing(Channel(probe.endpoint, Codec(Reply))) as channel:
            assert isinstance(channel.call(Ping(), timeout=10), Ok)
        probe.close()
        release.set()
        peer = gone.get(timeout=30)
        assert peer == parked[1].peer
        assert all(p.done for p in parked if p.peer == peer)
        assert not parked[0].done
    finally:
        release.set()
        helper.close()
        client.close()
        service.close()


def test_a_first_request_read_after_its_connection_closed_is_served_then_its_peer_reported_gone():
    """A connection that sends one request and closes while the server thread is busy: its
    request, read once its descriptor hung up, is served (a notice such as a `Release` counts),
    and its peer is reported gone right after, so what it took is let go at once (before: held
    by a peer bound to the descriptor's next connection until that one closed)."""
    parked: list[Pending] = []
    held: set[bytes] = set()  # what each connection took, as a weight lease: freed when it is gone
    busy, release, served = threading.Event(), threading.Event(), threading.Event()

    def handler(msg, pending):  # noqa: ANN001
        parked.append(pending)
        held.add(pending.peer)
        if len(parked) == 1:
            busy.set()
            assert release.wait(30)  # the server thread is held while the client closes
        else:
            served.set()

    service = ThreadService(Codec(StorageRequest), handler, on_disconnect=held.discard)
    helper = Channel(service.endpoint, Codec(Reply))
    own = zmq.Context()  # the client's own: its `term` returns once its socket is closed
    client = own.socket(zmq.DEALER)
    try:
        helper.send(Read("p", [0], ["x"]))  # holds the server thread
        assert busy.wait(30)
        client.connect(service.endpoint)
        client.send_multipart(Codec(StorageRequest).encode(1, Read("p", [1], ["x"])))
        client.close(linger=10_000)  # the request goes out, then the connection closes
        own.term()  # returns once the request was sent and the connection closed
        release.set()
        assert served.wait(30), "the closed connection's request was not served"
        settled = threading.Event()
        service.submit(settled.set)  # runs once that request's handling is over
        assert settled.wait(30)
        assert held == {parked[0].peer}, "its peer was not reported gone: what it took is still held"
        assert parked[1].done, "its request is still open"
    finally:
        release.set()
        helper.close()
        service.close()


def test_the_local_lane_serves_requests_as_the_router_does_and_reports_a_closed_peer():
    """A `ThreadService(local=True)` answers, parks and fails requests that come over its Unix
    socket like those over ZeroMQ; a notice sent just before the client closes is still served,
    and the closing is then reported once with the lane's own peer identity, after its open
    requests are dropped."""
    gone: queue.Queue[bytes] = queue.Queue()
    parked: list[Pending] = []
    seen: list[object] = []

    def handler(msg, pending):  # noqa: ANN001
        seen.append(msg)
        if isinstance(msg, Read) and msg.partition == "fail":
            raise SchemaError("no such partition")
        if isinstance(msg, Read):
            parked.append(pending)
        else:
            pending.reply(Ok())

    service = ThreadService(Codec(StorageRequest), handler, on_disconnect=gone.put, local=True)
    assert service.local_endpoint.startswith("local:")
    client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=10)
    try:
        assert isinstance(client.call(Ping()), Ok)  # answered by the loop itself
        with pytest.raises(SchemaError, match="no such partition"):
            client.call(Read("fail", [0], ["x"]))
        rid = client.send(Read("p", [0], ["x"]))
        eventually(lambda: parked, 30, "the Read parked")
        parked[0].reply(Ok())
        assert isinstance(client.reply(rid, 10)[0], Ok)
        client.send(Read("p", [1], ["x"]))  # left open
        client.post(Free("p", [1]))  # a notice, then the connection closes at once
        client.close()
        peer = gone.get(timeout=30)
        assert peer == parked[-1].peer and parked[-1].done and len(parked) == 2
        assert isinstance(seen[-1], Free), "the notice sent before the closing was served first"
        assert gone.empty()
    finally:
        client.close()
        service.close()


def test_a_local_client_of_a_service_that_goes_raises_at_once():
    """The service closing (or its process dying) ends the lane's connections: a call waiting
    on it raises the channel's `lost` error at once, not at its deadline; a lane that is gone
    cannot be reached."""
    service = ThreadService(Codec(StorageRequest), lambda msg, pending: None, local=True)  # parks everything
    client = LocalChannel(service.local_endpoint, Codec(Reply), timeout=60)
    waiting: queue.Queue[BaseException] = queue.Queue()

    def call() -> None:
        try:
            client.call(Read("p", [0], ["x"]))
        except ServiceError as exc:
            waiting.put(exc)

    caller = threading.Thread(target=call)
    caller.start()
    service.close()
    assert "dropped the connection" in str(waiting.get(timeout=30))
    caller.join(30)
    client.close()
    with pytest.raises(ServiceError, match="cannot be reached"):
        LocalChannel(service.local_endpoint, Codec(Reply))


def test_a_peer_dropping_the_connection_is_reported_at_once_to_each_awaited_request():
    """A blocking channel watching disconnects, two requests out: the peer answers the first
    and drops the connection. Waiting for the second raises `lost` at once (not after
    `dead_after` of silence), the monitor that told it kept while a request was awaited."""
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
    channel = Channel(endpoint, Codec(Reply), dead_after=60, watch_disconnect=True)
    try:
        first, second = channel.send(Ping()), channel.send(Ping())
        requests, replies = Codec(StorageRequest), Codec(Reply)
        frames = [peer.recv_multipart() for _ in range(2)]
        rid, _, _ = requests.decode(frames[0][1:])
        peer.send_multipart([frames[0][0], *replies.encode_now(rid, Ok())])
        assert isinstance(channel.reply(first, 30)[0], Ok)
        peer.close()
        with pytest.raises(ServiceError, match="dropped the connection"):
            channel.reply(second, 30)  # 30 s < dead_after: only the monitor can end it sooner
    finally:
        channel.close()
        peer.close()


_STORM = """
import socket, sys, threading, time
import zmq
from transfer_queue.wire.errors import ServiceError, TimeoutError
from transfer_queue.wire.messages import Reply
from transfer_queue.wire.rpc import Channel, Codec, Ping
from transfer_queue.wire.rpc._context import shared_context

ctx = shared_context(zmq.Context)
ctx.sockopts[zmq.RECONNECT_IVL] = 1  # the refused reconnects in seconds rather than minutes
peer = ctx.socket(zmq.ROUTER)
peer.setsockopt(zmq.LINGER, 0)
port = peer.bind_to_random_port("tcp://127.0.0.1")
channel = Channel(f"tcp://127.0.0.1:{port}", Codec(Reply), connect_timeout=0.5, watch_disconnect=True)
if sys.argv[1] == "late":  # a request the peer takes and never answers, its id left awaited
    rid = channel.send(Ping())
    try:
        channel.reply(rid, 0.3)
    except TimeoutError:
        pass
peer.close()
give_up = time.monotonic() + 30
while True:  # the port, once ZeroMQ's I/O thread let it go
    try:
        listener = socket.create_server(("127.0.0.1", port), backlog=512)
        break
    except OSError:
        assert time.monotonic() < give_up, "the port was never let go"
        time.sleep(0.01)
if sys.argv[1] == "unreachable":
    try:
        channel.call(Ping())
    except ServiceError:
        pass  # never connected
dropped, more = 0, threading.Condition()

def drop_every_connection():  # what a peer refusing this client's credentials does
    global dropped
    while True:
        conn, _ = listener.accept()
        conn.close()
        with more:
            dropped += 1
            more.notify_all()

threading.Thread(target=drop_every_connection, daemon=True).start()
with more:  # the channel idles, its peer dropping each reconnect, past the monitor queue's 2,000 events
    assert more.wait_for(lambda: dropped >= 3000, 60), f"only {dropped} reconnects"
router = ctx.socket(zmq.ROUTER)
dealer = ctx.socket(zmq.DEALER)
dealer.connect(f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}")
dealer.send(b"still moving")
print("other sockets work" if router.poll(10_000) else "the process's sockets stalled", flush=True)
"""


@pytest.mark.parametrize("after", ["unreachable", "late"])
def test_an_idle_channel_watching_disconnects_never_stalls_the_process(after):
    """libzmq sends monitor events from the process's one I/O thread and blocks there once a
    monitor's queue is full: an idle channel must hold no monitor, or a peer dropping each of
    its reconnects (wrong credentials) stops every socket of the process. Idle after a call
    that found no connection, and after a reply that timed out with its request still awaited
    (as a caller of `send` and `reply` leaves it). Run in a process of its own, which stalls if
    it fails."""
    done = subprocess.run([sys.executable, "-c", _STORM, after], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "other sockets work"


@pytest.mark.parametrize("other_awaited", [True, False])
def test_a_request_awaited_again_after_its_reply_timed_out_is_watched_again(other_awaited):
    """A reply that timed out leaves its request for another `reply`, which watches the peer
    again: a drop is reported at once (not after `dead_after`), whether another awaited
    request kept the monitor on meanwhile (the drop it saw is news to this one) or not."""
    peer = zmq.Context.instance().socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{peer.bind_to_random_port('tcp://127.0.0.1')}"
    channel = Channel(endpoint, Codec(Reply), dead_after=60, watch_disconnect=True)
    drop = threading.Timer(0.5, peer.close)
    try:
        first = channel.send(Ping())
        peer.recv_multipart()
        with pytest.raises(Late):
            channel.reply(first, 0.1)
        if other_awaited:
            channel.send(Ping())
            peer.recv_multipart()
        drop.start()  # while `first` is awaited again below
        with pytest.raises(ServiceError, match="dropped the connection"):
            channel.reply(first, 30)  # 30 s < dead_after: only the monitor can end it sooner
    finally:
        drop.join()
        channel.close()
        peer.close()
