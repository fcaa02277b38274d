"""The controller's links to its storage units: registration, liveness, retirement, frees.

Units register with the cluster secret (`RegisterUnit`). The controller pings each one every
`PING` seconds over its own channel and retires one silent for `DEAD_AFTER`: its samples are
counted lost, puts in flight on it end, and its rows are never placed or served again (a unit
that restarts registers afresh). Frees travel over the same channels; a unit's messages to the
controller (registration, reports of put writes) carry the cluster secret (`authenticate`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Callable

import numpy as np

from transfer_queue.wire.auth import WriteTickets
from transfer_queue.wire.errors import ProtocolError, ServiceError, SluiceError
from transfer_queue.wire.messages import Free, Ok, Ping, RegisterUnit, Reply, UnitInfo
from transfer_queue.wire.rpc import AsyncChannel, Codec, Credentials

from .intake import Intake
from .ledger import Ledger
from .records import Record, Retired, Unit
from .table import Partition

__all__ = ["UnitLinks"]

log = logging.getLogger("sluice.controller")

PING = 1.0
"""Seconds between the controller's liveness pings to each storage unit."""
DEAD_AFTER = 5.0
"""Seconds of silence after which a storage unit is retired and its samples counted lost."""


class UnitLinks:
    """The storage units as live peers: their channels, liveness and the cluster secret. The
    units' table and byte counts are the `ledger`'s (placement, intake and keys read them)."""

    def __init__(
        self,
        ledger: Ledger,
        secret: str,
        credentials: Credentials | None,
        intake: Intake,
        record: Callable[[Record], None],
        end_puts_on: Callable[[int, SluiceError], None],
        lose: Callable[[Partition, np.ndarray], None],
    ):
        """`record` journals a change; `end_puts_on` ends the puts in flight on a unit that died
        (`Puts.end_on`), `lose` drops its rows from the consumers' view (`Scheduler.lose`)."""
        self.ledger = ledger
        self.intake = intake
        self._record = record
        self._end_puts_on = end_puts_on
        self._lose = lose
        self._secret = secret
        self.tickets = WriteTickets(secret)
        """Signs each unit's share of a placed put, which the unit checks (`Write.ticket`)."""
        self._credentials = credentials
        self._codec = Codec(Reply)
        self.channels: dict[int, AsyncChannel] = {}
        self.heard: dict[int, float] = {}  # unit id -> monotonic time of its last message
        self.retired: dict[int, UnitInfo] = {}  # units that stopped answering, until they register again
        self.samples_lost = 0
        self.registrations_refused = 0
        self.pinger: asyncio.TimerHandle | None = None
        self._last_ping = 0.0

    def handlers(self) -> dict[type, Callable]:
        """The requests this part answers, by message type."""
        return {RegisterUnit: self.on_register_unit}

    def on_register_unit(self, msg: RegisterUnit, data) -> Ok:
        """Add a unit, or take back one that restarted (a fresh, empty arena) after it was retired.

        Raises `ProtocolError` (counted) without the cluster secret: nobody else may add a unit
        or replace a live one, and with it redirect clients' data."""
        try:
            self.authenticate(msg.secret, f"RegisterUnit of unit {msg.unit.unit_id}")
        except ProtocolError:
            self.registrations_refused += 1
            raise
        self.add(msg.unit)
        return Ok()

    def authenticate(self, secret: str, what: str) -> None:
        """Check that a unit's message carries the cluster secret.

        Raises:
            ProtocolError: it does not."""
        if not hmac.compare_digest(secret.encode(), self._secret.encode()):
            raise ProtocolError(
                f"{what} refused: it does not carry this cluster's secret (start units with SLUICE_SECRET set to it)"
            )

    def add(self, unit: UnitInfo) -> None:
        """Serve `unit`: place rows on it, ping it, send it frees."""
        self.ledger.add_unit(unit)
        self.retired.pop(unit.unit_id, None)
        self.heard[unit.unit_id] = time.monotonic()
        if self.pinger is None:
            self._last_ping = time.monotonic()
            self.pinger = asyncio.get_running_loop().call_later(PING, self._ping)
        old = self.channels.pop(unit.unit_id, None)
        if old is not None:
            old.close()
        self.channels[unit.unit_id] = AsyncChannel(
            unit.address,
            self._codec,
            name=f"storage unit {unit.unit_id} at {unit.address}",
            credentials=self._credentials,
            on_reply=functools.partial(self._replied, unit.unit_id),
        )
        self.intake.wake()
        self._record(Unit(unit))

    def _ping(self) -> None:
        """Loop timer: ping every unit; retire those silent for `DEAD_AFTER` seconds.

        A tick that comes late means this controller was stalled (CPU starved, suspended) and
        could hear nobody meanwhile: every unit then gets a fresh window instead of being retired
        for the controller's own silence."""
        now = time.monotonic()
        if now - self._last_ping > 2 * PING:
            for unit_id in self.heard:
                self.heard[unit_id] = max(self.heard[unit_id], now - PING)
        self._last_ping = now
        for unit_id in list(self.ledger.units):
            if now - self.heard.get(unit_id, now) > DEAD_AFTER:
                self.retire(unit_id)
                continue
            self.channels[unit_id].post(Ping())
        self.pinger = asyncio.get_running_loop().call_later(PING, self._ping)

    def retire(self, unit_id: int) -> None:
        """A unit died: never place or serve its rows again. Puts in flight on it fail; its
        samples are counted lost, and the prompts of those that have a source are requeued."""
        unit = self.retired[unit_id] = self.ledger.retire_unit(unit_id)
        self.heard.pop(unit_id, None)
        self._end_puts_on(
            unit_id,
            ServiceError(
                f"storage unit {unit_id} at {unit.address} died while this put was in flight; "
                "none of its samples were stored: put again"
            ),
        )
        channel = self.channels.pop(unit_id, None)
        if channel is not None:
            channel.close()
        lost = 0
        for part in self.ledger.partitions.values():
            rows = np.flatnonzero(part.alive[: part.n] & (part.unit[: part.n] == unit_id))
            if len(rows):
                lost += len(rows)
                self._lose(part, rows)
        self.samples_lost += lost
        self.intake.forget(unit_id)
        self._record(Retired(unit_id))
        log.warning("storage unit %d at %s stopped answering: retired, %d samples lost", unit_id, unit.address, lost)

    def _replied(self, unit_id: int, reply: object) -> None:
        """A unit answered a ping or a `Free`: it is alive (a refused free is logged)."""
        self.heard[unit_id] = time.monotonic()
        if not isinstance(reply, Ok):
            log.warning("unit %d refused a free: %s", unit_id, reply)

    def channel(self, unit_id: int) -> AsyncChannel:
        """The channel to a live unit.

        Raises:
            ServiceError: the unit was retired."""
        channel = self.channels.get(unit_id)
        if channel is None:
            raise ServiceError(f"storage unit {unit_id} was retired")
        return channel

    def freed(self, partition: str, rows_by_unit: dict[int, list[int]] | None) -> None:
        """Rows were freed (`Ledger.freed`): tell their units, and let waiting puts take the room."""
        self.tell_free(partition, rows_by_unit)
        self.intake.wake()

    def tell_free(
        self, partition: str, rows_by_unit: dict[int, list[int]] | None, fields: list[str] | None = None
    ) -> None:
        """Tell the units of `rows_by_unit` (None: every unit, every row of `partition`) to free
        them; with `fields`, only those fields of the rows."""
        targets = self.channels if rows_by_unit is None else rows_by_unit
        for unit_id in targets:
            channel = self.channels.get(unit_id)
            if channel is not None:
                channel.post(Free(partition, None if rows_by_unit is None else rows_by_unit[unit_id], fields))
