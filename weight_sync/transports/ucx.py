"""`ucx`: UCX through ucxx. RDMA verbs on InfiniBand/RoCE; tcp here.

Speaks the same stream protocol as `tcp` (a request, a status header, then each read's bytes
in `read_chunks` pieces, one UCX tagged message per piece, received straight into the
subscriber's buffer). An optional extra (`pip install sluice-rl[ucx]`); `is_available()` is
False without it.

What makes it fast (measured against `ucx_perftest` in `benchmarks/weight_sync.py`):

- The receiver posts the receives of every piece before the first arrives, and UCX sends
  every piece eagerly (`UCX_OPTIONS`): pieces stream back to back into receives already
  waiting, with no rendezvous round trip per piece and nothing buffered as unexpected.
- The publisher keeps up to `stream.IN_FLIGHT` (16) sends posted per subscriber, so UCX goes from
  one piece straight to the next instead of idling while Python learns of each completion.
- A publisher deals its subscribers round one UCX worker per core (`_Runtime.worker`): one
  worker's single progress thread does all of its endpoints' tcp copies, which capped two
  subscribers at one pair's rate in total.
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
import contextlib
import importlib.util
import logging
import os
import threading
from collections import deque
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.wire.rpc import Credentials

from ..layout import numel
from ..protocol import Pull, RelayPull
from . import handshake
from .base import Job, Source, Transport, register
from .stream import (
    IN_FLIGHT,
    STATUS,
    decode_request,
    encode_request,
    raise_status,
    read_chunks,
    status_header,
)

__all__ = ["UcxTransport"]

log = logging.getLogger(__name__)

DEFAULT_TLS = "tcp,sm,self"
"""`UCX_TLS` when the environment sets none."""
UCX_OPTIONS = {"RNDV_THRESH": "inf"}
"""UCX settings of the context this module initialises (`UCX_<name>` in the environment wins).
Eager sends for every size: each piece streams at once instead of waiting for a rendezvous
round trip, and lands in its receive, posted in advance."""

MAX_WORKERS = 8
"""Most UCX workers a process spreads its subscribers' endpoints over (one per core below)."""

_STATUS_TAG = 1
"""Tag of a reply's status header (and error text): apart from the pieces, whose receives the
subscriber posts before the status arrives."""
_AUTH_TAG = 2
"""Tag of the handshake's three messages, before any request."""
_MOVE_TAG = 3
"""Tag of the message after the handshake: the port of the listener (of another worker) the
subscriber is to connect to instead, or 0 to stay."""


class _Runtime:
    """The process's ucxx event loop thread and UCX workers, shared by every `UcxTransport` that
    is open.

    ucxx completes each request as a future of the loop its context was created on, so the
    transports share one loop. The first transport to use it starts it and initialises ucxx (its
    progress thread drives UCX, its notifier thread completes each request's asyncio future:
    ucxx's default instead has every pending request poll on the loop, a busy core for as long as
    a publisher waits for its subscribers' next request); the last to close resets ucxx and ends
    the threads. A process that initialised ucxx itself keeps its settings and its ucxx.

    One UCX worker moves one endpoint's bytes at a time on one progress thread, so a publisher
    serving several subscribers spreads them over `worker(1..)`: more contexts of this process,
    each with its own worker, progress and notifier threads, made on first need (only where this
    runtime owns ucxx) and ended with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._users = 0
        self._owned = False
        """Whether this runtime initialised ucxx (and so resets it)."""
        self._extra: list[Any] = []
        """The contexts `worker(1..)` made, on this runtime's loop."""

    @property
    def workers(self) -> int:
        """How many workers `worker` spreads endpoints over: one per core, at most `MAX_WORKERS`
        (one, ucxx's own, in a process that initialised ucxx itself)."""
        return min(MAX_WORKERS, os.cpu_count() or 1) if self._owned else 1

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
            assert self._thread is not None  # started with the loop
            self._thread.join(timeout=5)
            loop.close()

    def worker(self, index: int) -> Any:
        """The ucxx context of worker `index` (0: ucxx's own), made on first use; call on the loop."""
        from ucxx import core

        if index == 0 or index >= self.workers:
            return core._get_ctx()
        while len(self._extra) < index:
            from ucxx._lib_async.application_context import ApplicationContext
            from ucxx._lib_async.continuous_ucx_progress import ThreadMode

            options = {k: os.environ.get(f"UCX_{k}", v) for k, v in UCX_OPTIONS.items()}
            ctx = ApplicationContext(options, progress_mode="thread", enable_python_future=True)
            # ucxx starts one progress thread per event loop, ucxx's own worker's here: start this one's
            ThreadMode(ctx.worker, asyncio.get_running_loop())
            ctx.worker.populate_python_futures_pool()  # before its notifier thread first does
            self._extra.append(ctx)
        return self._extra[index - 1]

    @staticmethod
    async def _init() -> bool:
        import ucxx
        from ucxx import core

        if core._ctx is not None:  # ucxx offers no "is initialised" query
            return False
        ucxx.init(UCX_OPTIONS, env_takes_precedence=True, progress_mode="thread", enable_python_future=True)
        return True

    async def _reset(self) -> None:
        import ucxx

        for ctx in self._extra:  # their listeners and endpoints closed with their transports
            ctx.stop_notifier_thread()
            ctx.worker.stop_progress_thread()
        self._extra.clear()
        try:
            ucxx.reset()
        except Exception as exc:  # noqa: BLE001 - an endpoint still referenced somewhere keeps ucxx alive
            log.warning("ucxx kept running after the last ucx transport closed: %s", exc)


_runtime = _Runtime()


@register
class UcxTransport(Transport):
    """Pull over ucxx; per publisher rank one listener per UCX worker it serves from (subscribers
    arrive at the first, the endpoint, and are moved to the others in turn), one endpoint per peer.

    `credentials` default to `SLUICE_CREDENTIALS`; with them every endpoint is authenticated both
    ways before its first request (`handshake.py`; refusals counted in `auth_refused`), and
    without them serving on a host beyond loopback raises `SchemaError`. UCX's listener takes
    connections on every interface, so give a publisher that other machines can reach credentials."""

    name = "ucx"
    mode = "reads"  # no relaying (fanout None): every subscriber pulls from the rank
    deltas = True

    def __init__(self, host: str = "127.0.0.1", credentials: Credentials | None = None):
        self.host = host
        self._key = handshake.key_of(credentials)
        self.auth_refused = 0
        self._listeners: dict[int, Any] = {}
        """Per worker index, its listener (worker 0's port is the endpoint subscribers are told)."""
        self._routed = 0
        """Subscribers dealt round the workers so far."""
        self._source: Source | None = None
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
        self._source = source
        return f"{self.host}:{self._run(self._listen(0))}"

    async def _listen(self, worker: int) -> int:
        """The port of worker `worker`'s listener, started on first need."""
        if worker not in self._listeners:

            def accept(ep: Any) -> None:
                task = asyncio.ensure_future(self._serve_ep(ep, worker))
                self._handlers.add(task)
                task.add_done_callback(self._handlers.discard)

            ctx = _runtime.worker(worker)
            self._listeners[worker] = ctx.create_listener(accept, port=0, endpoint_error_handling=True)
        return self._listeners[worker].port

    async def _route(self, ep: Any, worker: int) -> bool:
        """Tell an admitted subscriber where to pull from; True if it stays on this endpoint.
        Subscribers arrive at worker 0's listener (the endpoint) and are dealt round the workers
        in turn, each but worker 0's told the port of that worker's listener."""
        port = 0
        if worker == 0:
            dealt = self._routed % _runtime.workers
            self._routed += 1
            if dealt:
                port = await self._listen(dealt)
        await ep.send(np.array([port], dtype=np.uint32), tag=_MOVE_TAG)
        if port:  # closing first could drop the message: the subscriber hangs up once it has it
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ep.recv(np.empty(1, dtype=np.uint8), tag=_MOVE_TAG), handshake.TIMEOUT)
        return not port

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

    async def _serve_ep(self, ep: Any, worker: int) -> None:
        source = self._source
        assert source is not None  # endpoints connect only once `serve` listens
        try:
            try:
                admitted = await self._greet(ep)
            except Exception:  # noqa: BLE001 - a peer that broke off the handshake (or timed out)
                admitted = False
            if not admitted:
                self.auth_refused += 1
                return
            if not await self._route(ep, worker):
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
                    await self._send_views(ep, views)
                    ok = True
                finally:
                    done(ok)
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a closed or broken endpoint ends the handler
            pass
        finally:
            if not ep.closed:
                await ep.close()

    async def _send_views(self, ep: Any, views: Iterator[memoryview]) -> None:
        """Send each view as one message, keeping up to `IN_FLIGHT` sends posted (as many as the
        `Source` keeps valid): the worker goes from one piece straight to the next instead of
        idling while this loop learns of a completion and takes the next view."""
        loop = asyncio.get_running_loop()
        posted: deque[asyncio.Future] = deque()
        try:
            while (view := await loop.run_in_executor(self._sources, next, views, None)) is not None:
                posted.append(asyncio.ensure_future(ep.send(np.frombuffer(view, dtype=np.uint8))))
                if len(posted) == IN_FLIGHT:  # the next view taken may reuse the oldest's memory
                    await posted.popleft()
            while posted:
                await posted.popleft()
        finally:  # a failed send: the others end with the endpoint, closed by the handler
            for send in posted:
                send.cancel()
            await asyncio.gather(*posted, return_exceptions=True)

    @staticmethod
    async def _send_status(ep: Any, exc: BaseException | None) -> None:
        header = status_header(exc)
        await ep.send(np.frombuffer(header[: STATUS.size], dtype=np.uint8), tag=_STATUS_TAG)
        if len(header) > STATUS.size:
            await ep.send(np.frombuffer(header[STATUS.size :], dtype=np.uint8), tag=_STATUS_TAG)

    # -- receiving -----------------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        grant = job.grant
        assert grant is not None  # a subscriber leases the slot before a "reads" transport reads it
        if grant.source:
            raise WeightSyncError("ucx does not relay")
        request = Pull(grant.lease, job.version, job.reads, job.base)
        if job.base < 0:
            return self._run(self._pull(job, request))
        try:
            ep = self._run(self._request_frames(job, request))
            into = job.receive_delta(
                lambda view: self._run(_bounded(ep.recv(np.frombuffer(view, dtype=np.uint8)), job))
            )
        except WeightSyncError:
            self._run(self._drop(job.endpoint))
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
            self._run(self._drop(job.endpoint))
            raise WeightSyncError(f"ucx delta transfer from {job.endpoint} failed: {exc}") from exc
        return into

    async def _request_frames(self, job: Job, request: Pull) -> Any:
        """Send a delta `request` and receive its status (raising the error the publisher
        reported, if any); the endpoint, whose next messages are the frames, a header then its
        payload each (`stream.delta_frames`). They are received one at a time, since each
        header gives the next payload's size."""
        ep = await self._send_request(job, request)
        await _status(ep, job)
        return ep

    async def _send_request(self, job: Job, request: Pull | RelayPull) -> Any:
        """Send `request` on the endpoint to `job`'s publisher rank (connected on first use);
        returns the endpoint."""
        ep = self._peers.get(job.endpoint)
        if ep is None or ep.closed:
            ep = self._peers[job.endpoint] = await self._connect(job)
        body = encode_request(request)
        await _bounded(ep.send(np.array([len(body)], dtype=np.uint64)), job)
        await _bounded(ep.send(np.frombuffer(body, dtype=np.uint8)), job)
        return ep

    async def _pull(self, job: Job, request: Pull | RelayPull) -> torch.Tensor:
        try:
            ep = await self._send_request(job, request)
            into = job.buffer()
            await self._receive_pieces(ep, job, into.numpy())
            return into
        except WeightSyncError:
            await self._drop(job.endpoint)
            raise
        except Exception as exc:  # noqa: BLE001 - ucxx raises its own hierarchy
            await self._drop(job.endpoint)
            raise WeightSyncError(f"ucx transfer from {job.endpoint} failed: {exc}") from exc

    async def _connect(self, job: Job) -> Any:
        """An authenticated endpoint to the worker the publisher rank routes this subscriber to:
        its endpoint's listener, or the one whose port that listener answers with."""
        import ucxx

        host, port = job.endpoint.rsplit(":", 1)
        for _ in range(2):  # the endpoint, then at most the worker it moves this subscriber to
            ep = await _bounded(ucxx.create_endpoint(host, int(port), endpoint_error_handling=True), job)
            try:
                await self._join(ep, job)
                moved = np.empty(1, dtype=np.uint32)
                await _bounded(ep.recv(moved, tag=_MOVE_TAG), job)
            except BaseException:
                await ep.close()
                raise
            if not moved[0]:
                return ep
            await ep.close()
            port = str(moved[0])
        raise WeightSyncError(f"{job.endpoint} moved this subscriber on twice (not a Sluice ucx endpoint?)")

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
            await _status(ep, job)
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
            for listener in self._listeners.values():
                listener.close()
            self._listeners.clear()

        self._run(shutdown())
        self._loop = None
        if self._sources is not None:
            self._sources.shutdown(wait=False, cancel_futures=True)
            self._sources = None
        _runtime.release()


async def _status(ep: Any, job: Job) -> None:
    """Receive the publisher's status header for a request; raise the error it reports, if any."""
    head = np.empty(STATUS.size, dtype=np.uint8)
    await _bounded(ep.recv(head, tag=_STATUS_TAG), job)
    failed, length = STATUS.unpack(head.tobytes())
    if failed:
        text = np.empty(length, dtype=np.uint8)
        await _bounded(ep.recv(text, tag=_STATUS_TAG), job)
        raise_status(text.tobytes())


async def _bounded(step: Coroutine | asyncio.Future, job: Job) -> Any:
    """One UCX step (connect, send, receive), bounded by the job's timeout: a publisher killed
    mid-transfer does not always fail a pending UCX operation, which would then wait forever."""
    try:
        return await asyncio.wait_for(step, job.timeout)
    except asyncio.TimeoutError:
        raise WeightSyncError(
            f"no progress with {job.endpoint} for {job.timeout:g} s (the publisher died or hangs)"
        ) from None
