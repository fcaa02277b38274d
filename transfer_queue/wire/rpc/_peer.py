"""What both client channels decide without I/O: ids, liveness pings, deadlines (`_Peer`)."""

from __future__ import annotations

import itertools
import time

import zmq

from ..auth import Credentials, secure_client
from ..errors import SluiceError
from ._codec import PROBE_AFTER, SOCKET_BUFFER_BYTES, Codec
from ._context import socket


class _Liveness:
    """What every client channel decides without I/O: ids, liveness, deadlines. `lost` is raised
    when the peer is silent for `dead_after` s (pinged after `PROBE_AFTER` s), `late` at a deadline."""

    def __init__(
        self,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None,
        hint: str,
        timeout: float,
        connect_timeout: float,
        dead_after: float,
        lost: type[SluiceError],
        late: type[SluiceError],
    ):
        self.endpoint = endpoint
        self.name = name or f"the service at {endpoint}"
        self.codec = replies
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.dead_after = dead_after
        self.hint = hint
        self.lost, self.late = lost, late
        self.heard = 0.0  # monotonic time of the peer's last message
        self.dead = False  # reported dead and silent since
        self.ended = False
        """The connection ended for good (a local lane whose service is gone; a ZeroMQ channel
        reconnects instead): a caller that goes on needs a new channel."""
        self._pinged = float("-inf")
        self._ids = itertools.count(1)

    def _heard(self) -> None:
        self.heard = time.monotonic()
        self.dead = False

    def _step(self, since: float, deadline: float | None, what: str) -> tuple[bool, float]:
        """While awaiting a reply since `since`: (ping the peer now?, seconds to wait next).

        Raises `late` at `deadline`, `lost` once the peer is silent for `dead_after` s."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise self.late(f"{self.name} did not answer {what} within {deadline - since:g}s; is it still running?")
        quiet = now - max(self.heard, since)
        if quiet > self.dead_after:
            self.dead = True
            raise self.lost(
                f"{self.name} has not answered for {quiet:.1f} s, pings included: it died or hangs{self.hint}, "
                "or it refused this client's credentials (a cluster bound beyond loopback admits only "
                "clients given its SLUICE_CREDENTIALS)"
            )
        ping = quiet >= PROBE_AFTER and now - self._pinged >= PROBE_AFTER
        if ping:
            self._pinged = now
        left = PROBE_AFTER if deadline is None else min(PROBE_AFTER, deadline - now)
        return ping, max(left, 0.0)

    def _deadline(self, since: float, wait: float | None) -> float | None:
        return None if wait is None else since + wait


class _Peer(_Liveness):
    """One DEALER to one endpoint (`_Liveness` decides the rest): `lost` is also raised when the
    peer is unreachable. Its socket lingers `connect_timeout` s once closed: what was handed to
    ZeroMQ and not yet written (a posted `Free`, `CommitWrite(abort)` or ping) still goes out,
    in ZeroMQ's I/O thread (`close` returns at once), as long as the peer takes it that soon.
    So a `term()` of the channel's context can block up to `connect_timeout` s while notices to
    a peer that is not reading are pending (nothing in Sluice terminates a context)."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replies: Codec,
        *,
        name: str | None,
        hint: str,
        credentials: Credentials | None,
        timeout: float,
        connect_timeout: float,
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
            connect_timeout=connect_timeout,
            dead_after=dead_after,
            lost=lost,
            late=late,
        )
        self.sock = socket(ctx, zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, int(connect_timeout * 1000))
        self.sock.setsockopt(zmq.SNDBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(zmq.RCVBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        self.sock.setsockopt(zmq.SNDTIMEO, int(connect_timeout * 1000))  # ... and never block for it
        if credentials is not None:
            secure_client(self.sock, credentials)
        self.sock.connect(endpoint)

    def _unreachable(self) -> SluiceError:
        self.dead = True
        return self.lost(
            f"{self.name} took no message for {self.connect_timeout:g} s: it is down, or it refused this "
            "client's credentials (a cluster bound beyond loopback admits only clients given its "
            "SLUICE_CREDENTIALS)"
        )
