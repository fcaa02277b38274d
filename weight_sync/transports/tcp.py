"""`tcp`: raw TCP sockets, received straight into the subscriber's preallocated buffer.

The publisher rank serves its slots from a thread per connection: each read leaves as a view
of the slot (`sendall`, no copy) or, when strided, gathered through a bounded scratch buffer.
The subscriber keeps one connection per peer and `recv_into`s the bytes where its plan put
them. With several subscribers on the same plan the publisher points later ones at earlier
ones (`fanout` direct children per node: 1 makes a chain, 2 a binary tree), and each relays
bytes as they arrive, so the trainer's link carries every byte `fanout` times, not once per
subscriber. Sockets bind to 127.0.0.1 unless told otherwise.

Every connection opens with the handshake of `handshake.py`: the server's greeting (magic,
whether it requires credentials, a nonce). With the cluster's credentials (`SLUICE_CREDENTIALS`, the same CurveZMQ credentials
the services use, or `credentials=`) a server admits only peers that prove they hold them, and
proves it holds them too: an HMAC-SHA256 challenge-response over both nonces, keyed by the
cluster's client secret, so neither the trainer's weights nor a subscriber's buffer is open to
anyone who reaches the port. Failed handshakes are refused and counted (`auth_refused`).
Binding beyond loopback without credentials is refused. The bytes themselves are not encrypted.
"""

from __future__ import annotations

import socket
import threading

import torch

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.wire.rpc import Credentials

from ..protocol import Pull, RelayPull
from . import handshake
from .base import Job, Source, Transport, memory_device, register
from .stream import STATUS, Landing, as_bytes, decode_request, encode_request, raise_status, status_header

__all__ = ["TcpTransport"]

_SOCKET_BUFFER = 4 << 20
_PROGRESS_STEP = 8 << 20
"""Report received bytes (to relays waiting on them) at least this often."""


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def _greet(conn: socket.socket, key: bytes | None) -> bool:
    """Server side of the handshake; False if the peer failed it."""
    server = handshake.Server(key)
    conn.sendall(server.greeting())
    if not server.required:
        return True
    conn.settimeout(handshake.TIMEOUT)
    answer = bytearray(handshake.ANSWER_BYTES)
    _recv_exact(conn, memoryview(answer))
    proof = server.check(bytes(answer))
    if proof is None:
        return False
    conn.sendall(proof)
    conn.settimeout(None)
    return True


def _join(sock: socket.socket, key: bytes | None, endpoint: str) -> None:
    """Client side of the handshake; `WeightSyncError` saying why it failed."""
    client = handshake.Client(key, endpoint, "tcp")
    greeting = bytearray(handshake.GREETING_BYTES)
    _recv_exact(sock, memoryview(greeting))
    answer = client.answer(bytes(greeting))
    if answer is None:
        return
    sock.sendall(answer)
    proof = bytearray(handshake.PROOF_BYTES)
    try:
        _recv_exact(sock, memoryview(proof))
    except WeightSyncError:
        raise client.refused() from None
    client.verify(bytes(proof))


def _recv_exact(sock: socket.socket, view: memoryview, progress=None, base: int = 0) -> None:
    """Fill `view` from `sock`; `progress(base + n)` every `_PROGRESS_STEP` bytes."""
    got, reported = 0, 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WeightSyncError("the sender closed the stream early (publisher or relay gone, or version abandoned)")
        got += n
        if progress is not None and got - reported >= _PROGRESS_STEP:
            progress(base + got)
            reported = got


@register
class TcpTransport(Transport):
    """Raw sockets; `fanout` children per node in the relay tree (None: no relaying).

    `credentials` default to `SLUICE_CREDENTIALS`; with them every connection is authenticated
    both ways, and without them serving beyond loopback raises `SchemaError`.

    `memory` is where a subscriber's receive buffers live: "host" (the default), or a CUDA
    device ("cuda", "cuda:N") for a subscriber whose tensors are there. Bytes then land in
    pinned buffers and are copied to the GPU as they arrive (`stream.Landing`), a delta's
    frames are applied on the GPU (only their payloads cross), and `poll` applies the version
    device to device. Such a subscriber does not relay (relays forward from host memory).
    A publisher's staging stays in host memory either way.

    Raises:
        SchemaError: `memory` is neither "host" nor a CUDA device this process sees.
    """

    name = "tcp"
    mode = "reads"
    deltas = True

    def __init__(
        self,
        host: str = "127.0.0.1",
        fanout: int | None = 2,
        credentials: Credentials | None = None,
        memory: str | torch.device = "host",
    ):
        self.host = host
        self.fanout = fanout
        self.receive_device = memory_device("TcpTransport", memory)
        self._landing = Landing(self.receive_device) if self.receive_device is not None else None
        self._key = handshake.key_of(credentials)
        self.auth_refused = 0
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._peers: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- serving -------------------------------------------------------------------------

    def serve(self, source: Source) -> str:
        handshake.check_serve(self._key, self.host)
        listener = self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, 0))
        listener.listen(64)
        self._spawn(self._accept, listener, source)
        host, port = listener.getsockname()
        return f"{host}:{port}"

    def _spawn(self, target, *args) -> None:  # noqa: ANN001
        thread = threading.Thread(target=target, args=args, name="sluice-ws-tcp", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept(self, listener: socket.socket, source: Source) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            _tune(conn)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            self._spawn(self._serve_conn, conn, source)

    def _serve_conn(self, conn: socket.socket, source: Source) -> None:
        try:
            try:
                admitted = _greet(conn, self._key)
            except (OSError, WeightSyncError):
                admitted = False
            if not admitted:
                with self._lock:
                    self.auth_refused += 1
                return
            while True:
                head = bytearray(4)
                try:
                    _recv_exact(conn, memoryview(head))
                except WeightSyncError:
                    return  # the subscriber hung up between requests
                body = bytearray(int.from_bytes(head, "little"))
                _recv_exact(conn, memoryview(body))
                try:
                    views, done = source.open(decode_request(bytes(body)))
                except SluiceError as exc:
                    conn.sendall(status_header(exc))
                    continue
                ok = False
                try:
                    conn.sendall(status_header(None))
                    for view in views:
                        conn.sendall(view)
                    ok = True
                finally:
                    done(ok)
        except (OSError, SluiceError):
            pass  # the peer vanished or the version was abandoned: dropping the connection tells it
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    # -- receiving -----------------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        """Pull `job`'s reads (whole, or a delta against `job.base`) over this rank's (or
        relay's) connection, opened on first use.

        Raises:
            WeightSyncError: the request was refused or the stream failed, whatever the cause
                (the connection is then dropped: its unread bytes would be taken for the
                next reply).
        """
        grant = job.grant
        assert grant is not None  # a subscriber leases the slot before a "reads" transport reads it
        request: Pull | RelayPull
        if grant.source:
            endpoint, request = grant.source, RelayPull(job.version, job.rank, job.digest, job.base)
        else:
            endpoint, request = job.endpoint, Pull(grant.lease, job.version, job.reads, job.base)
        try:
            sock = self._peer(endpoint)
            sock.settimeout(job.timeout)
            body = encode_request(request)
            sock.sendall(len(body).to_bytes(4, "little") + body)
            head = bytearray(STATUS.size)
            _recv_exact(sock, memoryview(head))
            failed, length = STATUS.unpack(head)
            if failed:
                text = bytearray(length)
                _recv_exact(sock, memoryview(text))
                raise_status(bytes(text))
            if request.base >= 0:
                return job.receive_delta(lambda view: _recv_exact(sock, view), self._landing)
            into = job.buffer()
            for read, offset in zip(job.reads, job.offsets):
                if self._landing is not None:
                    self._landing.receive(lambda view: _recv_exact(sock, view), into[offset : offset + read.nbytes])
                else:
                    _recv_exact(sock, as_bytes(into[offset : offset + read.nbytes]), job.progress, offset)
                job.progress(offset + read.nbytes)
            job.received = sum(read.nbytes for read in job.reads)
        except Exception as exc:
            # whatever broke off the stream (a bad frame, a lost peer, an apply thread that
            # could not start) left its unread bytes in the socket: the next request needs a new one
            self._drop(endpoint)
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"tcp stream from {endpoint} failed: {exc!r}") from exc
        return into

    def _peer(self, endpoint: str) -> socket.socket:
        sock = self._peers.get(endpoint)
        if sock is None:
            host, port = endpoint.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=10)
            _tune(sock)
            try:
                _join(sock, self._key, endpoint)
            except BaseException:
                sock.close()
                raise
            self._peers[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        sock = self._peers.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            except OSError:
                pass
            self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for endpoint in list(self._peers):
            self._drop(endpoint)
        for thread in threads:
            thread.join(timeout=5)
