"""The asyncio client: drives the same `ClientCore` flows with `zmq.asyncio` sockets.

Each socket has one reader task that resolves the future of the request whose id a reply
carries, so any number of coroutines may share one client. A cancelled call is withdrawn at
the service (`Cancel`), and a lease or grant it won meanwhile is given back.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, AsyncIterator, Sequence

import zmq
import zmq.asyncio

from ._auth import Credentials, secure_client
from ._client_core import DEAD_AFTER, PROBE_AFTER, Call, ClientCore, Flow, wrap_flows
from ._errors import ClosedError, ProtocolError, SluiceError, TimeoutError
from ._messages import Cancel, Ok, Ping
from ._meta import BatchMeta

__all__ = ["AsyncClient", "connect_async"]


class AsyncClient(ClientCore):
    """Asyncio Sluice client; create with `await tq.connect_async(address)`."""

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        super().__init__(address, use_shm, credentials)
        self._ctx = zmq.asyncio.Context.instance()
        self._socks: dict[str, zmq.asyncio.Socket] = {}
        self._readers: dict[str, asyncio.Task] = {}
        self._waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._closed = False

    # -- driver ------------------------------------------------------------------------

    def _sock(self, target: int) -> zmq.asyncio.Socket:
        address = self.target_address(target)
        sock = self._socks.get(address)
        if sock is None:
            sock = self._socks[address] = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, int(DEAD_AFTER * 1000))  # no connection (refused, down): never block
            if self.credentials is not None:
                secure_client(sock, self.credentials)
            sock.connect(address)
            self._readers[address] = asyncio.ensure_future(self._read(address, sock))
        return sock

    async def _read(self, address: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self.heard(address, time.monotonic())
            try:
                rid, msg, data = self.codec.decode(frames)
            except ProtocolError:
                continue
            fut = self._waiting.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((msg, data))

    async def _call(self, call: Call) -> tuple[Any, list[Any]]:
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        try:
            await self._sock(call.target).send_multipart(self.codec.encode(rid, call.msg, call.data), copy=False)
        except zmq.Again:
            self._waiting.pop(rid, None)
            raise self.unreachable(call.target) from None
        try:
            return await self._wait(call, fut, time.monotonic())
        except BaseException:
            if not isinstance(call.msg, Cancel):
                await self._withdraw(call, rid, fut)
            self._waiting.pop(rid, None)
            raise

    async def _wait(self, call: Call, fut: asyncio.Future, since: float) -> tuple[Any, list[Any]]:
        """The reply, pinging the service while it stays silent (`ServiceError` once it is silent
        for `DEAD_AFTER` s); `TimeoutError` after `call.wait` seconds."""
        deadline = None if call.wait is None else since + call.wait
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{self.service_name(call.target)} did not answer {type(call.msg).__name__} "
                    f"within {call.wait:g}s; is the cluster still running?"
                )
            if self.probe(call.target, since, now):
                ping_id = next(self._ids)  # its Ok finds no future and is dropped; hearing it is enough
                try:
                    await self._sock(call.target).send_multipart(self.codec.encode(ping_id, Ping()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection: the silence tells
            left = PROBE_AFTER if deadline is None else min(PROBE_AFTER, deadline - now)
            done, _ = await asyncio.wait({fut}, timeout=left)
            if done:
                return fut.result()

    async def _withdraw(self, call: Call, rid: int, fut: asyncio.Future) -> None:
        """Cancel `rid` at the service (unless it was reported dead); give back what its reply
        holds if it was already sent."""
        if self._closed or (not fut.done() and self.target_address(call.target) in self.dead):
            return
        try:
            await self._call(Call(call.target, Cancel(rid)))
            if fut.done():
                undo = self.undo(fut.result()[0])
                if undo is not None:
                    self.check((await self._call(Call(call.target, undo)))[0], Ok)
        except SluiceError:  # that service is gone; its own timers free what it held
            pass

    async def _run(self, flow: Flow) -> Any:
        """Drive `flow`; a failed, timed-out or cancelled step is withdrawn at every service it
        reached, then thrown into the flow so that its clean-up runs before the error propagates."""
        if self._closed:
            raise ClosedError("this client was closed; connect a new one")
        replies, error = None, None
        while True:
            try:
                calls = self.resume(flow, replies, error)
            except StopIteration as stop:
                return stop.value
            tasks = [asyncio.ensure_future(self._call(c)) for c in calls]
            try:
                replies, error = list(await asyncio.gather(*tasks)), None
            except BaseException as exc:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each withdraws its call
                replies, error = None, exc

    # -- iteration helpers -------------------------------------------------------------

    async def stream(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str = "train",
        *,
        timeout: float | None = None,
        **get_meta_options: Any,
    ) -> AsyncIterator[tuple[Any, BatchMeta]]:
        """Yield `(batch, meta)` until the sealed partition is drained, prefetching the next
        micro-batch (metadata and data) while you work on the current one. Taking the next
        batch acks the previous; leaving early nacks what is in hand."""
        wait = 1e9 if timeout is None else timeout

        async def fetch() -> tuple[Any, BatchMeta]:
            meta = await self.get_meta(fields, batch_size, task, partition, timeout=wait, **get_meta_options)
            if not len(meta):
                return None, meta
            try:
                return await self.get_data(meta), meta
            except BaseException:
                await self.nack(meta)
                raise

        nxt = asyncio.ensure_future(fetch())
        meta = None
        try:
            while True:
                batch, meta = await nxt
                if not len(meta):
                    meta = None
                    return
                nxt = asyncio.ensure_future(fetch())
                yield batch, meta
                await self.ack(meta)
                meta = None
        finally:
            if not nxt.done():
                nxt.cancel()
            elif not nxt.cancelled() and nxt.exception() is None and len(nxt.result()[1]) and nxt.result()[1] is not meta:
                await self.nack(nxt.result()[1])
            if meta is not None:
                await self.nack(meta)

    async def versions(self, timeout: float = 1e9, after: int | None = None) -> AsyncIterator[int]:
        """Every version the trainer sets after `after`, in order, none skipped. The default is
        the version when iteration starts (an async generator runs nothing before its first
        step): pass `after` to miss nothing set in between."""
        if after is None:
            after = await self.get_version()
        while True:
            for version in await self._versions_after(after, timeout):
                yield version
                after = version

    # -- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Close sockets and unmap arenas; the client cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for task in self._readers.values():
            task.cancel()
        for sock in self._socks.values():
            sock.close(linger=0)
        self._socks.clear()
        self.close_arenas()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _async(fn):
    async def method(self, *args, **kwargs):
        return await self._run(fn(self, *args, **kwargs))

    return method


wrap_flows(AsyncClient, _async)


async def connect_async(address: str, use_shm: bool | None = None, credentials: Credentials | None = None) -> AsyncClient:
    """Connect an `AsyncClient` to the cluster whose controller listens at `address` (with
    `credentials`, default `SLUICE_CREDENTIALS`, when it is bound beyond loopback)."""
    client = AsyncClient(address, use_shm, credentials)
    await client.hello()
    return client
