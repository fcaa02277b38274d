"""The weight transports' handshake: who may pull weights from a publisher rank or a relay.

ZeroMQ services use CurveZMQ; the weight transports move bytes over raw links (TCP sockets, UCX
endpoints), so they authenticate each connection themselves, in three messages: the server's
greeting (magic, whether it requires credentials, a nonce), the client's nonce and proof, and
the server's proof. Both proofs are HMAC-SHA256 over both nonces keyed by the cluster's client
secret (`SLUICE_CREDENTIALS`), so each side proves it holds the credentials without sending
them. The bytes that follow are authenticated, not encrypted. This module is the protocol
only; each transport does the I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from transfer_queue import SchemaError, WeightSyncError
from transfer_queue.wire.rpc import CREDENTIALS_ENV, Credentials, credentials_from_env, is_loopback

__all__ = ["GREETING_BYTES", "ANSWER_BYTES", "PROOF_BYTES", "TIMEOUT", "key_of", "check_serve", "Server", "Client"]

_MAGIC = b"SLUICEW1"
_NONCE = 32
GREETING_BYTES = len(_MAGIC) + 1 + _NONCE
ANSWER_BYTES = 2 * _NONCE
PROOF_BYTES = 32
TIMEOUT = 10.0
"""Seconds a server waits for a peer's proof before dropping the connection (or UCX endpoint)."""


def key_of(credentials: Credentials | None) -> bytes | None:
    """The handshake key of a cluster's credentials (both halves hold its client secret);
    `credentials` default to `SLUICE_CREDENTIALS`, and None without them."""
    if credentials is None:
        credentials = credentials_from_env()
    if credentials is None:
        return None
    return hashlib.sha256(
        b"sluice-weights\0" + credentials.client_secret.encode() + credentials.server_public.encode()
    ).digest()


def check_serve(key: bytes | None, host: str) -> None:
    """Raise `SchemaError` unless a transport with handshake key `key` may serve on `host`:
    beyond loopback only with the cluster's credentials."""
    if key is None and not is_loopback(host):
        raise SchemaError(
            f"refusing to serve weights on {host} without the cluster's credentials: set {CREDENTIALS_ENV} "
            "(or pass credentials=), or bind 127.0.0.1"
        )


def _proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


class Server:
    """One connection's server side: send `greeting`, then (if `required`) check the client's
    answer; `check` returns the server's proof to send back, or None to refuse the peer."""

    def __init__(self, key: bytes | None):
        self.key = key
        self._nonce = os.urandom(_NONCE)

    @property
    def required(self) -> bool:
        return self.key is not None

    def greeting(self) -> bytes:
        return _MAGIC + (b"\1" if self.key else b"\0") + self._nonce

    def check(self, answer: bytes) -> bytes | None:
        assert self.key is not None
        theirs, proof = answer[:_NONCE], answer[_NONCE:]
        if len(answer) != ANSWER_BYTES or not hmac.compare_digest(
            proof, _proof(self.key, b"client", self._nonce, theirs)
        ):
            return None
        return _proof(self.key, b"server", theirs, self._nonce)


class Client:
    """One connection's client side: `answer(greeting)` gives what to send back (None: the
    server requires nothing), then `verify(proof)` checks the server's proof.

    Raises `WeightSyncError` (naming `endpoint` and what to do) when the greeting is not a Sluice
    weight endpoint's, when the server requires credentials this client lacks, when a server
    beyond loopback requires none although this client holds them, or when its proof is wrong."""

    def __init__(self, key: bytes | None, endpoint: str, transport: str):
        self.key = key
        self.endpoint = endpoint
        self.transport = transport
        self._mine = os.urandom(_NONCE)
        self._nonce = b""

    def answer(self, greeting: bytes) -> bytes | None:
        if len(greeting) != GREETING_BYTES or greeting[: len(_MAGIC)] != _MAGIC:
            raise WeightSyncError(f"{self.endpoint} is not a Sluice {self.transport} weight endpoint")
        required, self._nonce = greeting[len(_MAGIC)] == 1, greeting[len(_MAGIC) + 1 :]
        if not required:
            if self.key is not None and not is_loopback(self.endpoint.rsplit(":", 1)[0]):
                raise WeightSyncError(f"{self.endpoint} serves weights without the cluster's credentials; refusing it")
            return None
        if self.key is None:
            raise WeightSyncError(
                f"{self.endpoint} admits only holders of the cluster's credentials: set {CREDENTIALS_ENV} "
                f"(what `sluice serve` printed) or pass credentials= to the {self.transport} transport"
            )
        return self._mine + _proof(self.key, b"client", self._nonce, self._mine)

    def refused(self) -> WeightSyncError:
        """The error for a server that hung up instead of sending its proof."""
        return WeightSyncError(f"{self.endpoint} refused this subscriber's credentials (another cluster's?)")

    def verify(self, proof: bytes) -> None:
        assert self.key is not None
        if not hmac.compare_digest(proof, _proof(self.key, b"server", self._mine, self._nonce)):
            raise WeightSyncError(f"{self.endpoint} could not prove it holds the cluster's credentials; refusing it")
