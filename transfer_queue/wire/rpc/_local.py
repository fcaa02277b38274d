"""The local lane: a `ThreadService`'s second way in, for clients on its own host.

Over ZeroMQ a message wakes three threads on its way: the sender's ZeroMQ I/O thread, the
receiver's, and the thread that reads it. A Unix stream socket that the service thread polls
itself, and that its client reads itself, wakes one (the reader). `ThreadService(local=True)` listens on one (`Lane`)
and serves what arrives there exactly as what arrives on its ROUTER; `LocalChannel` is the
client: the blocking `Channel`'s `send`, `post`, `reply`, `call` and `close`, over that socket.

Framing: each message is `u32 prefix length, u32 body length, prefix, body` (the kernel's prefix
and body frames; the lane carries no data frames). The address lives in Linux's abstract
namespace (no file to remove; it goes with the process). Only processes of the service's own
user are admitted (the kernel's `SO_PEERCRED` of the connecting process): they may read the
service process's memory anyway, so CurveZMQ would protect nothing more on this lane.
"""

from __future__ import annotations

import itertools
import os
import secrets
import select
import socket
import struct
import sys
import time
from typing import Any

from ..errors import ProtocolError, ServiceError, SluiceError, error_from_code
from ..errors import TimeoutError as LateError
from ._codec import GRACE, MAX_BODY_BYTES, Codec, ErrorReply, Message, log

__all__ = ["Lane", "LocalChannel", "supported"]

_HEAD = struct.Struct("<II")
_PREFIX = "local:"
_CRED = struct.Struct("3i")  # pid, uid, gid


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux")


def _address(endpoint: str) -> str:
    if not endpoint.startswith(_PREFIX):
        raise ValueError(f"{endpoint!r} is not a local lane endpoint")
    return "\0" + endpoint[len(_PREFIX) :]


class _Reader:
    """Whole messages out of a byte stream: append what arrived to `buf`, then take `messages()`."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def messages(self) -> list[list[bytes]]:
        """The complete messages received so far, each as [prefix, body].

        Raises:
            ProtocolError: a message announces more than `MAX_BODY_BYTES`.
        """
        out = []
        while len(self.buf) >= _HEAD.size:
            head, body = _HEAD.unpack_from(self.buf)
            if head + body > MAX_BODY_BYTES + 64:
                raise ProtocolError(f"a local message of {head + body} bytes exceeds the limit")
            end = _HEAD.size + head + body
            if len(self.buf) < end:
                break
            out.append([bytes(self.buf[_HEAD.size : _HEAD.size + head]), bytes(self.buf[_HEAD.size + head : end])])
            del self.buf[:end]
        return out


def _frame(frames: list[Any]) -> bytes:
    prefix, body = frames
    return _HEAD.pack(len(prefix), len(body)) + bytes(prefix) + bytes(body)


class _Peer:
    __slots__ = ("sock", "identity", "reader")

    def __init__(self, sock: socket.socket, identity: bytes):
        self.sock, self.identity, self.reader = sock, identity, _Reader()


class Lane:
    """The listening side, driven by its service thread: `accept` when the listener is readable,
    `receive` when a peer is, `send` a reply to a peer, `drop` a peer."""

    def __init__(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"sluice-rpc-{os.getpid()}-{secrets.token_hex(8)}"
        self.listener.bind("\0" + name)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.endpoint = _PREFIX + name
        self.peers: dict[bytes, _Peer] = {}
        self.by_fd: dict[int, _Peer] = {}
        self.refused = 0
        self.failed = 0
        """Accepts that failed (no descriptor left, say)."""
        self._ids = itertools.count(1)

    def accept(self) -> _Peer | None:
        """The next connection, if one is waiting and comes from this user (else it is closed)."""
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            # out of descriptors, say: this connection waits in the backlog and the service
            # goes on serving the others (its thread must not die of one accept)
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.warning("the local lane cannot accept a connection (%s; %d times)", exc, self.failed)
            return None
        _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        if uid != os.geteuid():
            self.refused += 1
            sock.close()
            return None
        sock.setblocking(False)
        # never a ROUTER identity (those are 5 bytes, the first zero): the two lanes share one table
        peer = _Peer(sock, b"local/%d" % next(self._ids))
        self.peers[peer.identity] = peer
        self.by_fd[sock.fileno()] = peer
        return peer

    def receive(self, peer: _Peer) -> tuple[list[list[bytes]], bool]:
        """(the whole messages `peer` sent so far, whether its connection then closed or broke);
        a closed peer is dropped here, and the caller reports it gone after serving those
        messages (a notice sent just before closing still counts)."""
        closed = False
        try:
            while True:
                chunk = peer.sock.recv(1 << 16)
                if not chunk:
                    closed = True
                    break
                peer.reader.buf += chunk
                if len(chunk) < 1 << 16:
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            log.debug("local peer %r dropped: %s", peer.identity, exc)
            closed = True
        try:
            messages = peer.reader.messages()
        except ProtocolError as exc:
            log.warning("local peer %r sent a malformed message (%s); closing its connection", peer.identity, exc)
            messages, closed = [], True
        if closed:
            self.drop(peer)
        return messages, closed

    def send(self, identity: bytes, frames: list[Any]) -> None:
        """Send a reply to `identity` (dropped if it is gone, or has stopped reading)."""
        peer = self.peers.get(identity)
        if peer is None:
            return
        data = _frame(frames)
        try:
            sent = peer.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return  # closed: its end is read next
        if sent < len(data):
            # a peer whose socket buffer is full stopped reading its replies: cut it off rather
            # than block the service thread on it or queue without bound
            log.warning("local peer %r stopped reading its replies; closing its connection", identity)
            peer.sock.shutdown(socket.SHUT_RDWR)

    def drop(self, peer: _Peer) -> None:
        self.peers.pop(peer.identity, None)
        self.by_fd.pop(peer.sock.fileno(), None)
        peer.sock.close()

    def close(self) -> None:
        for peer in list(self.peers.values()):
            self.drop(peer)
        self.listener.close()


class LocalChannel:
    """A blocking request/reply channel to a `ThreadService`'s local lane at `endpoint` (its
    `local_endpoint`), used from one thread; the `Channel` calls that a client on the service's
    host needs. A peer that is gone or drops the connection raises `lost`, at once; no answer
    in time raises `late`.

    Raises:
        SluiceError: (`lost`) the lane cannot be reached within `connect_timeout`.
    """

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None = None,
        timeout: float = GRACE,
        connect_timeout: float = 2.0,
        lost: type[SluiceError] = ServiceError,
        late: type[SluiceError] = LateError,
    ):
        self.endpoint = endpoint
        self.name = name or f"the service at {endpoint}"
        self.codec = replies
        self.timeout = timeout
        self.lost, self.late = lost, late
        self.dead = False
        self._ids = itertools.count(1)
        self._stash: dict[int, tuple[Any, list[Any]]] = {}
        self._expected: set[int] = set()
        self._reader = _Reader()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(connect_timeout)
        try:
            self.sock.connect(_address(endpoint))
        except OSError as exc:
            self.sock.close()
            self.dead = True
            raise lost(f"{self.name} cannot be reached: {exc} (gone?)") from None
        self.sock.settimeout(timeout)  # a send blocks only while the service's buffer is full

    def _write(self, msg: Message) -> int:
        rid = next(self._ids)
        data = _frame(self.codec.encode_now(rid, msg))
        try:
            self.sock.sendall(data)
        except TimeoutError:  # the builtin: the socket's send timeout
            # part of the message may have gone: the stream is no longer framed, so it ends here
            self.dead = True
            self.sock.close()
            raise self.late(f"{self.name} took no message for {self.timeout:g} s") from None
        except OSError as exc:
            self.dead = True
            raise self.lost(f"{self.name} dropped the connection ({exc}; gone?)") from None
        return rid

    def send(self, msg: Message) -> int:
        """Send a request; returns its id. Raises as `LocalChannel` does."""
        rid = self._write(msg)
        self._expected.add(rid)
        return rid

    def post(self, msg: Message) -> None:
        """Send a notice: a request nobody awaits an answer to (its answer is dropped)."""
        self._write(msg)

    def reply(self, rid: int, wait: float | None = GRACE, what: str = "a request") -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid`, waiting at most `wait` s (None: as long
        as the peer is connected).

        Raises:
            SluiceError: (`late`) no answer within `wait`; (`lost`) the peer dropped the connection.
        """
        deadline = None if wait is None else time.monotonic() + wait
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while rid not in self._stash:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self.late(f"{self.name} did not answer {what} within {wait:g}s; is it still running?")
            if not poller.poll(None if left is None else int(left * 1000) + 1):
                continue
            try:
                chunk = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.dead = True
                raise self.lost(f"{self.name} dropped the connection (gone?)")
            self._reader.buf += chunk
            for frames in self._reader.messages():
                try:
                    got, msg, data = self.codec.decode(frames)
                except ProtocolError:
                    log.warning("%s sent an undecodable reply", self.name)
                    continue
                if got in self._expected:
                    self._stash[got] = (msg, data)
        self._expected.discard(rid)
        return self._stash.pop(rid)

    def call(self, msg: Message, timeout: float | None = None) -> Any:
        """Send `msg` and return its reply, waiting at most `timeout` s (default: the channel's).

        Raises:
            SluiceError: the `tq.*` error the service answered with, or as `send` and `reply`.
        """
        rid = self.send(msg)
        reply, _ = self.reply(rid, self.timeout if timeout is None else timeout, what=type(msg).__name__)
        if isinstance(reply, ErrorReply):
            raise error_from_code(reply.code, reply.message)
        return reply

    def close(self) -> None:
        """Close the connection (what was sent before is still delivered; the service then
        sees it closed)."""
        self.sock.close()
