"""CurveZMQ credentials of a cluster, for every service that listens beyond loopback.

A cluster bound to loopback is reachable only from its own machine and runs without them. A
cluster bound to any other address must have them: its services are CurveZMQ servers (traffic
encrypted, peers authenticated), and a ZAP handler admits only clients that hold the cluster's
client key pair. `tq.init` generates the credentials when `host` is not loopback and hands them
to its services through the environment (`SLUICE_CREDENTIALS`, never argv); clients get the
client half (`Credentials.for_clients`, what `sluice serve` prints). Handshakes refused for any
reason (no CURVE, wrong keys) are counted by the service (`auth_refused`).

The unit registration secret (`SLUICE_SECRET`) is separate: holding client credentials lets a
worker put and get, not join the cluster as a storage unit. The controller also signs with it
each unit's share of a put it placed (`WriteTickets`): the producer passes the ticket on in its
`Write`, and a unit stores an open put's rows only with a valid one, so nobody can make a unit
keep bytes the controller never planned (and never accounts or frees).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq

from .errors import SchemaError

__all__ = [
    "CREDENTIALS_ENV",
    "Credentials",
    "REFUSALS",
    "WriteTickets",
    "from_env",
    "is_loopback",
    "secure_client",
    "secure_server",
]

CREDENTIALS_ENV = "SLUICE_CREDENTIALS"

REFUSALS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class Credentials(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Z85 CurveZMQ keys: the services' pair and the pair every client of the cluster uses."""

    server_public: str
    client_public: str
    client_secret: str
    server_secret: str = ""
    """Only services hold it; `for_clients()` drops it."""

    @classmethod
    def generate(cls) -> Credentials:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public.decode(), client_public.decode(), client_secret.decode(), server_secret.decode())

    def for_clients(self) -> Credentials:
        """What a worker needs to connect (not to serve)."""
        return msgspec.structs.replace(self, server_secret="")

    def token(self) -> str:
        """One printable string (for `SLUICE_CREDENTIALS`)."""
        return base64.urlsafe_b64encode(msgspec.json.encode(self)).decode()

    @classmethod
    def from_token(cls, token: str) -> Credentials:
        """Parse `token()`; `SchemaError` (a `ValueError`) for anything else."""
        try:
            return msgspec.json.decode(base64.urlsafe_b64decode(token.encode()), type=cls)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise SchemaError(f"{CREDENTIALS_ENV} does not hold Sluice credentials: {exc}") from None


def from_env() -> Credentials | None:
    """The credentials in `SLUICE_CREDENTIALS`, or None when it is unset."""
    token = os.environ.get(CREDENTIALS_ENV)
    return Credentials.from_token(token) if token else None


def is_loopback(endpoint: str) -> bool:
    """Whether a `tcp://host:port` endpoint (or a bare host) is reachable from this machine only."""
    host = endpoint.partition("://")[2].rpartition(":")[0] if "://" in endpoint else endpoint
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def secure_client(sock: zmq.Socket, creds: Credentials) -> None:
    """Make `sock` a CurveZMQ client of the cluster (before it connects)."""
    sock.curve_serverkey = creds.server_public.encode()
    sock.curve_publickey = creds.client_public.encode()
    sock.curve_secretkey = creds.client_secret.encode()


class _Keys:
    """ZAP credentials provider: admits exactly the cluster's client key."""

    def __init__(self, client_public: str):
        self.client_public = client_public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def secure_server(sock: zmq.Socket, creds: Credentials) -> Any:
    """Make `sock` a CurveZMQ server admitting only the cluster's clients (before it binds).

    Returns the ZAP thread (stop it with the socket). A refused handshake is a `REFUSALS` event
    of the socket's monitor, which the caller makes (a socket has one monitor)."""
    if not creds.server_secret:
        raise SchemaError(f"these credentials are a client's; a service needs the full {CREDENTIALS_ENV}")
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(zmq.Context.shadow(sock.context.underlying))
    auth.start()
    auth.configure_curve_callback("sluice", _Keys(creds.client_public))
    sock.zap_domain = b"sluice"
    sock.curve_server = True
    sock.curve_publickey = creds.server_public.encode()
    sock.curve_secretkey = creds.server_secret.encode()
    return auth


class WriteTickets:
    """Signs and checks the tickets of planned writes with a cluster's unit secret.

    A ticket is a keyed BLAKE2b MAC over what the controller placed: the partition, the put (its
    first index), the unit, the unit's rows of it and the put's field specs. It costs one hash
    of the msgpack of those, on the controller per unit of a put and on the unit per write.
    """

    __slots__ = ("_key",)

    def __init__(self, secret: str):
        self._key = hashlib.sha256(secret.encode()).digest()

    def sign(self, partition: str, put: int, unit_id: int, indexes: Sequence[int], fields: Mapping[str, Any]) -> bytes:
        data = msgspec.msgpack.encode((partition, put, unit_id, indexes, fields))
        return hashlib.blake2b(data, key=self._key, digest_size=16).digest()

    def valid(
        self, ticket: bytes, partition: str, put: int, unit_id: int, indexes: Sequence[int], fields: Mapping[str, Any]
    ) -> bool:
        """Whether `ticket` is the one `sign` gives for these arguments."""
        return hmac.compare_digest(ticket, self.sign(partition, put, unit_id, indexes, fields))
