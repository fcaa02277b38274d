"""`ucx`: UCX through ucxx. RDMA verbs on InfiniBand/RoCE; tcp here.

Speaks the same stream protocol as `tcp` (a request, a status header, then each read's bytes
in `read_chunks` pieces, one UCX tagged message per piece, received straight into the
subscriber's buffer). An optional extra (`pip install sluice-rl[ucx]`); `is_available()` is
False without it.

What makes it fast (measured against `ucx_perftest` in `benchmarks/weight_sync.py`):

- The receiver posts the receives of every piece before the first arrives, and UCX sends
  every piece eagerly (`UCX_OPTIONS`): pieces stream back to back into receives already
  waiting, with no rendezvous round trip per piece and nothing buffered as unexpected.
- Requests complete as asyncio futures (ucxx's progress thread plus its notifier thread, one
  event loop thread per process for all transports) instead of ucxx's default of polling every
  pending request on the loop: no core spins while a transfer waits for its peer or while a
  publisher waits for its subscribers' next request.

Endpoint error handling stays on, so a dead peer fails a transfer instead of hanging it (and
every step is bounded by the job's timeout besides). UCX then uses only transports that can
detect a dead peer: `tcp` and RDMA, never its shared-memory ones (`posix`, `sysv`, `cma` are
"unreachable" with error handling; same-host subscribers have the `shm` transport). UCX needs
`tcp` among `UCX_TLS` when no RDMA device exists; the default set here is `tcp,sm,self` unless
the environment says otherwise.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import threading
from collections import deque
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.rpc import Credentials

from ..layout import numel
from ..protocol import Pull, RelayPull
from . import handshake
from .base import Job, Source, Transport, register
from .stream import STATUS, decode_request, encode_request, raise_status, read_chunks, status_header

__all__ = ["UcxTransport"]

log = logging.getLogger(__name__)

DEFAULT_TLS = "tcp,sm,self"
"""`UCX_TLS` when the environment sets none."""
UCX_OPTIONS = {"RNDV_THRESH": "inf"}
"""UCX settings of the context this module initialises (`UCX_<name>` in the environment wins).
Eager sends for every size: each piece streams at once instead of waiting for a rendezvous
round trip, and lands in its receive, posted in advance (1.5x the throughput over tcp)."""

_STATUS_TAG = 1
"""Tag of a reply's status header (and error text): apart from the pieces, whose receives the
subscriber posts before the status arrives."""
_AUTH_TAG = 2
"""Tag of the handshake's three messages, before any request."""


class _Runtime:
    """The process's ucxx event loop thread, shared by every `UcxTransport` that is open.

    ucxx has one context and worker per process, whose requests complete as futures of the
    loop it was initialised on; so the transports share one loop. The first transport to use
    it starts it and initialises ucxx (its progress thread drives UCX, its notifier thread
    completes each request's asyncio future: ucxx's default instead has every pending request
    poll on the loop, a busy core for as long as a publisher waits for its subscribers' next
    request); the last to close resets ucxx and ends the threads. A process that initialised
    ucxx itself keeps its settings and its ucxx."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        self._owned = False
        """Whether this runtime initialised ucxx (and so resets it)."""

    def acquire(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                os.environ.setdefault("UCX_TLS", DEFAULT_TLS)
                os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-ws-ucx", daemon=True)
                self._thread.start()
                self._owned = asyncio.run_coroutine_threadsafe(self._init(), self._loop).result()
            self._users += 1
            return self._loop

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users or self._loop is None:
                return
            loop, self._loop = self._loop, None
            if self._owned:
                asyncio.run_coroutine_threadsafe(self._reset(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=5)
            loop.close()

    @staticmethod
    async def _init() -> bool:
        import ucxx
        from ucxx import core

        if core._ctx is not None:  # ucxx offers no "is initialised" query
            return False
        ucxx.init(UCX_OPTIONS, env_takes_precedence=True, progress_mode="thread", enable_python_future=True)
        return True

    @staticmethod
    async def _reset() -> None:
        import ucxx

        try:
            ucxx.reset()
        except Exception as exc:  # noqa: BLE001 - an endpoint still referenced somewhere keeps ucxx alive
            log.warning("ucxx kept running after the last ucx transport closed: %s", exc)


_runtime = _Runtime()


@register
class UcxTransport(Transport):
    """Pull over ucxx; one listener per publisher rank, one endpoint per peer.

    `credentials` default to `SLUICE_CREDENTIALS`; with them every endpoint is authenticated both
    ways before its first request (`handshake.py`; refusals counted in `auth_refused`), and
    without them serving on a host beyond loopback raises `SchemaError`. UCX's listener takes
    connections on every interface, so give a publisher that other machines can reach credentials."""

    name = "ucx"
    mode = "reads"  # no relaying (fanout None): every subscriber pulls from the rank

    def __init__(self, host: str = "127.0.0.1", credentials: Credentials | None = None):
        self.host = host
        self._key = handshake.key_of(credentials)
        self.auth_refused = 0
        self._listener: Any = None
        self._peers: dict[str, Any] = {}
        self._handlers: set[asyncio.Task] = set()
        self._sources: ThreadPoolExecutor | None = None
        """Takes views from a `Source` (they may wait for staging) off the loop."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The process's ucxx loop, while this transport holds it."""

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("ucxx") is not None

    def _run(self, coro: Coroutine) -> Any:
        """Run `coro` on the process's ucxx loop (taken on first use) and wait for its result."""
        if self._loop is None:
            self._loop = _runtime.acquire()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- serving -------------------------------------------------------------------------

    def serve(self, source: Source) -> str:
        handshake.check_serve(self._key, self.host)
        self._sources = ThreadPoolExecutor(thread_name_prefix="sluice-ws-ucx-source")

        async def listen() -> int:
            import ucxx

            def accept(ep: Any) -> None:
                task = asyncio.ensure_future(self._serve_ep(ep, source))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)

            self._listener = ucxx.create_listener(accept, port=0, endpoint_error_handling=True)
            return self._listener.port

        return f"{self.host}:{self._run(listen())}"

    async def _greet(self, ep: Any) -> bool:
        """Server side of the handshake; False if the peer failed it."""
        server = handshake.Server(self._key)
        await ep.send(np.frombuffer(server.greeting(), dtype=np.uint8), tag=_AUTH_TAG)
        if not server.required:
            return True
        answer = np.empty(handshake.ANSWER_BYTES, dtype=np.uint8)
        await asyncio.wait_for(ep.recv(answer, tag=_AUTH_TAG), handshake.TIMEOUT)
        proof = server.check(answer.tobytes())
        if proof is None:
            return False
        await ep.send(np.frombuffer(proof, dtype=np.uint8), tag=_AUTH_TAG)
        return True

    async def _serve_ep(self, ep: Any, source: Source) -> None:
        loop = asyncio.get_running_loop()
        try:
            try:
                admitted = await self._greet(ep)
            except Exception:  # noqa: BLE001 - a peer that broke off the handshake (or timed out)
                admitted = False
            if not admitted:
                self.auth_refused += 1
                return
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
                    # each view is valid until the next is taken: send one, then take the next
                    while (view := await loop.run_in_executor(self._sources, next, views, None)) is not None:
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
        await ep.send(np.frombuffer(header[: STATUS.size], dtype=np.uint8), tag=_STATUS_TAG)
        if len(header) > STATUS.size:
            await ep.send(np.frombuffer(header[STATUS.size :], dtype=np.uint8), tag=_STATUS_TAG)

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
                ep = self._peers[job.endpoint] = await _bounded(
                    ucxx.create_endpoint(host, int(port), endpoint_error_handling=True), job
                )
                await self._join(ep, job)
            body = encode_request(request)
            await _bounded(ep.send(np.array([len(body)], dtype=np.uint64)), job)
            await _bounded(ep.send(np.frombuffer(body, dtype=np.uint8)), job)
            into = job.into(job.offsets[-1] + job.reads[-1].nbytes if job.reads else 0)
            await self._receive_pieces(ep, job, into.numpy())
            return into
        except WeightSyncError:
            await self._drop(job.endpoint)
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
            await self._drop(job.endpoint)
            raise WeightSyncError(f"ucx transfer from {job.endpoint} failed: {exc}") from exc

    async def _join(self, ep: Any, job: Job) -> None:
        """Client side of the handshake; `WeightSyncError` saying why it failed."""
        client = handshake.Client(self._key, job.endpoint, "ucx")
        greeting = np.empty(handshake.GREETING_BYTES, dtype=np.uint8)
        await _bounded(ep.recv(greeting, tag=_AUTH_TAG), job)
        answer = client.answer(greeting.tobytes())
        if answer is None:
            return
        await _bounded(ep.send(np.frombuffer(answer, dtype=np.uint8), tag=_AUTH_TAG), job)
        proof = np.empty(handshake.PROOF_BYTES, dtype=np.uint8)
        try:
            await _bounded(ep.recv(proof, tag=_AUTH_TAG), job)
        except Exception:  # noqa: BLE001 - the server hangs up on a wrong proof
            raise client.refused() from None
        client.verify(proof.tobytes())

    @staticmethod
    async def _receive_pieces(ep: Any, job: Job, buf: np.ndarray) -> None:
        """Receive the reply's status, then every read's `read_chunks` pieces into `buf`, all
        receives posted at once (tagged messages match receives in posting order), reporting
        each read as it lands. Raises the error the publisher reported, if any."""
        pieces: list[tuple[int, int, int | None]] = []  # (start, end) in buf, bytes complete once in
        for read, offset in zip(job.reads, job.offsets):
            position = offset
            for lo, hi in read_chunks(read):
                n = numel(lo, hi) * read.itemsize
                pieces.append((position, position + n, None))
                position += n
            pieces[-1] = (*pieces[-1][:2], offset + read.nbytes)
        pending: deque[tuple[asyncio.Task, int | None]] = deque()

        async def landed() -> None:
            task, complete = pending.popleft()
            await _bounded(task, job)
            if complete is not None:
                job.progress(complete)

        try:
            for start, end, complete in pieces:  # posted before the status: no piece arrives unexpected
                pending.append((asyncio.ensure_future(ep.recv(buf[start:end])), complete))
            head = np.empty(STATUS.size, dtype=np.uint8)
            await _bounded(ep.recv(head, tag=_STATUS_TAG), job)
            failed, length = STATUS.unpack(head.tobytes())
            if failed:
                text = np.empty(length, dtype=np.uint8)
                await _bounded(ep.recv(text, tag=_STATUS_TAG), job)
                raise_status(text.tobytes())
            while pending:
                await landed()
        finally:  # a failed transfer: its receives end with the endpoint, dropped next
            for task, _ in pending:
                task.cancel()
            await asyncio.gather(*(task for task, _ in pending), return_exceptions=True)

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
            handlers = list(self._handlers)
            for task in handlers:
                task.cancel()
            await asyncio.gather(*handlers, return_exceptions=True)  # their endpoints closed
            if self._listener is not None:
                self._listener.close()
                self._listener = None

        self._run(shutdown())
        self._loop = None
        if self._sources is not None:
            self._sources.shutdown(wait=False, cancel_futures=True)
            self._sources = None
        _runtime.release()


async def _bounded(step: Coroutine | asyncio.Future, job: Job) -> Any:
    """One UCX step (connect, send, receive), bounded by the job's timeout: a publisher killed
    mid-transfer does not always fail a pending UCX operation, which would then wait forever."""
    try:
        return await asyncio.wait_for(step, job.timeout)
    except asyncio.TimeoutError:
        raise WeightSyncError(
            f"no progress with {job.endpoint} for {job.timeout:g} s (the publisher died or hangs)"
        ) from None
