"""`PeerWatch` ends exactly the peers of a closed connection, though the kernel hands a closed
descriptor to the next connection at once (and were the monitor to lose events); a message read after
its connection closed is served, then its peer reported gone (again), so it holds nothing."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Iterator

import pytest
import zmq
import zmq.asyncio

from tests.peers import ParkedService
from transfer_queue.wire.messages import Read, StorageRequest
from transfer_queue.wire.rpc import Codec, Ping, _peers
from transfer_queue.wire.rpc._peers import PeerWatch


class _Frame:
    def __init__(self, identity: bytes, fd: int):
        self.bytes, self.fd = identity, fd

    def get(self, option: int) -> int:
        assert option == zmq.SRCFD
        return self.fd


def _event(kind: int, fd: int) -> list[bytes]:
    return [struct.pack("=HI", kind, fd), b"tcp://127.0.0.1:1"]


def _watch() -> tuple[PeerWatch, list[bytes], list[list[bytes]]]:
    gone: list[bytes] = []
    queued: list[list[bytes]] = []  # monitor events not read yet

    def pull() -> None:
        while queued:
            watch.event(queued.pop(0))

    watch = PeerWatch(gone.append, pull)
    return watch, gone, queued


@pytest.fixture
def lines() -> Iterator[Callable[[], list[socket.socket]]]:
    """Connected socket pairs: [ours, theirs] each, a descriptor whose connection is live until
    `theirs` closes (the service's side of a connection, as the kernel tells it)."""
    made: list[socket.socket] = []

    def line() -> list[socket.socket]:
        pair = list(socket.socketpair())
        made.extend(pair)
        return pair

    yield line
    for end in made:
        end.close()


def test_a_closed_connection_ends_its_peer_and_not_the_next_on_its_descriptor(lines) -> None:
    fd = lines()[0].fileno()
    watch, gone, queued = _watch()
    queued.append(_event(zmq.EVENT_ACCEPTED, fd))
    watch.seen(_Frame(b"a", fd))
    # a closes, b connects on the same descriptor and speaks before the events are read
    queued += [_event(zmq.EVENT_DISCONNECTED, fd), _event(zmq.EVENT_ACCEPTED, fd)]
    watch.seen(_Frame(b"b", fd))
    assert gone == [b"a"] and len(watch) == 1
    watch.event(_event(zmq.EVENT_DISCONNECTED, fd))
    assert gone == [b"a", b"b"] and len(watch) == 0


def test_lost_events_never_end_a_live_peer(lines) -> None:
    five, seven = lines()[0].fileno(), lines()[0].fileno()
    watch, gone, queued = _watch()
    queued.append(_event(zmq.EVENT_ACCEPTED, five))
    watch.seen(_Frame(b"a", five))
    watch.event(_event(zmq.EVENT_DISCONNECTED, five))
    assert not watch.seen(_Frame(b"b", five)), "b's accept event was lost, but its descriptor is live"
    assert gone == [b"a"], "b is alive"
    watch.event(_event(zmq.EVENT_DISCONNECTED, five))  # b closed ...
    watch.event(_event(zmq.EVENT_ACCEPTED, five))  # ... and c connected
    watch.seen(_Frame(b"c", five))
    assert gone == [b"a"], "b's end is not certain (the events do not add up): it is told late, c lives"
    watch.event(_event(zmq.EVENT_DISCONNECTED, five))
    assert sorted(gone) == [b"a", b"b", b"c"]
    # a close event lost: the next peer to speak on the descriptor shows the old one is gone
    queued.append(_event(zmq.EVENT_ACCEPTED, seven))
    watch.seen(_Frame(b"d", seven))
    queued.append(_event(zmq.EVENT_ACCEPTED, seven))
    watch.seen(_Frame(b"e", seven))
    assert gone[-1] == b"d" and len(watch) == 1


def test_a_message_read_after_its_peer_was_reported_gone_is_told_and_not_bound(lines) -> None:
    """Queued before its connection closed, read after the close: served, its peer reported gone
    again by the service (`seen` says so), never bound to the descriptor's next connection."""
    fd = lines()[0].fileno()
    watch, gone, queued = _watch()
    queued.append(_event(zmq.EVENT_ACCEPTED, fd))
    assert not watch.seen(_Frame(b"a", fd))
    watch.event(_event(zmq.EVENT_DISCONNECTED, fd))
    assert gone == [b"a"]
    queued.append(_event(zmq.EVENT_ACCEPTED, fd))  # the descriptor's next connection, live
    assert watch.seen(_Frame(b"a", fd)) is True, "a is gone: the service reports it again"
    assert len(watch) == 0, "a is not bound again"
    assert watch.seen(_Frame(b"b", fd)) is False  # the next connection is watched as before
    watch.event(_event(zmq.EVENT_DISCONNECTED, fd))
    assert gone == [b"a", b"b"] and len(watch) == 0


def test_a_first_message_read_after_its_connection_closed_is_told_and_not_bound(lines) -> None:
    """A peer's first message read once its connection closed: its descriptor's other end hung
    up, or the descriptor is closed. Either way it is told, whatever the monitor's counts say."""
    watch, gone, queued = _watch()
    for kind in ("hung up", "closed"):
        ours, theirs = lines()
        fd = ours.fileno()
        queued += [_event(zmq.EVENT_ACCEPTED, fd), _event(zmq.EVENT_DISCONNECTED, fd)]
        (theirs if kind == "hung up" else ours).close()
        assert watch.seen(_Frame(kind.encode(), fd)) is True, f"its descriptor {kind}"
        assert watch.seen(_Frame(kind.encode(), fd)) is True, "and so is each message after it"
    assert len(watch) == 0 and gone == []  # the service reports them, once each message is served


def test_identities_reported_gone_are_remembered_up_to_a_bound(lines, monkeypatch) -> None:
    monkeypatch.setattr(_peers, "ENDED_KEPT", 2)
    fd = lines()[0].fileno()
    watch, gone, queued = _watch()
    for name in (b"a", b"b", b"c"):
        queued.append(_event(zmq.EVENT_ACCEPTED, fd))
        watch.seen(_Frame(name, fd))
        watch.event(_event(zmq.EVENT_DISCONNECTED, fd))
    assert gone == [b"a", b"b", b"c"]
    assert watch.seen(_Frame(b"c", fd)) and watch.seen(_Frame(b"b", fd))
    assert not watch.seen(_Frame(b"a", fd)), "forgotten: taken for the live descriptor's next connection"


def _told_gone(service: ParkedService) -> asyncio.Event:
    """Set each time `service` reports a peer gone (listed in `service.gone`)."""
    told = asyncio.Event()

    def gone(peer: bytes) -> None:
        service.gone.append(peer)
        told.set()

    service.on_peer_gone = gone
    return told


async def test_a_request_read_after_its_connection_closed_holds_nothing() -> None:
    """A connection's first request, read by the service after its close was: served, and its
    peer reported gone at once, so the request parks nothing (before, it was held until the
    descriptor's next connection closed)."""
    service = ParkedService()
    told = _told_gone(service)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.connect(service.address)
    await raw.send_multipart(Codec(StorageRequest).encode(1, Read("p", [0], ["x"])))
    await asyncio.wait_for(service.sock.poll(), 10)  # in the service's queue
    raw.close(linger=0)
    while True:  # the service reads the close first
        assert service._monitor.poll(10_000), "the service saw no close"
        frames = service._monitor.recv_multipart()
        service.peers.event(frames)
        if struct.unpack("=H", frames[0][:2])[0] == zmq.EVENT_DISCONNECTED:
            break
    serving = asyncio.ensure_future(service.serve())
    try:
        await asyncio.wait_for(told.wait(), 10)
        assert len(service.gone) == 1 and len(service.peers) == 0
        assert service._tasks == {} and service.parked == [], "the request was withdrawn"
    finally:
        service.stop()
        await serving


async def test_a_request_read_after_its_peer_was_reported_gone_holds_nothing() -> None:
    """A request queued before its connection closed and read after the service reported the
    peer gone: served, and the peer reported gone again at once, so it parks nothing."""
    service = ParkedService()
    told = _told_gone(service)
    codec = Codec(StorageRequest)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.connect(service.address)
    serving = asyncio.ensure_future(service.serve())
    try:
        await raw.send_multipart(codec.encode(1, Ping()))
        await asyncio.wait_for(raw.recv_multipart(), 10)  # watched: its peer is bound
        await raw.send_multipart(codec.encode(2, Read("p", [0], ["x"])))
        raw.close(linger=10_000)  # the request goes out, then the connection closes
        while not service.gone:  # the service reads the close before the request
            assert service._monitor.poll(10_000), "the service saw no close"
            service._read_events()
        told.clear()
        await asyncio.wait_for(told.wait(), 10)
        assert service.gone == service.gone[:1] * 2, "reported gone again"
        assert len(service.peers) == 0, "not bound again"
        assert service._tasks == {} and service.parked == [], "the request was withdrawn"
    finally:
        service.stop()
        await serving
