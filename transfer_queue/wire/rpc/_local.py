"""The local lane: a service's second way in, for clients on its own host.

Over ZeroMQ a message wakes three threads on its way: the sender's ZeroMQ I/O thread, the
receiver's, and the thread that reads it. A Unix stream socket that the service's own thread or
event loop reads, and that its client reads itself, wakes one (the reader). A `ThreadService`
(`local=True`) polls one in its thread and an asyncio `Service` (`local=True`) in its loop
(`Lane`, the listening side both drive); each serves what arrives there exactly as what arrives
on its ROUTER. `LocalChannel` is the blocking client (`Channel`'s calls over that socket),
`AsyncLocalChannel` the asyncio one (`AsyncChannel`'s).

Framing: each message is `u32 prefix length, u32 body length, u32 data frame count, u64 length
of each data frame, prefix, body, data frames` (the kernel's frames, in ZeroMQ's order), each
data frame padded to start `_ALIGN` bytes after the prefix's start (received frames are views of
one buffer: aligned, a tensor of any dtype can use them in place, as it does ZeroMQ's). The
address lives in Linux's abstract namespace (no file to remove; it goes with the process).
Only processes of one user meet on a lane: the service admits a connection only from a process
of its own user, and a client talks only to a listener of its own user (the kernel's
`SO_PEERCRED` of the other end, either way; an abstract name can be taken by anyone, so the
client's check is what keeps another user's process from posing as the service). Such a peer
may read the other's memory anyway, so CurveZMQ would protect nothing more on this lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import mmap
import os
import secrets
import select
import socket
import struct
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import ProtocolError, ServiceError, SluiceError
from ..errors import TimeoutError as LateError
from ._calls import AsyncCalls, SyncCalls
from ._codec import (
    DEAD_AFTER,
    GRACE,
    MAX_BODY_BYTES,
    MAX_DATA_FRAMES,
    SOCKET_BUFFER_BYTES,
    Codec,
    Message,
    Ping,
    log,
)
from ._peer import _Liveness

__all__ = ["ACCEPT_RETRY", "Lane", "LocalChannel", "AsyncLocalChannel", "supported"]

_HEAD = struct.Struct("<III")
_LEN = struct.Struct("<Q")
_PREFIX = "local:"
_CRED = struct.Struct("3i")  # pid, uid, gid
_CHUNK = 1 << 18
_ALIGN = 64
_BACKLOG = 1 << 16
"""Connections a lane's listener lets wait to be accepted. The kernel takes the least of this and
its `net.core.somaxconn` (as many as the host allows, as Go's net package asks for): a crowd of
clients connecting at once waits for the loop to accept them instead of being turned away."""
_QUEUED_MAX = 1 << 30
"""Reply bytes a service keeps queued for one lane peer: a reply that finds more than this still
queued for its peer means the peer stopped reading, and it is cut off (ZeroMQ's ROUTER would drop
its replies). One reply alone may be larger: it is queued whole."""
_COPY_BELOW = 1 << 16
"""Data frames shorter than this are copied into the buffer that carries their message's header
when it is framed (as pyzmq copies frames under `zmq.COPY_THRESHOLD`): a message left queued
holds no view of a small buffer its sender reuses at once (an arena slot, a receive buffer), and
goes out in fewer pieces. Longer frames are sent from the sender's memory, as ZeroMQ's zero-copy
sends are."""
_READ_BUDGET = SOCKET_BUFFER_BYTES
"""Bytes one wake reads from one lane socket; the socket, still readable, wakes its reader again.
A peer that sends without pause thus takes its turn with the loop's other work and peers."""
ACCEPT_RETRY = 1.0
"""Seconds a lane whose accept failed (out of descriptors, say) waits before it tries again,
unless one of its peers leaves first (as asyncio's servers wait after such a failure). Read as
each retry is set (`_local.ACCEPT_RETRY`), so a process may change it (the tests do)."""
_MAX_DATA = 1 << 36
"""Data bytes one lane message may announce where its receiver sets no bound of its own (a client;
a service bounds them by its `max_frame_bytes`, or by `MAX_BODY_BYTES` when it takes none): a
header announcing more is refused before anything is allocated for it."""


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux")


def _address(endpoint: str) -> str:
    if not endpoint.startswith(_PREFIX):
        raise ValueError(f"{endpoint!r} is not a local lane endpoint")
    return "\0" + endpoint[len(_PREFIX) :]


def _buffers(sock: socket.socket) -> None:
    """Give a lane socket ZeroMQ's kernel buffers (`SOCKET_BUFFER_BYTES`): a large message then
    goes in a few wakes of its reader, not hundreds."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def _same_user(sock: socket.socket) -> bool:
    """Whether the process at the other end of `sock` runs as this process's user."""
    _, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid == os.geteuid()


class _Reader:
    """Whole messages out of a byte stream (`read` what a socket has, non-blocking). A message
    larger than a read is received straight into a buffer of its own, whose data frames are
    handed out as views (no copy beyond the kernel's). A message is refused before anything of
    it is buffered when its header announces a body beyond `MAX_BODY_BYTES`, more than
    `MAX_DATA_FRAMES` data frames, a data frame beyond `max_frame` bytes (> 0) or data frames
    beyond `max_data` bytes in all."""

    def __init__(self, max_frame: int = -1, max_data: int = _MAX_DATA) -> None:
        self.buf = bytearray()  # the start of the stream not yet taken apart
        self.max_frame = max_frame
        self.max_data = max_data
        self.error: ProtocolError | None = None
        """Why the stream ended, when a message broke the limits (None: it closed or broke)."""
        self._big: mmap.mmap | None = None  # the message being received whole, after its header
        self._big_at = 0
        self._big_shape: tuple[int, int, list[int]] = (0, 0, [])

    def read(self, sock: socket.socket) -> tuple[list[list[Any]], bool]:
        """(the whole messages `sock` delivered, each [prefix, body, data frames...]; whether the
        stream ended: it closed, broke, or brought a message beyond the limits, `error`). At most
        `_READ_BUDGET` bytes are read per call: call again while the socket is readable. The
        messages that came before an end are returned all the same."""
        out: list[list[Any]] = []
        budget = _READ_BUDGET
        try:
            while budget > 0:
                if self._big is not None:
                    room = memoryview(self._big)[self._big_at : self._big_at + budget]
                    got = sock.recv_into(room, 0, socket.MSG_DONTWAIT)
                    if not got:
                        return out, True
                    budget -= got
                    self._big_at += got
                    if self._big_at == len(self._big):
                        out.append(_split(self._big, *self._big_shape))
                        self._big = None
                    continue
                chunk = sock.recv(min(_CHUNK, budget), socket.MSG_DONTWAIT)
                if not chunk:
                    return out, True
                budget -= len(chunk)
                self.buf += chunk
                self._take(out)
        except (BlockingIOError, InterruptedError):
            return out, False
        except ProtocolError as exc:
            self.error = exc
            return out, True
        except OSError as exc:
            log.debug("a local connection broke: %s", exc)
            return out, True
        return out, False

    def _take(self, out: list[list[Any]]) -> None:
        """Move the whole messages at the start of `buf` to `out`; start receiving a large one
        that has only begun into a buffer of its own.

        Raises:
            ProtocolError: the next message's header breaks the limits (those before it are in `out`).
        """
        buf = self.buf
        at = 0
        try:
            while len(buf) - at >= _HEAD.size:
                head, body, count = _HEAD.unpack_from(buf, at)
                if head + body > MAX_BODY_BYTES + 64:
                    raise ProtocolError(f"a local message of {head + body} bytes exceeds the limit")
                if count > MAX_DATA_FRAMES:
                    raise ProtocolError(f"{count} data frames exceed the limit of {MAX_DATA_FRAMES}")
                start = at + _HEAD.size + count * _LEN.size
                if len(buf) < start:
                    break
                sizes = [_LEN.unpack_from(buf, at + _HEAD.size + i * _LEN.size)[0] for i in range(count)]
                if self.max_frame > 0 and any(n > self.max_frame for n in sizes):
                    raise ProtocolError(f"a data frame exceeds the limit of {self.max_frame} bytes")
                if sum(sizes) > self.max_data:
                    raise ProtocolError(f"{sum(sizes)} bytes of data frames exceed the limit of {self.max_data}")
                size = _offsets(head, body, sizes)[-1]
                if len(buf) - start < size:
                    if size > _CHUNK:  # the rest straight into its own buffer (fresh pages: no zeroing pass)
                        self._big = _allocate(size)
                        have = len(buf) - start
                        self._big[:have] = buf[start:]
                        self._big_at, self._big_shape = have, (head, body, sizes)
                        at = len(buf)
                    break
                out.append(_split(buf[start : start + size], head, body, sizes))
                at = start + size
        finally:
            if at:
                del buf[:at]


def _allocate(size: int) -> mmap.mmap:
    """Fresh pages for one large message.

    Raises:
        ProtocolError: the host cannot give them (the message is refused as too large here).
    """
    try:
        return mmap.mmap(-1, size)
    except (OSError, OverflowError) as exc:
        raise ProtocolError(f"a local message of {size} bytes cannot be received here ({exc})") from None


def _offsets(head: int, body: int, sizes: list[int]) -> list[int]:
    """Where each data frame starts after the message's header (each `_ALIGN`ed), then its end."""
    at, out = head + body, []
    for n in sizes:
        at += -at % _ALIGN
        out.append(at)
        at += n
    out.append(at)
    return out


def _split(message: bytearray | mmap.mmap, head: int, body: int, sizes: list[int]) -> list[Any]:
    """[prefix, body, data frames...] of a message's bytes after its header (the data frames
    writable views of `message`)."""
    view = memoryview(message)
    frames: list[Any] = [bytes(view[:head]), bytes(view[head : head + body])]
    for at, n in zip(_offsets(head, body, sizes), sizes):
        frames.append(view[at : at + n])
    return frames


def _frame(frames: Sequence[Any]) -> list[memoryview]:
    """The buffers that carry one message, in order: its header, prefix, body and data frames
    shorter than `_COPY_BELOW` copied, longer data frames as views of the sender's memory. None
    is empty."""
    prefix, body, *data = frames
    views = [memoryview(f.buffer if hasattr(f, "buffer") else f).cast("B") for f in data]
    sizes = [v.nbytes for v in views]
    copied = bytearray(_HEAD.pack(len(prefix), len(body), len(views)))
    for n in sizes:
        copied += _LEN.pack(n)
    copied += prefix
    copied += body
    out: list[memoryview] = []
    at = len(prefix) + len(body)
    for start, view in zip(_offsets(len(prefix), len(body), sizes), views):
        copied += bytes(start - at)  # the padding that aligns the frame
        if view.nbytes < _COPY_BELOW:
            copied += view
        else:
            if copied:
                out.append(memoryview(copied))
            out.append(view)
            copied = bytearray()
        at = start + view.nbytes
    if copied:
        out.append(memoryview(copied))
    return out


def _send(sock: socket.socket, out: deque[memoryview]) -> int:
    """Send what `sock` takes now of the buffers in `out` (sent ones leave it, a partly sent one
    is cut to its rest); the bytes sent.

    Raises:
        OSError: the connection is gone.
    """
    total = 0
    while out:
        try:
            sent = sock.sendmsg(list(itertools.islice(out, 64)), [], socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            break
        total += sent
        while out and out[0].nbytes <= sent:  # an empty buffer leaves too: nothing of it is owed
            sent -= out.popleft().nbytes
        if sent:
            out[0] = out[0][sent:]
    return total


class _LanePeer:
    """One client connection a `Lane` accepted: its socket, the identity its requests are
    served under (as a ROUTER peer's), its reader, and the replies its socket has not taken yet."""

    __slots__ = ("sock", "identity", "reader", "out", "queued")

    def __init__(self, sock: socket.socket, identity: bytes, reader: _Reader):
        self.sock, self.identity, self.reader = sock, identity, reader
        self.out: deque[memoryview] = deque()  # replies not yet taken by the socket
        self.queued = 0  # their bytes


class Lane:
    """The listening side, driven by its service's thread or event loop: `accept` when the
    listener is readable, `receive` when a peer is, `send` a reply to a peer (what the socket
    does not take at once stays queued: `flush` when it is writable), `drop` a peer.
    `max_frame` (> 0) bounds each data frame received, as ZeroMQ's `MAXMSGSIZE` does, and the
    data frames of one message together (what one request may bring: no more than the service
    takes in one frame, a unit's arena); without it a message brings at most `MAX_BODY_BYTES` of
    data frames (such a service carries what it is sent in bodies)."""

    def __init__(self, max_frame: int = -1) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"sluice-rpc-{os.getpid()}-{secrets.token_hex(8)}"
        self.listener.bind("\0" + name)
        self.listener.listen(_BACKLOG)
        self.listener.setblocking(False)
        self.endpoint = _PREFIX + name
        self.max_frame = max_frame
        self.peers: dict[bytes, _LanePeer] = {}
        self.by_fd: dict[int, _LanePeer] = {}
        self.refused = 0
        self.failed = 0
        """Accepts that failed (no descriptor left, say)."""
        self.paused = False
        """Whether the last accept failed (`accept`): the service then stops watching the listener,
        which a waiting connection keeps readable (watched, it would wake the service without
        pause), and `resume`s it after `ACCEPT_RETRY` s, or once one of the lane's own peers
        leaves (a descriptor freed)."""
        self._ids = itertools.count(1)

    def accept(self) -> _LanePeer | None:
        """The next connection, if one is waiting and comes from this user (else it is closed).
        None also when none can be accepted now (out of descriptors, say): the lane is then
        `paused`, the connection waits in the backlog, and the service goes on serving the others."""
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return None  # an aborted connection is gone from the backlog: nothing waits for it
        except OSError as exc:
            self.failed += 1
            if self.failed == 1 or self.failed % 1000 == 0:
                log.warning(
                    "the local lane cannot accept a connection (%s; %d times); it tries again in %g s "
                    "or once one of its peers leaves, its clients wait meanwhile",
                    exc,
                    self.failed,
                    ACCEPT_RETRY,
                )
            self.paused = True
            return None
        if not _same_user(sock):
            self.refused += 1
            sock.close()
            return None
        sock.setblocking(False)
        _buffers(sock)
        reader = _Reader(self.max_frame, self.max_frame if self.max_frame > 0 else MAX_BODY_BYTES)
        # never a ROUTER identity (those are 5 bytes, the first zero): the two lanes share one table
        peer = _LanePeer(sock, b"local/%d" % next(self._ids), reader)
        self.peers[peer.identity] = peer
        self.by_fd[sock.fileno()] = peer
        return peer

    def receive(self, peer: _LanePeer) -> tuple[list[list[Any]], bool]:
        """(the whole messages `peer` sent in this wake, whether its connection then ended); the
        caller serves those messages, then `drop`s an ended peer and reports it gone (a notice
        sent just before closing still counts, as do the requests before a malformed message)."""
        messages, ended = peer.reader.read(peer.sock)
        if peer.reader.error is not None:
            log.warning(
                "local peer %r sent a malformed message (%s); closing its connection", peer.identity, peer.reader.error
            )
        return messages, ended

    def send(self, identity: bytes, frames: Sequence[Any]) -> _LanePeer | None:
        """Send a reply to `identity` (dropped if it is gone); the peer if part of it stays
        queued (`flush` it when its socket is writable), else None. A reply that finds more than
        `_QUEUED_MAX` bytes still queued for its peer cuts the peer off: it stopped reading."""
        peer = self.peers.get(identity)
        if peer is None:
            return None
        if peer.queued > _QUEUED_MAX:
            self.cut(peer)
            return None
        buffers = _frame(frames)
        peer.out.extend(buffers)
        peer.queued += sum(b.nbytes for b in buffers)
        return peer if self.flush(peer) else None

    def flush(self, peer: _LanePeer) -> bool:
        """Send what `peer`'s socket takes of its queued replies; whether some still wait."""
        try:
            peer.queued -= _send(peer.sock, peer.out)
        except OSError:
            peer.out.clear()  # closed: its end is read next
            peer.queued = 0
        return bool(peer.out)

    def cut(self, peer: _LanePeer) -> None:
        """End `peer`'s connection at once (it stopped reading its replies); its end is read next."""
        log.warning("local peer %r stopped reading its replies; closing its connection", peer.identity)
        peer.out.clear()
        peer.queued = 0
        try:
            peer.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def resume(self) -> None:
        """Accept again (the service watches the listener again, and calls `accept` at once)."""
        self.paused = False

    def drop(self, peer: _LanePeer) -> None:
        """Forget `peer` and close its socket (its connection ended; its service stops watching
        the socket first)."""
        self.peers.pop(peer.identity, None)
        self.by_fd.pop(peer.sock.fileno(), None)
        peer.sock.close()

    def close(self) -> None:
        """Close every peer's connection and the listener (the service stops)."""
        for peer in list(self.peers.values()):
            self.drop(peer)
        self.listener.close()


def _connect(endpoint: str, name: str, timeout: float | None, lost: type[SluiceError]) -> socket.socket:
    """A connected, non-blocking socket to the lane at `endpoint`, whose listener runs as this
    user. While the listener's backlog is full the connect waits (up to `timeout` s) for its
    service to accept, as a blocking Unix connect does; with `timeout` None it does not wait
    (an event loop's connect: the caller goes to ZeroMQ instead).

    Raises:
        SluiceError: (`lost`) it cannot be reached (gone, or no room in its backlog within
            `timeout`), or another user's process listens there.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _buffers(sock)
        if timeout is None:
            sock.setblocking(False)
            sock.connect(_address(endpoint))
        else:
            _connect_waiting(sock, _address(endpoint), time.monotonic() + timeout)
        if not _same_user(sock):
            raise PermissionError("its listener runs as another user")
    except OSError as exc:
        sock.close()
        raise lost(f"{name} cannot be reached: {exc} (gone?)") from None
    sock.setblocking(False)  # every read and write then waits in `poll` or the event loop
    return sock


def _connect_waiting(sock: socket.socket, address: str, deadline: float) -> None:
    """Connect `sock`, waiting until `deadline` for room in the listener's backlog: blocking,
    bounded by the send timeout (a non-blocking connect to a full backlog fails at once). A
    signal interrupts such a wait without connecting (Python then reports success): whether it
    connected is asked of the kernel (`getpeername`), and the connect is tried again meanwhile.

    Raises:
        OSError: it cannot connect (`TimeoutError`: no room in the backlog by `deadline`).
    """
    sock.settimeout(None)
    while True:
        seconds = max(deadline - time.monotonic(), 0.001)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        try:
            sock.connect(address)
        except InterruptedError:
            pass
        try:
            sock.getpeername()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError("no room in its backlog in time") from None


class _LocalLink(_Liveness):
    """One client connection to a lane, the implementation both channels share (`LocalChannel`
    waits on it in `poll`, `AsyncLocalChannel` in the event loop): it connects, frames and
    queues what is sent (`_put`; `_flush` what the socket did not take), reads what arrived
    (`_read`: each reply goes to `_arrived`) and ends (`_end`) once the connection closes,
    breaks or brings a malformed message. Replies that arrived before an end are kept.

    Raises:
        SluiceError: (`lost`) the lane cannot be reached within `connect_timeout` (None: at
            once, without waiting for room in its backlog), or another user's process listens there.
    """

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None,
        hint: str,
        timeout: float,
        connect_timeout: float | None,
        dead_after: float,
        lost: type[SluiceError],
        late: type[SluiceError],
    ):
        super().__init__(
            endpoint,
            replies,
            name=name,
            hint=hint,
            timeout=timeout,
            connect_timeout=0.0 if connect_timeout is None else connect_timeout,
            dead_after=dead_after,
            lost=lost,
            late=late,
        )
        self._reader = _Reader()
        self._out: deque[memoryview] = deque()
        self._end_error: tuple[type[SluiceError], str] | None = None
        self.sock = _connect(endpoint, self.name, connect_timeout, lost)
        _LINKS.add(self)

    @property
    def closed(self) -> bool:
        """Whether the connection ended (closed by either side, broken, or refused for a malformed message)."""
        return self._end_error is not None

    def _gone(self) -> SluiceError:
        """The error of a call that needs the ended connection."""
        assert self._end_error is not None
        kind, text = self._end_error
        return kind(text)

    def _put(self, msg: Message, data: Sequence[Any]) -> int:
        """Frame a request behind those queued and send what the socket takes; its id.

        Raises:
            SchemaError: `msg` cannot be encoded.
            ProtocolError: its body exceeds `MAX_BODY_BYTES` (refused here, with the error a
                service answers over ZeroMQ: its lane would end the connection for it).
            SluiceError: (`lost`) the connection ended.
        """
        if self._end_error is not None:
            raise self._gone()
        rid = next(self._ids)
        frames = self.codec.encode_now(rid, msg, data)
        if len(frames[1]) > MAX_BODY_BYTES:
            raise ProtocolError(f"message body of {len(frames[1])} bytes exceeds the limit of {MAX_BODY_BYTES}")
        self._out.extend(_frame(frames))
        self._flush()
        return rid

    def _flush(self) -> bool:
        """Send what the socket takes of the queue; whether some is left. A send that fails
        (the peer is gone) ends the connection, after the replies it sent before are taken: the
        socket is read until its reader reports the end (one read may complete no message when a
        reply is larger than its budget)."""
        try:
            _send(self.sock, self._out)
        except OSError as exc:
            self._out.clear()
            readable = select.poll()
            readable.register(self.sock, select.POLLIN)
            # a closed peer's socket stays readable (its end is read as one) until the reader ends it
            while self._end_error is None and readable.poll(0):
                self._read()
            self._end(self.lost, f"{self.name} dropped the connection ({exc}; gone?){self.hint}")
        return bool(self._out)

    def _read(self) -> bool:
        """Take what arrived (at most `_READ_BUDGET` bytes): replies to `_arrived`, then the
        end; whether any message came."""
        messages, ended = self._reader.read(self.sock)
        if messages:
            self._heard()
        for frames in messages:
            try:
                rid, msg, data = self.codec.decode(frames)
            except ProtocolError:
                log.warning("%s sent an undecodable reply", self.name)
                continue
            self._arrived(rid, msg, data)
        error = self._reader.error
        if error is not None:
            log.warning("%s sent a malformed message (%s); closing the connection", self.name, error)
            self._end(ProtocolError, f"{self.name} sent a malformed message ({error}); the connection was closed")
        elif ended:
            self._end(self.lost, f"{self.name} dropped the connection (gone?){self.hint}")
        return bool(messages)

    def _arrived(self, rid: int, msg: Any, data: list[Any]) -> None:
        raise NotImplementedError

    def _forked(self) -> None:
        """In a child forked while this link was open: the stream is its parent's (the two would
        take each other's replies), so the child's copy ends here: its descriptor is closed,
        nothing is shut down or unregistered (those would act on the parent's connection, and
        its event loop's registrations), and what uses it from now on raises `lost` (a driver
        opens a connection of its own)."""
        if self._end_error is None:
            self._end_error = (self.lost, f"the connection to {self.name} was made by the process that forked this one")
            self.dead = self.ended = True
            self._out.clear()
        self.sock.close()

    def _end(self, kind: type[SluiceError], text: str) -> None:
        """End the connection (once): what needs it from now on raises `kind(text)`."""
        if self._end_error is not None:
            return
        self._end_error = (kind, text)
        self.dead = self.ended = True
        self._out.clear()
        self.sock.close()
        _LINKS.discard(self)


_LINKS: weakref.WeakSet[_LocalLink] = weakref.WeakSet()
"""The open lane connections of this process, ended in a child it forks (`_forked`)."""


_LINGERING: set[socket.socket] = set()
"""The connections of closed channels still sending what they had queued (`_linger`), until
they are closed. A child this process forks closes them: it would keep the connection open past
the linger, and its service would wait for the child to go. Not the tasks sending them: a task is
its loop's (its ready queue, the timer and writer it waits on), so one left pending by a loop
closed without cancelling it is collected, and that closes its connection (`_linger`'s own
clean-up, or `_lingered` for a task that never began)."""


def _after_fork_in_child() -> None:
    for link in list(_LINKS):
        link._forked()
    _LINKS.clear()
    for sock in list(_LINGERING):
        sock.close()  # nothing else: the tasks and the loop's registrations are the parent's
    _LINGERING.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class LocalChannel(_LocalLink, SyncCalls):
    """A blocking request/reply channel to a service's local lane at `endpoint` (its
    `local_endpoint`), used from one thread: `Channel`'s calls (`send`, `post`, `reply`,
    `ready`, `call`, `cancel`, `forget`, `close`) over that socket. A peer that is gone or drops
    the connection raises `lost` once the replies it sent before are taken; one that stays
    silent (pings included) for `dead_after` s raises `lost` too (a hung process keeps its
    socket open); no answer in time raises `late`; a malformed message ends the connection
    with `ProtocolError`.

    Raises:
        SluiceError: (`lost`) the lane cannot be reached within `connect_timeout`, or another
            user's process listens there.
    """

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None = None,
        hint: str = "",
        timeout: float = GRACE,
        connect_timeout: float = 2.0,
        dead_after: float = DEAD_AFTER,
        lost: type[SluiceError] = ServiceError,
        late: type[SluiceError] = LateError,
    ):
        super().__init__(
            endpoint,
            replies,
            name=name,
            hint=hint,
            timeout=timeout,
            connect_timeout=connect_timeout,
            dead_after=dead_after,
            lost=lost,
            late=late,
        )
        self._stash: dict[int, tuple[Any, list[Any]]] = {}
        self._expected: set[int] = set()
        self._poller = select.poll()
        self._poller.register(self.sock, select.POLLIN)
        self._interrupt: int | None = None

    def interrupt_on(self, fd: int) -> None:
        """End a wait for a reply (raising `lost`) as soon as `fd` is readable (`Channel.interrupt_on`),
        and a wait for room in the socket (the message half sent ends the connection)."""
        self._interrupt = fd
        self._poller.register(fd, select.POLLIN)

    def _arrived(self, rid: int, msg: Any, data: list[Any]) -> None:
        if rid in self._expected:
            self._stash[rid] = (msg, data)

    def _write(self, msg: Message, data: Sequence[Any] = ()) -> int:
        rid = self._put(msg, data)
        if self._out:  # the socket is full: wait for it to take the rest
            writable = select.poll()
            writable.register(self.sock, select.POLLOUT)
            if self._interrupt is not None:
                writable.register(self._interrupt, select.POLLIN)
            deadline = time.monotonic() + self.timeout
            while self._flush():
                left = deadline - time.monotonic()
                if left <= 0:  # a message half sent: the stream is no longer framed, so it ends here
                    self._end(self.lost, f"a message to {self.name} was cut off half sent")
                    raise self.late(f"{self.name} took no message for {self.timeout:g} s")
                if any(fd == self._interrupt for fd, _ in writable.poll(int(left * 1000) + 1)):
                    self._end(self.lost, f"a message to {self.name} was cut off half sent: the client is closing")
                    raise self._gone()
        if self._end_error is not None:
            raise self._gone()
        return rid

    def send(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Send a request (with raw `data` frames); returns its id.

        Raises:
            SchemaError: `msg` cannot be encoded.
            SluiceError: (`lost`) the connection is gone; (`late`) the service took nothing for
                `timeout` s.
        """
        rid = self._write(msg, data)
        self._expected.add(rid)
        return rid

    def post(self, msg: Message, data: Sequence[Any] = ()) -> None:
        """Send a notice: a request nobody awaits an answer to (its answer is dropped). Raises as `send`."""
        self._write(msg, data)

    def _wait(self, wait: float | None) -> bool:
        """Read what arrives within `wait` s (None: until something does); whether anything did."""
        if self._end_error is not None:
            return False
        # rounded up, so that a wait never ends early, except a wait of 0 (`ready`'s look)
        ready = self._poller.poll(None if wait is None else int(wait * 1000) + 1 if wait > 0 else 0)
        if not ready:
            return False
        if any(fd == self._interrupt for fd, _ in ready):
            raise self.lost(f"the wait for {self.name} was interrupted: the client is closing")
        self._read()
        return True

    def reply(
        self, rid: int, wait: float | None = GRACE, since: float | None = None, what: str = "a request"
    ) -> tuple[Any, list[Any]]:
        """The (message, data frames) answering `rid`, awaited since `since` (default: now) for
        at most `wait` s (None: as long as the peer is alive).

        Raises:
            SluiceError: (`late`) no answer within `wait`; (`lost`) the peer dropped the
                connection (before answering) or is silent for `dead_after` s.
            ProtocolError: the peer sent a malformed message (the connection ended).
        """
        since = time.monotonic() if since is None else since
        deadline = self._deadline(since, wait)
        while rid not in self._stash:
            if self._end_error is not None:
                self._expected.discard(rid)
                raise self._gone()
            ping, left = self._step(since, deadline, what)
            if ping:
                self._write(Ping())  # its Ok is not expected: dropped on arrival, heard all the same
            self._wait(left)
        self._expected.discard(rid)
        return self._stash.pop(rid)

    def ready(self, rid: int | None = None, wait: float = 0.0) -> int | None:
        """The id of an arrived, untaken reply (to `rid` if given; else the oldest), waiting up
        to `wait` s for one; None if none came (an ended connection is `reply`'s to report)."""
        deadline = time.monotonic() + wait
        while True:
            if rid in self._stash or (rid is None and self._stash):
                return rid if rid is not None else next(iter(self._stash))
            if not self._wait(max(deadline - time.monotonic(), 0.0)):
                return None

    def close(self) -> None:
        """Close the connection (what was sent before is still delivered; the service then
        sees it closed)."""
        self._end(self.lost, f"the channel to {self.name} was closed")


class AsyncLocalChannel(_LocalLink, AsyncCalls):
    """`LocalChannel` for asyncio (`AsyncChannel`'s calls): the event loop reads the socket and
    resolves the future of whichever request a reply answers, so any number of coroutines may
    share it; what the socket does not take at once is written when it is writable, in order.
    Replies nobody awaits (to `post`ed requests) go to `on_reply`. Raises as `LocalChannel`
    (an ended channel fails what still waits); the connect never waits for room in the lane's
    backlog (it would stall the loop): a full backlog raises `lost` at once, and the caller
    goes to ZeroMQ.

    Raises:
        RuntimeError: no event loop runs in this thread.
    """

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None = None,
        hint: str = "",
        timeout: float = GRACE,
        dead_after: float = DEAD_AFTER,
        lost: type[SluiceError] = ServiceError,
        late: type[SluiceError] = LateError,
        on_reply: Callable[[Any], None] | None = None,
    ):
        self._loop = asyncio.get_running_loop()  # first: without a loop no socket is opened
        super().__init__(
            endpoint,
            replies,
            name=name,
            hint=hint,
            timeout=timeout,
            connect_timeout=None,
            dead_after=dead_after,
            lost=lost,
            late=late,
        )
        self._on_reply = on_reply
        self._waiting: dict[int, asyncio.Future] = {}
        self._fd = self.sock.fileno()
        self._loop.add_reader(self._fd, self._read)

    def _arrived(self, rid: int, msg: Any, data: list[Any]) -> None:
        fut = self._waiting.get(rid)  # removed by whoever awaits it
        if fut is not None and not fut.done():
            fut.set_result((msg, data))
        elif self._on_reply is not None:
            self._on_reply(msg)

    def _end(self, kind: type[SluiceError], text: str) -> None:
        if self._end_error is not None:
            return
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        super()._end(kind, text)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(self._gone())
                fut.exception()  # retrieved: whoever still awaits it gets it, nobody else is warned

    def _write(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Frame and send a request (see `_put`); what the socket does not take now is written by
        the loop when it is writable (`_drain`), in order. Its id; raises as `_put`."""
        rid = self._put(msg, data)
        if self._out:
            self._loop.add_writer(self._fd, self._drain)
        return rid

    def _drain(self) -> None:
        """Send what the socket takes of the queue now it is writable; stop watching it once empty."""
        if not self._flush():
            self._loop.remove_writer(self._fd)

    async def send(self, msg: Message, data: Sequence[Any] = ()) -> int:
        """Send a request; returns its id (see `LocalChannel.send`)."""
        rid = self._write(msg, data)
        if self.closed:  # its peer went as it was sent
            raise self._gone()
        self._waiting[rid] = self._loop.create_future()
        return rid

    def post(self, msg: Message, data: Sequence[Any] = ()) -> None:
        """Send a notice whose reply nobody awaits, without blocking (queued in order while the
        socket is full); an ended channel drops it: its peer is gone."""
        if not self.closed:
            self._write(msg, data)

    async def _ping(self) -> None:
        self._write(Ping())  # queued in order while the socket is full

    def close(self) -> None:
        """Close the connection; requests still awaiting replies fail with `lost` at once. What
        was sent and the socket has not taken yet (it was full: posted notices, say) still goes
        as the socket takes it, for up to `timeout` s, as a ZeroMQ channel's socket lingers
        (`_linger`, a task of the loop); the connection then closes. A loop that stops first
        closes it then (`asyncio.run` cancels the task); a child forked meanwhile closes its copy
        at once, so the service sees the peer gone when the linger ends. Closed while its loop
        is not running, it sends only what the socket takes at once: a task would wait for the
        loop to run again, perhaps never (and be destroyed pending)."""
        if self._out and self._end_error is None:
            if self._loop.is_running():
                sock = self.sock.dup()
                _LINGERING.add(sock)
                task = self._loop.create_task(_linger(self._loop, sock, self._out, self.timeout))
                weakref.finalize(task, _lingered, sock)  # one that never began runs no clean-up
            else:
                with contextlib.suppress(OSError):  # the peer is gone
                    _send(self.sock, self._out)
            self._out = deque()
        self._end(self.lost, f"the channel to {self.name} was closed")


async def _linger(loop: asyncio.AbstractEventLoop, sock: socket.socket, out: deque[memoryview], seconds: float) -> None:
    """Send the buffers in `out` on `sock` (a closed channel's connection) as it takes them, until
    all are sent, the peer is gone, or `seconds` have passed, then close it. A loop that stops
    first (`asyncio.run` cancels the tasks left) ends it as well, after a last send of what the
    socket takes at once; so does a loop closed with the task still pending, once the task is
    collected (its coroutine is closed)."""
    fd = sock.fileno()
    deadline = loop.time() + seconds
    try:
        while True:
            _send(sock, out)
            left = deadline - loop.time()
            if not out or left <= 0:
                return
            writable = loop.create_future()
            loop.add_writer(fd, _resolve, writable)
            try:
                await asyncio.wait([writable], timeout=left)
            finally:
                loop.remove_writer(fd)
    except OSError:
        pass  # the peer is gone
    except asyncio.CancelledError:  # the loop stops: what the socket takes now still goes
        try:
            _send(sock, out)
        except OSError:
            pass
        raise
    finally:
        _lingered(sock)


def _lingered(sock: socket.socket) -> None:
    """The linger of `sock` ended, or its task is gone (even one that never began): close `sock`."""
    _LINGERING.discard(sock)
    sock.close()


def _resolve(fut: asyncio.Future) -> None:
    """Resolve `fut` (to None) unless it is already: a readiness callback may fire again before its waiter runs."""
    if not fut.done():
        fut.set_result(None)
