"""`PeerWatch` ends exactly the peers of a closed connection, though the kernel hands a closed
descriptor to the next connection at once and the monitor may lose events."""

from __future__ import annotations

import struct

import zmq

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


def test_a_closed_connection_ends_its_peer_and_not_the_next_on_its_descriptor() -> None:
    watch, gone, queued = _watch()
    queued.append(_event(zmq.EVENT_ACCEPTED, 9))
    watch.seen(_Frame(b"a", 9))
    # a closes, b connects on the same descriptor and speaks before the events are read
    queued += [_event(zmq.EVENT_DISCONNECTED, 9), _event(zmq.EVENT_ACCEPTED, 9)]
    watch.seen(_Frame(b"b", 9))
    assert gone == [b"a"] and len(watch) == 1
    watch.event(_event(zmq.EVENT_DISCONNECTED, 9))
    assert gone == [b"a", b"b"] and len(watch) == 0


def test_lost_events_never_end_a_live_peer() -> None:
    watch, gone, queued = _watch()
    queued.append(_event(zmq.EVENT_ACCEPTED, 5))
    watch.seen(_Frame(b"a", 5))
    watch.event(_event(zmq.EVENT_DISCONNECTED, 5))
    watch.seen(_Frame(b"b", 5))  # b's accept event was lost
    assert gone == [b"a"], "b is alive"
    watch.event(_event(zmq.EVENT_DISCONNECTED, 5))  # b closed ...
    watch.event(_event(zmq.EVENT_ACCEPTED, 5))  # ... and c connected
    watch.seen(_Frame(b"c", 5))
    assert gone == [b"a"], "b's end is not certain (the events do not add up): it is told late, c lives"
    watch.event(_event(zmq.EVENT_DISCONNECTED, 5))
    assert sorted(gone) == [b"a", b"b", b"c"]
    # a close event lost: the next peer to speak on the descriptor shows the old one is gone
    queued.append(_event(zmq.EVENT_ACCEPTED, 7))
    watch.seen(_Frame(b"d", 7))
    queued.append(_event(zmq.EVENT_ACCEPTED, 7))
    watch.seen(_Frame(b"e", 7))
    assert gone[-1] == b"d" and len(watch) == 1
