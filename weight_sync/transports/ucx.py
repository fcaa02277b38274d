"""`ucx`: UCX through ucxx. RDMA verbs on InfiniBand/RoCE; tcp or shared memory here.

Speaks the same stream protocol as `tcp` (a request, a status header, then each read's bytes
in `read_chunks` pieces, one UCX message per piece, received straight into the subscriber's
buffer). ucxx is asyncio-based, so each transport runs one event loop in a thread of its own
and the blocking subscriber side hands coroutines to it. An optional extra
(`pip install sluice-rl[ucx]`); `is_available()` is False without it. UCX needs `tcp` among
`UCX_TLS` when no RDMA device exists; the default set here is `tcp,sm,self` unless the
environment says otherwise. Endpoint error handling stays on, so a dead peer fails a
transfer instead of hanging it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from collections.abc import Coroutine
from typing import Any

import numpy as np
import torch

from transfer_queue import SluiceError, WeightSyncError

from ..protocol import Pull, RelayPull
from .base import Job, Source, Transport, register
from .stream import STATUS, decode_request, encode_request, raise_status, read_chunks, status_header

__all__ = ["UcxTransport"]


@register
class UcxTransport(Transport):
    """Pull over ucxx; one listener per publisher rank, one endpoint per peer."""

    name = "ucx"
    mode = "reads"  # no relaying (fanout None): every subscriber pulls from the rank

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener: Any = None
        self._peers: dict[str, Any] = {}
        self._handlers: set[asyncio.Task] = set()

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("ucxx") is not None

    def _run(self, coro: Coroutine) -> Any:
        """Run `coro` on this transport's loop thread and wait for its result."""
        if self._loop is None:
            os.environ.setdefault("UCX_TLS", "tcp,sm,self")
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-ws-ucx", daemon=True)
            self._thread.start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- serving -------------------------------------------------------------------------

    def serve(self, source: Source) -> str:
        async def listen() -> int:
            import ucxx

            def accept(ep: Any) -> None:
                task = asyncio.ensure_future(self._serve_ep(ep, source))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)

            self._listener = ucxx.create_listener(accept, port=0)
            return self._listener.port

        return f"{self.host}:{self._run(listen())}"

    async def _serve_ep(self, ep: Any, source: Source) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                head = np.empty(1, dtype=np.uint64)
                await ep.recv(head)
                body = np.empty(int(head[0]), dtype=np.uint8)
                await ep.recv(body)
                try:
                    views, done = source.open(decode_request(body.tobytes()))
                except SluiceError as exc:
                    await self._send_status(ep, exc)
                    continue
                ok = False
                try:
                    await self._send_status(ep, None)
                    while (view := await loop.run_in_executor(None, next, views, None)) is not None:
                        await ep.send(np.frombuffer(view, dtype=np.uint8))
                    ok = True
                finally:
                    done(ok)
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a closed or broken endpoint ends the handler
            pass
        finally:
            if not ep.closed:
                await ep.close()

    @staticmethod
    async def _send_status(ep: Any, exc: BaseException | None) -> None:
        header = status_header(exc)
        await ep.send(np.frombuffer(header[: STATUS.size], dtype=np.uint8))
        if len(header) > STATUS.size:
            await ep.send(np.frombuffer(header[STATUS.size :], dtype=np.uint8))

    # -- receiving -----------------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        if job.grant.source:
            raise WeightSyncError("ucx does not relay")
        return self._run(self._pull(job, Pull(job.grant.lease, job.version, job.reads)))

    async def _pull(self, job: Job, request: Pull | RelayPull) -> torch.Tensor:
        import ucxx

        try:
            ep = self._peers.get(job.endpoint)
            if ep is None or ep.closed:
                host, port = job.endpoint.rsplit(":", 1)
                ep = self._peers[job.endpoint] = await _bounded(ucxx.create_endpoint(host, int(port)), job)
            body = encode_request(request)
            await _bounded(ep.send(np.array([len(body)], dtype=np.uint64)), job)
            await _bounded(ep.send(np.frombuffer(body, dtype=np.uint8)), job)
            head = np.empty(STATUS.size, dtype=np.uint8)
            await _bounded(ep.recv(head), job)
            failed, length = STATUS.unpack(head.tobytes())
            if failed:
                text = np.empty(length, dtype=np.uint8)
                await _bounded(ep.recv(text), job)
                raise_status(text.tobytes())
            into = job.into(job.offsets[-1] + job.reads[-1].nbytes if job.reads else 0)
            buf = into.numpy()
            for read, offset in zip(job.reads, job.offsets):
                position = offset
                for lo, hi in read_chunks(read):
                    n = int(np.prod([h - l for l, h in zip(lo, hi)], dtype=np.int64)) * read.itemsize
                    await _bounded(ep.recv(buf[position : position + n]), job)
                    position += n
                job.progress(offset + read.nbytes)
            return into
        except WeightSyncError:
            await self._drop(job.endpoint)
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
            await self._drop(job.endpoint)
            raise WeightSyncError(f"ucx transfer from {job.endpoint} failed: {exc}") from exc

    async def _drop(self, endpoint: str) -> None:
        ep = self._peers.pop(endpoint, None)
        if ep is not None and not ep.closed:
            await ep.close()

    def close(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for endpoint in list(self._peers):
                await self._drop(endpoint)
            for task in list(self._handlers):
                task.cancel()
            if self._listener is not None:
                self._listener.close()

        self._run(shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
        self._loop = None


async def _bounded(step: Coroutine, job: Job) -> Any:
    """One UCX step (connect, send, receive), bounded by the job's timeout: a publisher killed
    mid-transfer does not always fail a pending UCX operation, which would then wait forever."""
    try:
        return await asyncio.wait_for(step, job.timeout)
    except asyncio.TimeoutError:
        raise WeightSyncError(
            f"no progress with {job.endpoint} for {job.timeout:g} s (the publisher died or hangs)"
        ) from None
