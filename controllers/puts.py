"""Puts: admission and placement of new rows, the units' reports of their writes, commit, abort
and expiry.

A put of new rows takes its producer two round trips:

1. `BeginPut`: `intake` admits the put once its units have room, `placement` picks the units,
   and the rows are registered uncommitted under fresh global indexes.
2. The producer sends its writes to the units and its `CommitPut` here together. Each unit
   reports how its write ended (`WriteLanded`, signed with the cluster secret); the commit waits
   until every unit of the put reported its write stored, then records the rows' facts and marks
   their fields ready, so no consumer ever sees a sample whose bytes are not all in place. The
   last report applies a commit that came before it and answers it in the same step (the commit
   waits as a plain future, no task), so the put's last hop is the answer itself. A unit that
   reports a failed write ends the put: its rows are freed and the commit answers with the
   unit's error.

A producer that wrote its previous put whole through a unit's mapped arena reserves the space
of its next one there along with its `BeginPut` (`Write.ahead`), which then asks to be placed at
once or not at all (`BeginPut.now`): when the plan puts it whole on that unit, the put takes
that space (the unit checks the plan's ticket when the space is committed with the rows), and
the reservation's own round trip is saved; else the space is given back and the put goes on as
any other.

An open put that is neither committed nor aborted within 2 x its timeout + a grace (its producer
died or stalled) expires and its rows are freed; sealing or clearing its partition, or the death
of one of its units, ends it too, and a late commit learns why. New columns of existing rows
(`put(td, meta=...)`) are no open puts: the producer writes them first, then commits them here,
where they are checked against the schema and accounted for.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from transfer_queue.wire.errors import (
    CapacityError,
    ProtocolError,
    SchemaError,
    SealedError,
    ServiceError,
    SluiceError,
    TimeoutError,
)
from transfer_queue.wire.messages import AbortPut, BeginPut, CommitPut, Ok, PutPlan, WriteLanded
from transfer_queue.wire.rpc import MAX_BATCH, current_peer, error_from_code

from .admission import Admission
from .intake import WINDOW_SHARE, Intake
from .ledger import Ledger, all_equal, field_sizes
from .placement import place_rows
from .records import Committed, Record
from .table import Partition
from .units import UnitLinks

__all__ = ["Puts"]

_PUT_GRACE = 5.0
"""Seconds an open put may outlive 2 x its timeout (one wait for space, one shm reservation)."""
_ENDED_KEPT = 4096  # ended puts remembered, so a late CommitPut learns why its rows are gone


@dataclass
class _OpenPut:
    """New rows placed by `BeginPut` and not yet committed (or aborted)."""

    partition: str
    first: int
    n: int
    lifetime: float
    timer: asyncio.TimerHandle
    framed: dict[int, int]
    """Unit id -> bytes this put sends that unit as data frames (its share of the frame window)."""
    unlanded: set[int]
    """Units that have not reported the put's write stored yet."""
    rows: dict[int, list[int]]
    """Unit id -> the put's indexes on that unit, ascending: what its report must name."""
    peer: bytes = b""
    """The connection that opened it (`rpc.current_peer`)."""
    commits: list[tuple[CommitPut, asyncio.Future]] = field(default_factory=list)
    """Commits that came before the last report, answered when it comes or the put ends."""


class Puts:
    """The put handlers and the open puts."""

    def __init__(
        self,
        ledger: Ledger,
        links: UnitLinks,
        intake: Intake,
        admission: Admission,
        wake: Callable[[str], None],
        granted_commit: Callable[[str], None],
        record: Callable[[Record], None],
        storage_capacity: int,
    ):
        """`links` authenticates the units' reports and takes frees of stray rows; `wake`
        re-evaluates the consumers parked on a partition (`Scheduler.wake`), `granted_commit`
        also has those a put under a grant may now hold back report their demand
        (`Scheduler.granted_commit`); `record` journals a change; `storage_capacity` is the
        cluster's, which no put may exceed."""
        self.ledger = ledger
        self.links = links
        self.intake = intake
        self.admission = admission
        self._wake = wake
        self._granted_commit = granted_commit
        self._record = record
        self.storage_capacity = storage_capacity
        self.open: dict[int, _OpenPut] = {}
        self.expired = 0
        self.abandoned = 0
        self.reports_refused = 0
        self.samples = 0
        """Samples committed as new rows."""
        self._ended: OrderedDict[int, SluiceError] = OrderedDict()

    def handlers(self) -> dict[type, Callable]:
        """The requests this part answers, by message type."""
        return {
            BeginPut: self.on_begin_put,
            CommitPut: self.on_commit_put,
            WriteLanded: self.on_write_landed,
            AbortPut: self.on_abort_put,
        }

    # -- BeginPut ----------------------------------------------------------------------

    def on_begin_put(self, msg: BeginPut, data) -> PutPlan | Awaitable[PutPlan]:
        """Place a put's rows now, or once its units have room (see `intake`); `CapacityError`
        if none comes within the put's timeout. With `BeginPut.now`, an empty plan instead of a
        wait (no overtaking either: an empty plan while other puts wait for room)."""
        if msg.n <= 0:
            raise SchemaError(f"a put needs at least one sample, got batch_size {msg.n}")
        if msg.n > MAX_BATCH:
            raise SchemaError(f"a put may hold at most {MAX_BATCH} samples, got {msg.n}; split it")
        if msg.row_bytes < 0 or not math.isfinite(msg.timeout) or msg.timeout < 0:
            raise SchemaError(f"bad put: row_bytes {msg.row_bytes} and timeout {msg.timeout} must be >= 0")
        if not msg.fields:
            raise SchemaError("a put needs at least one field")
        sizes = field_sizes(msg.fields, msg.n, msg.row_bytes, msg.field_bytes)
        peer = current_peer.get()
        self.intake.check(msg.n, msg.row_bytes, self.storage_capacity, len(self.open), peer)
        if msg.now:  # its producer holds arena space reserved ahead: it must not wait holding it
            return (None if len(self.intake) else self._place(msg, sizes, peer)) or PutPlan([], [])
        return self.intake.admit(lambda: self._place(msg, sizes, peer), msg.timeout, lambda: self._full(msg))

    def _place(self, msg: BeginPut, sizes: dict[str, int], peer: bytes) -> PutPlan | None:
        """Place the put's rows now (`sizes`: each field's bytes per row), or None while one of
        its units has no room."""
        ledger = self.ledger
        part = ledger.partition(msg.partition)
        part.check_schema(msg.fields)
        if part.sealed:
            raise SealedError(f"partition {msg.partition!r} is sealed; no new samples may be put into it")
        if not ledger.units:
            raise SchemaError("the cluster has no storage units registered yet")
        room = ledger.room()
        for stay in dict.fromkeys((msg.stay, -1)):  # the producer's unit, unless its frames must wait there
            units = place_rows(ledger.unit_bytes, msg.n, msg.row_bytes, room, stay)
            shares = ledger.shares(units, msg.row_bytes)
            framed = {u: nbytes for u, nbytes in shares.items() if u not in msg.mapped}
            if self.intake.fits(shares, framed, ledger.unit_bytes, ledger.units):
                break
        else:
            return None
        first = ledger.new_rows(part, units, sizes, msg.fields, shares)
        self.intake.opened(framed, peer)
        lifetime = 2 * msg.timeout + _PUT_GRACE
        timer = asyncio.get_running_loop().call_later(lifetime, self._expire, first)
        placed = units.tolist()
        if len(shares) == 1 and all_equal(units):  # one unit: the common case
            rows = {placed[0]: list(range(first, first + msg.n))}
        else:
            rows = {u: (first + np.flatnonzero(units == u)).tolist() for u in shares}
        self.open[first] = _OpenPut(msg.partition, first, msg.n, lifetime, timer, framed, set(shares), rows, peer)
        sign = self.links.tickets.sign
        tickets = {u: sign(msg.partition, first, u, indexes, msg.fields) for u, indexes in rows.items()}
        return PutPlan(list(range(first, first + msg.n)), placed, tickets, msg.partition)

    def _full(self, msg: BeginPut) -> SluiceError:
        """Why a put found no place within its timeout: no room (`CapacityError`), or room but
        the frame window of its units full of open puts' frames (`TimeoutError`)."""
        ledger = self.ledger
        shares = ledger.shares(place_rows(ledger.unit_bytes, msg.n, msg.row_bytes), msg.row_bytes)
        if all(ledger.unit_bytes[u] + nbytes <= ledger.units[u].capacity for u, nbytes in shares.items()):
            flying = ", ".join(
                f"unit {u}: {self.intake.in_flight.get(u, 0)} of {ledger.units[u].capacity // WINDOW_SHARE}"
                for u in shares
            )
            return TimeoutError(
                f"a put of {msg.n} samples x {msg.row_bytes} bytes waited {msg.timeout:g} s for the frame window of its "
                f"storage units (bytes of open puts' frames not yet stored: {flying}; {len(self.open)} puts open, "
                f"{len(self.intake)} waiting); the units have room: a put whose producer stalled or died holds its "
                f"share until its writes land or it expires (2 x its timeout + {_PUT_GRACE:g} s)"
            )
        held = ", ".join(
            f"unit {u}: {ledger.unit_bytes[u]} of {ledger.units[u].capacity}" for u in sorted(ledger.unit_bytes)
        )
        return CapacityError(
            f"storage stayed full for {msg.timeout:g} s: a put of {msg.n} samples x {msg.row_bytes} bytes found no "
            f"room (bytes in use: {held}; {len(self.intake)} puts waiting); clear consumed samples or raise storage_capacity"
        )

    def on_write_landed(self, msg: WriteLanded, data) -> None:
        """A unit's report of a put's write: stored, or failed (which ends the put). A notice:
        answered only when refused. A report is taken only when its rows are exactly the open
        put's rows on that unit (a write of part of them must not commit the put, a stray one
        must not end it). Rows stored after their put ended (aborted, sealed, expired, another
        unit failed) are freed on that unit again: its `Free` may have come before them.

        Raises:
            ProtocolError: the report does not carry the cluster secret (`reports_refused`)."""
        try:
            self.links.authenticate(msg.secret, f"a write report of storage unit {msg.unit_id}")
        except ProtocolError:
            self.reports_refused += 1
            raise
        put = self.open.get(msg.put)
        if put is None or put.partition != msg.partition:
            if not msg.code:
                self._free_stray(msg)
            return
        if sorted(msg.indexes) != put.rows.get(msg.unit_id):
            return  # not this put's write on that unit
        if msg.code:
            self.end(msg.put, error_from_code(msg.code, msg.message))
        else:
            self.landed(msg.put, msg.unit_id)

    def _free_stray(self, msg: WriteLanded) -> None:
        """Free on the unit the rows of a report that belong to no open put and are not alive."""
        part = self.ledger.partitions.get(msg.partition)
        stray = msg.indexes
        if part is not None:
            rows, known = part.locate(msg.indexes)
            stray = np.asarray(msg.indexes)[~(known & part.alive[rows])].tolist()
        if stray:
            self.links.tell_free(msg.partition, {msg.unit_id: stray})

    def landed(self, first: int, unit_id: int) -> None:
        """`unit_id` reported the write of open put `first` stored; the last report applies a
        commit waiting for it and answers it."""
        put = self.open.get(first)
        if put is None:
            return
        put.unlanded.discard(unit_id)
        self.intake.closed({unit_id: put.framed.pop(unit_id, 0)})  # its frames are stored: out of the window
        if not put.unlanded:
            self._answer(put)

    # -- CommitPut ---------------------------------------------------------------------

    def on_commit_put(self, msg: CommitPut, data) -> Ok | Awaitable[Ok]:
        """Commit new columns at once, or an open put's new rows once all its writes are stored."""
        if msg.rows is None:
            try:
                self.apply(msg)
            except SluiceError:
                self._drop_clashing(msg)
                raise
            self._record(Committed(msg))
            return Ok()
        put = self._open_put(msg)
        if put.unlanded:  # answered by the last report (`landed`) or the put's end (`end`)
            waiting: asyncio.Future[Ok] = asyncio.get_running_loop().create_future()
            put.commits.append((msg, waiting))
            return waiting
        return self._commit(put, msg)

    def _answer(self, put: _OpenPut) -> None:
        """Answer the commits waiting for `put`, in order: the first applies it (all its writes
        are stored), any other learns it is no open put any more; after the put ended, each
        learns why. A withdrawn commit (cancelled) is skipped: it leaves the put open."""
        commits, put.commits = put.commits, []
        for msg, waiting in commits:
            if waiting.done():
                continue
            try:
                waiting.set_result(self._commit(self._open_put(msg), msg))
            except SluiceError as exc:
                waiting.set_exception(exc)

    def _commit(self, put: _OpenPut, msg: CommitPut) -> Ok:
        part = self.ledger.partitions.get(put.partition)
        try:
            self.apply(msg, None if part is None else part.run(put.first, put.n))
        except SluiceError as exc:
            self.end(put.first, exc)
            raise
        self._close(put)
        self._record(Committed(msg))
        return Ok()

    def apply(self, msg: CommitPut, rows: slice | np.ndarray | None = None) -> None:
        """Mark `msg.fields` ready, with new rows' facts, or new columns of existing rows checked
        and accounted for; wake the consumers. `rows`: the row numbers of new rows' `msg.indexes`
        when the caller knows them (an open put's `Partition.run`), else they are looked up.
        (The journal replays commits through here.)

        Raises:
            SchemaError: the facts do not match the rows, or new columns clash with the schema."""
        info = msg.rows
        if info is None:
            part, rows = self._new_columns(msg)
        else:
            part = self.ledger.partition(msg.partition)
            if rows is None:
                rows = part.rows_of(msg.indexes)
            n = len(msg.indexes)
            for name, values in (
                ("versions_first", info.versions_first),
                ("versions_last", info.versions_last),
                ("groups", info.groups),
                ("seqlens", info.seqlens),
            ):
                if len(values) != n:
                    raise SchemaError(f"{name} has {len(values)} entries for {n} samples")
            if info.source_partition and len(info.source_indexes) != n:
                raise SchemaError(f"source_indexes has {len(info.source_indexes)} entries for {n} samples")
            if info.grant_id:
                self.admission.check_fits(info.grant_id, n)
            part.v_first[rows] = _uniform(info.versions_first)
            part.v_last[rows] = _uniform(info.versions_last)
            part.group[rows] = _uniform(info.groups)
            part.seqlen[rows] = _uniform(info.seqlens)
            if info.source_partition:
                ref = (info.source_partition, info.source_task)
                if ref not in part.sources:
                    part.sources.append(ref)
                part.source[rows] = part.sources.index(ref)
                part.source_index[rows] = info.source_indexes
            part.committed[rows] = True
            part.granted[rows] = bool(info.grant_id)
            part.versioned[rows] = info.versioned
            if info.grant_id:
                self.admission.used(info.grant_id, n)
            self.samples += n
        part.mark_ready(rows, list(msg.fields))
        if info is not None and info.grant_id:
            self._granted_commit(part.name)  # `accepted` rose: a request parked anywhere may be held back now
        else:
            self._wake(part.name)

    def _new_columns(self, msg: CommitPut) -> tuple[Partition, np.ndarray]:
        """Check and account for new columns of existing rows (a put with `meta=`)."""
        if not msg.fields:
            raise SchemaError("a put needs at least one field")
        if not msg.indexes or len(msg.indexes) > MAX_BATCH or msg.row_bytes < 0:
            raise SchemaError(f"a put of new columns needs 1..{MAX_BATCH} indexes and row_bytes >= 0")
        part = self.ledger.existing(msg.partition)
        rows = part.rows_of(msg.indexes)
        part.check_schema(msg.fields)
        sizes = field_sizes(msg.fields, len(rows), msg.row_bytes, msg.field_bytes)
        self.ledger.write_fields(part, rows, msg.fields, sizes)
        return part, rows

    def _drop_clashing(self, msg: CommitPut) -> None:
        """A put of new columns was refused after its units stored it: have them drop the
        fields whose dtype or shape clashes with the partition's, which they hold uncounted and
        which would make them refuse every correct write of the field. Only those: a unit that
        took one holds no row of that field otherwise (it would have refused the write), while a
        field of the right spec may be another consumer's write whose commit is on its way."""
        part = self.ledger.partitions.get(msg.partition)
        if part is None:
            return
        clashing = [name for name, spec in msg.fields.items() if part.schema.get(name, spec) != spec]
        live = np.asarray(msg.indexes, np.int64)[part.holds(msg.indexes)]
        if not clashing or not len(live):
            return
        units = part.unit[part.rows_of(live)]
        by_unit = {u: live[units == u].tolist() for u in np.unique(units).tolist()}
        self.links.tell_free(part.name, by_unit, clashing)

    def _open_put(self, msg: CommitPut) -> _OpenPut:
        """The open put that `msg` commits; raises why it ended if it did."""
        first = msg.indexes[0] if msg.indexes else -1
        put = self.open.get(first)
        if put is None or put.partition != msg.partition or msg.indexes != list(range(first, first + put.n)):
            ended = self._ended.get(first)
            if ended is not None:
                raise type(ended)(str(ended))
            raise SchemaError(
                f"no open put of partition {msg.partition!r} starts at index {first} with {len(msg.indexes)} samples"
            )
        return put

    def _close(self, put: _OpenPut) -> None:
        """Take a put off the clock and out of the frame window (committed or ended): it waits
        for no report any more."""
        del self.open[put.first]
        put.timer.cancel()
        put.unlanded.clear()
        self.intake.ended(put.framed, put.peer)

    # -- ends --------------------------------------------------------------------------

    def end(self, first: int, why: SluiceError) -> None:
        """Drop an open put: free its rows (never committed ones only) and remember why."""
        put = self.open.get(first)
        if put is None:
            return
        self._close(put)
        self._ended[first] = why
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        self._answer(put)  # waiting commits raise why
        part = self.ledger.partitions.get(put.partition)
        if part is not None:
            rows = part.rows_of(range(first, first + put.n), alive=False)
            self.ledger.free_rows(part, rows[~part.committed[rows]])
            self._wake(part.name)

    def peer_gone(self, peer: bytes) -> None:
        """The connection of `peer` closed: its open puts can never be committed, so end them
        now (rows freed, frame window released) instead of at their expiry."""
        for first in [k for k, put in self.open.items() if put.peer == peer]:
            self.abandoned += 1
            self.end(first, ServiceError("the producer's connection closed before it committed this put"))

    def end_in(self, partition: str, why: SluiceError) -> None:
        """End every open put of `partition` (sealed or cleared)."""
        for first in [k for k, put in self.open.items() if put.partition == partition]:
            self.end(first, why)

    def end_on(self, unit_id: int, why: SluiceError) -> None:
        """End every open put with rows on `unit_id` (it died)."""
        for first, put in list(self.open.items()):
            part = self.ledger.partitions.get(put.partition)
            if part is not None and np.any(
                part.unit[part.rows_of(range(first, first + put.n), alive=False)] == unit_id
            ):
                self.end(first, why)

    def _expire(self, first: int) -> None:
        put = self.open.get(first)
        if put is None:
            return
        self.expired += 1
        self.end(
            first,
            TimeoutError(
                f"the put of {put.n} samples into partition {put.partition!r} was not committed within "
                f"{put.lifetime:g} s (its producer stalled or died); its rows were freed: put again"
            ),
        )

    def on_abort_put(self, msg: AbortPut, data) -> Ok:
        """Free rows of a put that failed; committed rows are never touched (clear them instead)."""
        part = self.ledger.partitions.get(msg.partition)
        if part is None or not msg.indexes:
            return Ok()
        first = msg.indexes[0]
        if first in self.open:
            self.end(first, SchemaError(f"the put starting at index {first} was aborted by its producer"))
        else:
            rows = part.rows_of(msg.indexes, alive=False)
            self.ledger.free_rows(part, rows[~part.committed[rows]])
        return Ok()


def _uniform(values: list[int]) -> int | list[int]:
    """`values` as numpy assigns them fastest: the one value when all are equal (a batch's
    versions, its sequence lengths when padded), which needs no conversion of the list."""
    return values[0] if values and all_equal(values) else values
