"""The blocking client: drives `ClientCore` flows with plain ZeroMQ DEALER sockets.

One DEALER per service (controller, each storage unit), replies matched to requests by id, so a
request may stay in flight (e.g. the next `get_meta` of a stream) while another completes.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterator, Sequence

import zmq

from ._auth import Credentials, secure_client
from ._client_core import DEAD_AFTER, PROBE_AFTER, Call, ClientCore, Flow, wrap_flows
from ._errors import ClosedError, SluiceError, TimeoutError
from ._messages import Cancel, Ok, Ping
from ._meta import BatchMeta

__all__ = ["Client"]


class _Pending:
    """A flow whose current calls are on the wire."""

    def __init__(self, flow: Flow, calls: list[Call] | None, ids: list[int], result: Any = None, sent: float = 0.0):
        self.flow, self.calls, self.ids, self.result, self.sent = flow, calls, ids, result, sent


class Client(ClientCore):
    """Blocking Sluice client. Use `tq.connect(address)`; close it (or use `with`) when done."""

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        super().__init__(address, use_shm, credentials)
        self._ctx = zmq.Context.instance()
        self._socks: dict[str, zmq.Socket] = {}
        self._ids = itertools.count(1)
        self._stash: dict[int, tuple[Any, list[Any]]] = {}
        self._pings: set[int] = set()  # ids of liveness pings whose Ok is dropped on arrival
        self._closed = False
        self.hello()

    # -- driver ------------------------------------------------------------------------

    def _sock(self, target: int) -> zmq.Socket:
        address = self.target_address(target)
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(DEAD_AFTER * 1000))  # no connection (refused, down): never block
            if self.credentials is not None:
                secure_client(sock, self.credentials)
            sock.connect(address)
        return sock

    def _start(self, flow: Flow, replies: list | None = None, error: BaseException | None = None) -> _Pending:
        if self._closed:
            raise ClosedError("this client was closed; connect a new one")
        try:
            calls = self.resume(flow, replies, error)
        except StopIteration as stop:
            return _Pending(flow, None, [], stop.value)
        ids = []
        for call in calls:
            rid = next(self._ids)
            self._send(call.target, self.codec.encode(rid, call.msg, call.data))
            ids.append(rid)
        return _Pending(flow, calls, ids, sent=time.monotonic())

    def _send(self, target: int, frames: list[Any], flags: int = 0) -> None:
        try:
            self._sock(target).send_multipart(frames, flags, copy=False)
        except zmq.Again:
            if not flags:
                raise self.unreachable(target) from None

    def _finish(self, pending: _Pending) -> Any:
        while pending.calls is not None:
            try:
                replies = [self._recv(call, rid, pending.sent) for call, rid in zip(pending.calls, pending.ids)]
            except BaseException as exc:  # a timeout, a dead service, Ctrl-C: let the flow clean up
                self._abandon(pending, close=False)
                pending = self._start(pending.flow, error=exc)
                continue
            pending = self._start(pending.flow, replies)
        return pending.result

    def _run(self, flow: Flow) -> Any:
        return self._finish(self._start(flow))

    def _abandon(self, pending: _Pending, close: bool = True) -> None:
        """Withdraw calls still in flight (skipping services reported dead); give back anything
        they were granted meanwhile; with `close`, end the flow too."""
        if pending.calls is not None and not self._closed:
            for call, rid in zip(pending.calls, pending.ids):
                if rid not in self._stash and self.target_address(call.target) in self.dead:
                    continue
                try:
                    cancel_id = next(self._ids)
                    self._send(call.target, self.codec.encode(cancel_id, Cancel(rid)))
                    self._recv(Call(call.target, Cancel(rid)), cancel_id, time.monotonic())
                    reply, _ = self._stash.pop(rid, (None, None))
                    undo = self.undo(reply)
                    if undo is not None:
                        self._run(self._one(call.target, undo, Ok))
                except SluiceError:  # that service is gone; its own timers free what it held
                    self._stash.pop(rid, None)
        if close:
            pending.flow.close()

    def _recv(self, call: Call, rid: int, since: float) -> tuple[Any, list[Any]]:
        """The reply to `rid`, pinging the service when it stays silent (`ServiceError` once it
        is silent for `DEAD_AFTER` s); `TimeoutError` after `call.wait` seconds."""
        sock = self._sock(call.target)
        address = self.target_address(call.target)
        deadline = None if call.wait is None else since + call.wait
        while rid not in self._stash:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{self.service_name(call.target)} did not answer {type(call.msg).__name__} "
                    f"within {call.wait:g}s; is the cluster still running?"
                )
            if self.probe(call.target, since, now):
                ping_id = next(self._ids)
                self._pings.add(ping_id)
                self._send(call.target, self.codec.encode(ping_id, Ping()), zmq.NOBLOCK)  # never waits
            left = PROBE_AFTER if deadline is None else min(PROBE_AFTER, deadline - now)
            if sock.poll(int(left * 1000) + 1):
                got, msg, data = self.codec.decode(sock.recv_multipart(copy=False))
                self.heard(address, time.monotonic())
                if got in self._pings:
                    self._pings.discard(got)
                else:
                    self._stash[got] = (msg, data)
        return self._stash.pop(rid)

    # -- iteration helpers -------------------------------------------------------------

    def stream(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str = "train",
        *,
        timeout: float | None = None,
        **get_meta_options: Any,
    ) -> Iterator[tuple[Any, BatchMeta]]:
        """Yield `(batch, meta)` micro-batches until the sealed partition is drained.

        Taking the next batch acks the previous one. While you work on a batch, the request for
        the next is already waiting at the controller. Leaving the loop early nacks the batch in
        hand (ack it yourself first if you finished it). `timeout=None` waits indefinitely.
        """
        wait = 1e9 if timeout is None else timeout

        def request() -> _Pending:
            return self._start(self.get_meta.__wrapped__(self, fields, batch_size, task, partition, timeout=wait, **get_meta_options))

        pending = request()
        meta = None
        try:
            while True:
                meta = self._finish(pending)
                pending = None
                if not len(meta):
                    meta = None
                    return
                pending = request()
                batch = self.get_data(meta)
                yield batch, meta
                self.ack(meta)
                meta = None
        finally:
            if pending is not None:
                self._abandon(pending)
            if meta is not None:
                self.nack(meta)

    def versions(self, timeout: float = 1e9, after: int | None = None) -> Iterator[int]:
        """Every version the trainer sets after `after` (default: the version at this call), in
        order, none skipped. Each wait for the next one raises `TimeoutError` after `timeout`."""
        start = self.get_version() if after is None else after
        return self._follow_versions(start, timeout)

    def _follow_versions(self, after: int, timeout: float) -> Iterator[int]:
        while True:
            for version in self._versions_after(after, timeout):
                yield version
                after = version

    @property
    def version(self) -> int:
        return self.get_version()

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close sockets and unmap arenas; the client cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self.close_arenas()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _sync(fn):
    def method(self, *args, **kwargs):
        return self._run(fn(self, *args, **kwargs))

    return method


wrap_flows(Client, _sync)
