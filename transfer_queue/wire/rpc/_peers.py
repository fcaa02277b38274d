"""Which peers of a ROUTER socket have gone: its connections' ends, told by routing identity.

ZeroMQ tells a ROUTER neither that a peer connected nor that it left; its socket monitor tells
when a connection on descriptor `fd` was accepted or closed, and each message tells the `fd` it
came on (`zmq.SRCFD`). One descriptor carries one connection at a time, and the kernel reuses a
closed one at once, so a peer is bound to its descriptor *and* the count of connections accepted
on it, read from the monitor after its first message. libzmq queues a connection's accept event
after it hands the connection to an I/O thread (`event_accepted` follows `send_attach`): with
one I/O thread (the shared context's default) that is the listener's own, which reads nothing
on the connection before the event is queued, so the count includes it. With more, the first
message may be read before its accept event is queued: the next-connection fallback in `seen`
then binds it to the connection after the last one closed on that descriptor, which is its own
(a descriptor never used before: count 0, which its close still ends). A close then ends
exactly the peers of that connection or older ones on its descriptor.

A message may still be queued when its connection closes and be read after that close: the
peer was reported gone already, or, if it is the peer's first, its descriptor is closed or its
other end hung up by then. Such a message is served as any other (a notice of a closed
connection still counts), and `seen` says so: the service then reports the peer gone once more,
and whatever that message made it hold is let go at once, not at its expiry. Such a peer is not
bound again; the identities reported gone are remembered (the latest `ENDED_KEPT`: ZeroMQ names
each connection anew, and Sluice's clients set no identity of their own).

A live peer is never reported gone: a first message is taken for a closed connection's only on
the kernel's word (its descriptor closed or hung up), never on the monitor's counts. libzmq
4.3.5 drops no monitor event (it sends each with a blocking send from its I/O thread, which
stalls once the monitor's queue is full, until it is read); were one missing all the same, a
closed peer would be reported late (once a newer peer speaks on its descriptor or a later
connection there closes) or, at worst, never (what it holds then ends at its expiry), and a live
one still never.
"""

from __future__ import annotations

import select
import struct
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["PeerWatch", "PEER_EVENTS", "ENDED_KEPT", "RecentlyGone", "hung_up"]

PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
ENDED_KEPT = 4096
"""How many identities a `RecentlyGone` remembers."""
_EVENT = struct.Struct("=HI")
_HUNG_UP = select.POLLNVAL | select.POLLHUP | getattr(select, "POLLRDHUP", 0)
"""poll's word for a descriptor that is closed or whose other end closed (POLLRDHUP: Linux)."""


def hung_up(fd: int) -> bool:
    """Whether descriptor `fd` is closed, or its connection's other end closed its side (a peer
    that exited or closed its socket): either way, no connection that ever came on `fd` is live
    any more. False while the descriptor is open and its peer has not hung up."""
    poll = select.poll()
    poll.register(fd, select.POLLIN | _HUNG_UP)
    return any(events & _HUNG_UP for _, events in poll.poll(0))


class RecentlyGone:
    """The latest `ENDED_KEPT` routing identities whose connections closed, oldest forgotten
    first: a message of theirs read later was queued before that close (ZeroMQ names each
    connection anew, so none of them speaks again). A `PeerWatch` tells such messages, a
    `ThreadService` drops them."""

    def __init__(self) -> None:
        self._ids: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._ids

    def add(self, identity: bytes) -> None:
        """Remember `identity`, forgetting the oldest beyond `ENDED_KEPT`."""
        self._ids[identity] = None
        while len(self._ids) > ENDED_KEPT:
            self._ids.popitem(last=False)


class PeerWatch:
    """Binds each routing identity to its connection; calls `gone(identity)` when it closes.

    `pull` reads the monitor's queued events into `event` (called before a new peer is bound)."""

    def __init__(self, gone: Callable[[bytes], None], pull: Callable[[], None]):
        self._gone = gone
        self._pull = pull
        self._accepted: dict[int, int] = {}
        """fd -> connections accepted on it so far."""
        self._closed: dict[int, int] = {}
        """fd -> the count of connections on it when the last one closed."""
        self._on: dict[int, dict[bytes, int]] = {}
        """fd -> identities seen on it -> the connection (count) they came on."""
        self._fd: dict[bytes, int] = {}
        """identity -> its fd (peers not on a descriptor, e.g. inproc, are never reported)."""
        self._ended = RecentlyGone()
        """The identities reported gone (or found closed when first seen)."""

    def __len__(self) -> int:
        """Peers being watched."""
        return len(self._fd)

    def seen(self, identity: Any) -> bool:
        """A message from `identity` (its frame): bind it to its connection the first time.

        True if that connection is known to have closed already (the peer was reported gone,
        or its descriptor is closed or hung up when it is first seen): the message is served
        all the same, and the caller then reports the peer gone (again), for what it acquired."""
        key = identity.bytes
        if key in self._fd:
            return False
        if key in self._ended:
            return True
        fd = identity.get(zmq.SRCFD)
        if fd < 0:
            return False
        self._pull()
        if hung_up(fd):  # its connection closed before this, its first message, was read
            self._ended.add(key)
            return True
        self._fd[key] = fd
        conn = self._accepted.get(fd, 0)
        if self._closed.get(fd, -1) >= conn:
            # its accept event is not queued yet (more than one I/O thread) or was lost, or its
            # connection was closed by this side (an error) and its descriptor not yet, or went to
            # a newer one: taken for the next (told late)
            conn += 1
        peers = self._on.setdefault(fd, {})
        for other, at in list(peers.items()):
            if at < conn:  # an older connection on this descriptor: it closed
                self._end(fd, other)
        peers[key] = conn
        return False

    def event(self, frames: list[Any]) -> None:
        """One monitor event (its frames): count accepts, end the peers of a closed connection."""
        event, fd = _EVENT.unpack(bytes(frames[0])[: _EVENT.size])
        if event == zmq.EVENT_ACCEPTED:
            self._accepted[fd] = self._accepted.get(fd, 0) + 1
        elif event == zmq.EVENT_DISCONNECTED:
            conn = self._accepted.get(fd, 0)
            self._closed[fd] = conn
            for other, at in list(self._on.get(fd, {}).items()):
                if at <= conn:
                    self._end(fd, other)

    def _end(self, fd: int, identity: bytes) -> None:
        peers = self._on[fd]
        del peers[identity]
        if not peers:
            del self._on[fd]
        del self._fd[identity]
        self._ended.add(identity)
        self._gone(identity)
