"""The weight channel's control plane: messages, a request/reply client and a server loop.

Every publisher rank runs one `RpcServer` (a ZeroMQ ROUTER in a thread of the trainer
process). Rank 0 is the coordinator: it knows when a version is complete on every rank, records
it in the controller, and answers `Latest`. Subscribers ask each rank for a `Lease` on a
version (which pins its staging slot) and `Release` it when they have read it; tensor bytes
never travel here (see `transports/`). One tagged union of frozen msgspec structs, framed by
`transfer_queue._wire.Codec`; nothing is ever pickled.

Requests, and what answers them::

    Join(info)                       rank r -> coordinator: here are my endpoints      Ok
    Staged(rank, version, complete)  rank r -> coordinator: I started / finished v     Ok
    Latest(after, complete, timeout) newest version > after (parked until one exists)  Offer
    Confirm(version, timeout)        wait until `version` is complete on every rank    Ok
    Lease(version, ...)              pin the slot holding `version` on this rank       Granted
    Release(lease)                   done reading                                      Ok
    Describe(manifest)               the manifest with this id                         Described
    Verify(lease, reads)             checksums of these boxes of the staged snapshot   Checksums
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Union

import msgspec
import zmq

from transfer_queue._errors import ProtocolError, SluiceError, TimeoutError, WeightSyncError, error_code, error_from_code
from transfer_queue.rpc import Codec

from .manifest import Manifest
from .plan import Read

__all__ = [
    "RankInfo",
    "SlotInfo",
    "Join",
    "Staged",
    "Latest",
    "Confirm",
    "Lease",
    "Release",
    "Describe",
    "Verify",
    "Ok",
    "Failed",
    "Offer",
    "Granted",
    "Described",
    "Checksums",
    "Pull",
    "RelayPull",
    "RpcClient",
    "RpcServer",
    "Request",
]

log = logging.getLogger("sluice.weight_sync")


class RankInfo(msgspec.Struct, frozen=True):
    """Where one publisher rank (or a relaying subscriber) can be reached."""

    rank: int
    world_size: int
    host: str
    """Host identity (hostname and boot id): equal hosts may share memory."""
    control: str
    """ZeroMQ endpoint of the rank's `RpcServer`."""
    data: dict[str, str] = {}
    """Transport name -> endpoint of that transport's data server."""


class SlotInfo(msgspec.Struct, frozen=True):
    """A staging slot: co-located readers map `path` (empty when not shareable)."""

    index: int
    generation: int
    size: int
    path: str = ""


class _Msg(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


class Join(_Msg, tag="join"):
    info: RankInfo


class Staged(_Msg, tag="staged"):
    rank: int
    version: int
    complete: bool


class Latest(_Msg, tag="latest"):
    """The newest version above `after`: only complete ones, or also one being staged."""

    after: int
    complete: bool = True
    timeout: float = 0.0


class Confirm(_Msg, tag="confirm"):
    version: int
    timeout: float = 30.0


class Lease(_Msg, tag="lease"):
    """Pin `version`'s slot (waiting up to `timeout` for this rank to start staging it).
    `transport`, `plan`, `relay`: the transport the subscriber pulls with, the digest of its
    reads and the endpoint where it re-serves them (relay trees); `direct` refuses a relay."""

    version: int
    transport: str = ""
    plan: int = 0
    relay: str = ""
    direct: bool = False
    timeout: float = 30.0


class Release(_Msg, tag="release"):
    lease: int


class Describe(_Msg, tag="describe"):
    manifest: int


class Verify(_Msg, tag="verify"):
    lease: int
    reads: list[Read]


Request = Union[Join, Staged, Latest, Confirm, Lease, Release, Describe, Verify]


class Ok(_Msg, tag="ok"):
    pass


class Failed(_Msg, tag="failed"):
    code: str
    message: str


class Offer(_Msg, tag="offer"):
    version: int
    complete: bool
    ranks: list[RankInfo]


class Granted(_Msg, tag="granted"):
    """`source`: pull from this relay endpoint instead of the rank ("" = the rank itself)."""

    lease: int
    version: int
    manifest: int
    slot: SlotInfo
    source: str = ""


class Described(_Msg, tag="described"):
    manifest: Manifest


class Checksums(_Msg, tag="checksums"):
    """xxh3-64 of each requested box; `corrupt`: staged tensors that changed since staging."""

    values: list[int]
    corrupt: list[str] = []


Reply = Union[Ok, Failed, Offer, Granted, Described, Checksums]

# -- data plane (stream transports): one request, then the reads' bytes back to back --------


class _Data(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


class Pull(_Data, tag="pull"):
    """Send these reads of the slot pinned by `lease`, each as its box's contiguous bytes."""

    lease: int
    version: int
    reads: list[Read]


class RelayPull(_Data, tag="relay"):
    """Send what you pulled of `version` from `rank`, for a plan with this digest."""

    version: int
    rank: int
    plan: int


DataRequest = Union[Pull, RelayPull]
DATA_DECODER = msgspec.msgpack.Decoder(DataRequest)
DATA_ENCODER = msgspec.msgpack.Encoder()

REQUEST_CODEC = Codec(Request)
REPLY_CODEC = Codec(Reply)


def failed(exc: BaseException) -> Failed:
    """The reply that carries `exc` (typed errors keep their class across the wire)."""
    return Failed(error_code(exc), str(exc))


class RpcClient:
    """A DEALER socket to one `RpcServer`, used from one thread.

    `call` sends a request and waits for its reply; a `Failed` reply is raised as the Sluice
    error it names. A peer that is not reachable, drops the connection while a call waits
    (watched through a socket monitor, so a killed publisher is noticed at once) or does not
    answer in time raises `WeightSyncError`.
    """

    def __init__(self, endpoint: str, timeout: float = 10.0, connect_timeout: float = 2.0):
        self.endpoint = endpoint
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # refuse to queue for a peer that is not connected
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count(1)

    def call(self, msg: msgspec.Struct, timeout: float | None = None) -> Any:
        """Send `msg` and return the reply; waits at most `timeout` (default: the client's)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        rid = next(self._ids)
        while self._monitor.poll(0):
            self._monitor.recv_multipart()  # disconnects before this call are history
        if not self._sock.poll(max(0, min(deadline - time.monotonic(), self.connect_timeout)) * 1000, zmq.POLLOUT):
            raise WeightSyncError(f"publisher at {self.endpoint} is not reachable (gone, or not started)")
        self._sock.send_multipart(REQUEST_CODEC.encode(rid, msg), copy=False)
        while True:
            left = deadline - time.monotonic()
            ready = dict(self._poller.poll(left * 1000)) if left > 0 else {}
            if self._monitor in ready:
                raise WeightSyncError(f"the publisher at {self.endpoint} dropped the connection (gone?)")
            if self._sock not in ready:
                raise WeightSyncError(f"no reply from the publisher at {self.endpoint} within the timeout (gone?)")
            got, reply, _ = REPLY_CODEC.decode(self._sock.recv_multipart())
            if got != rid:
                continue  # the late answer to a call that already timed out
            if isinstance(reply, Failed):
                raise error_from_code(reply.code, reply.message)
            return reply

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)


class Pending:
    """A request being served: answer it once with `reply` (from the server thread only)."""

    __slots__ = ("_server", "_identity", "_rid", "done")

    def __init__(self, server: RpcServer, identity: bytes, rid: int):
        self._server, self._identity, self._rid = server, identity, rid
        self.done = False

    def reply(self, msg: msgspec.Struct) -> None:
        if self.done:
            return
        self.done = True
        self._server.send(self._identity, self._rid, msg)


Handler = Callable[[Any, Pending], None]


class RpcServer:
    """A ROUTER socket served by one thread.

    `handler(msg, pending)` runs in the server thread and either answers at once or keeps
    `pending` to answer later (`park` bounds the wait: the request fails with `TimeoutError`
    at its deadline). Other threads hand work to the server thread with `submit`, which wakes
    the loop through a pipe; nothing here polls on a timer.
    """

    def __init__(self, handler: Handler, bind: str = "tcp://127.0.0.1:*"):
        self._handler = handler
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._calls: deque[Callable[[], None]] = deque()
        self._parked: list[tuple[float, int, Pending, str]] = []
        self._seq = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sluice-ws-rpc", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run `fn()` in the server thread soon."""
        self._calls.append(fn)
        os.write(self._wake_w, b"x")

    def park(self, pending: Pending, timeout: float, what: str) -> None:
        """Keep `pending` for up to `timeout` seconds, then fail it with `TimeoutError(what)`."""
        heapq.heappush(self._parked, (time.monotonic() + timeout, next(self._seq), pending, what))

    def send(self, identity: bytes, rid: int, msg: msgspec.Struct) -> None:
        try:
            self._sock.send_multipart([identity, *REPLY_CODEC.encode(rid, msg)], copy=False)
        except zmq.ZMQError:
            log.debug("reply to a vanished subscriber dropped")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed:
                timeout = None
                if self._parked:
                    timeout = max(0.0, (self._parked[0][0] - time.monotonic()) * 1000)
                poller.poll(timeout)
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
                while self._calls:
                    self._calls.popleft()()
                while self._sock.poll(0, zmq.POLLIN):
                    self._serve(self._sock.recv_multipart(copy=False))
                self._expire()
        finally:
            self._sock.close(linger=0)

    def _serve(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        rid = 0
        try:
            rid, msg, _ = REQUEST_CODEC.decode(frames[1:])
        except ProtocolError as exc:
            self.send(identity, rid, failed(exc))
            return
        pending = Pending(self, identity, rid)
        try:
            self._handler(msg, pending)
        except SluiceError as exc:
            pending.reply(failed(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here must not kill the loop
            log.exception("weight-sync handler failed")
            pending.reply(Failed("service", f"{type(exc).__name__}: {exc}"))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._parked and (self._parked[0][2].done or self._parked[0][0] <= now):
            _, _, pending, what = heapq.heappop(self._parked)
            pending.reply(failed(TimeoutError(what)))
