"""Which peers of a ROUTER socket have gone: its connections' ends, told by routing identity.

ZeroMQ tells a ROUTER neither that a peer connected nor that it left; its socket monitor tells
when a connection on descriptor `fd` was accepted or closed, and each message tells the `fd` it
came on (`zmq.SRCFD`). One descriptor carries one connection at a time, and the kernel reuses a
closed one at once, so a peer is bound to its descriptor *and* the count of connections accepted
on it, read from the monitor after its first message (whose connection's accept event the
monitor had already queued). A close then ends exactly the peers of that connection or older
ones on its descriptor. A live peer is never reported gone; when the monitor loses events (its
queue overflowed) a closed peer is reported late (once a newer peer speaks on its descriptor or
a later connection there closes) or, at worst, never: its puts then end at their expiry.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import zmq

__all__ = ["PeerWatch", "PEER_EVENTS"]

PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_EVENT = struct.Struct("=HI")


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

    def __len__(self) -> int:
        """Peers being watched."""
        return len(self._fd)

    def seen(self, identity: Any) -> None:
        """A message from `identity` (its frame): bind it to its connection the first time."""
        key = identity.bytes
        if key in self._fd:
            return
        fd = identity.get(zmq.SRCFD)
        if fd < 0:
            return
        self._fd[key] = fd
        self._pull()
        conn = self._accepted.get(fd, 0)
        if self._closed.get(fd, -1) >= conn:  # its accept event was lost: it is the next connection
            conn += 1
        peers = self._on.setdefault(fd, {})
        for other, at in list(peers.items()):
            if at < conn:  # an older connection on this descriptor: it closed
                self._end(fd, other)
        peers[key] = conn

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
        self._gone(identity)
