"""The storage-unit service: one handler per `StorageRequest`.

A unit holds tensor rows of any number of partitions in one shared-memory arena (`arena`),
indexed by (partition, field, global index) (`table`). Writes arrive as raw data frames (one per
field) or, for co-located clients, as a reservation the client fills through its own mapping and
then commits (`writes`). A large field's frame is staged: kept as received and served from there
until it must be copied into the arena (`staging`), so a batch freed soon after its put costs no
copy at all. A full arena parks writes in a FIFO until space frees up or their timeout passes
(`space`). Reads answer with arena runs, and with zero-copy frames of them (or of staged frames)
unless the client maps the arena itself.

A write of an open put's new rows (`Write.put`) also reports its outcome to the controller
(`WriteLanded`, posted over the channel the unit registered on), which commits the put once every
unit of it reported the bytes stored.

Handlers answer at once when they can; only a write that must wait for space becomes a task.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Generator
from typing import Any

import msgspec
import zmq

from transfer_queue.host import give_back_freed_memory
from transfer_queue.wire.auth import WriteTickets
from transfer_queue.wire.errors import CapacityError, ProtocolError, SchemaError, ServiceError, TimeoutError
from transfer_queue.wire.messages import (
    CommitWrite,
    Free,
    Ok,
    Read,
    ReadReply,
    StatusReply,
    StorageRequest,
    UnitStatus,
    Write,
    WriteLanded,
    WriteReply,
)
from transfer_queue.wire.rpc import (
    MAX_DATA_FRAMES,
    AsyncChannel,
    AsyncLocalChannel,
    Codec,
    Credentials,
    Handled,
    Service,
    error_reply,
)

from .arena import Arena, Chunk
from .space import Piece, Placed, SpaceQueue, Ticket, chunks_of
from .staging import Staging
from .table import Table
from .writes import Reservation, Shape, check_frames, field_sizes

__all__ = ["StorageUnit"]

_TRIM_EVERY = 1.0  # seconds between checks for freed frame memory to give back
_LATE_REPLY_BYTES = 1 << 20
"""Writes of this many frame bytes or more are answered after their frames were dropped: the answer
(a reply, or a put write's report to the controller) lets the controller admit the next put to this
unit, whose frames must not arrive while these are still held (a unit thread preempted between
answering and dropping them)."""
_HELD_SHARE = 20
"""Received frames kept outside the arena (writes waiting for space, and staged frames) stay
within capacity / _HELD_SHARE bytes (or one write)."""
_EXPIRED_KEPT = 4096  # expired reservation tokens remembered, to tell "expired" from "unknown"


class StorageUnit(Service):
    """A storage unit bound to `tcp://{host}:*`, holding up to `capacity` bytes of rows.

    Raises `FileExistsError` when the arena file already exists (another unit of the same
    cluster id and unit id) and `MemoryError` when /dev/shm cannot hold `capacity` bytes.
    """

    def __init__(
        self,
        unit_id: int,
        capacity: int,
        cluster_id: str,
        host: str = "127.0.0.1",
        credentials: Credentials | None = None,
    ):
        self.unit_id = unit_id
        self.arena = Arena.create(cluster_id, unit_id, capacity)
        try:
            # no lane with credentials: as the controller (controllers/service.py)
            super().__init__(
                Codec(StorageRequest), f"tcp://{host}:*", self.arena.capacity, credentials, local=credentials is None
            )
        except BaseException:
            self.arena.close()
            raise
        self.table = Table(self.arena, unit_id)
        self.space = SpaceQueue(self.arena, self._full_message)
        self.reservations: dict[int, Reservation] = {}
        self._controller: tuple[AsyncChannel, str] | None = None
        self._controller_lane: AsyncLocalChannel | None = None
        self._tickets: WriteTickets | None = None
        self.unplanned = 0
        """Writes refused because the controller did not plan them (no valid ticket)."""
        self._expired: OrderedDict[int, float] = OrderedDict()
        self._next_token = 1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._trimmer: asyncio.TimerHandle | None = None
        self._received = 0
        """Bytes of write frames received."""
        self._closed = False
        self.staging = Staging(self.arena)
        self.route(Write, self._on_write)
        self.route(CommitWrite, self._on_commit)
        self.route(Read, self._on_read)
        self.route(Free, self._on_free)
        self.route(UnitStatus, self._on_status)

    @property
    def shm_path(self) -> str:
        return self.arena.path

    async def serve(self) -> None:
        """Pre-fault the arena in the background, serve until `stop()`, then close the arena."""
        self._loop = asyncio.get_running_loop()
        self.arena.start_prefault()
        self._trimmer = self._loop.call_later(_TRIM_EVERY, self._trim, self._received, False)
        try:
            await super().serve()
        finally:
            self.close()

    def close(self) -> None:
        """Drop pending reservations and unlink the arena file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._trimmer is not None:
            self._trimmer.cancel()
        for res in self.reservations.values():
            res.timer.cancel()
        self.reservations.clear()
        self.staging.clear()
        if not self.sock.closed:
            self.sock.close(linger=0)
        if self._controller is not None:
            self._controller[0].close()
        if self._controller_lane is not None:
            self._controller_lane.close()
        self.arena.close()

    def _trim(self, received_before: int, busy: bool) -> None:
        """Loop timer: once a second without write frames follows traffic, give freed frame memory
        back to the system if more than 5% of capacity of it is free, so that after a burst the
        unit's RSS is again within capacity + ~10%. While frames keep coming they reuse the freed
        blocks: trimming then only made them land in fresh pages."""
        quiet = self._received == received_before
        if quiet and busy:
            give_back_freed_memory(self.arena.capacity // 20)
        assert self._loop is not None  # set when the unit starts serving
        self._trimmer = self._loop.call_later(_TRIM_EVERY, self._trim, self._received, not quiet)

    # -- Write / CommitWrite -------------------------------------------------------------

    def _on_write(self, msg: Write, frames: list[Any]) -> Handled | Awaitable[Handled | None] | None:
        """Store (or reserve) a write. One of an open put's new rows is a notice: it reports how it
        ended to the controller (`_land`), and its producer hears only a refusal.

        Raises:
            ProtocolError: (not reported) the write is of an open put's rows and, on a unit
                registered with a controller, lacks the ticket of the controller's plan: nothing
                of it is stored."""
        self._check_ticket(msg)
        try:
            handled = self._write(msg, frames)
        except Exception as exc:  # noqa: BLE001 - reported as the service answers it, then raised
            self._land(msg, exc)
            raise
        if msg.put < 0 or not isinstance(handled, Ticket):
            return handled
        return self._reported(msg, handled)

    def _check_ticket(self, msg: Write) -> None:
        """Raise `ProtocolError` (counted in `unplanned`) if `msg` writes an open put's rows
        without the ticket of the controller's plan (on a unit registered with a controller)."""
        if (
            msg.put >= 0
            and self._tickets is not None
            and not self._tickets.valid(msg.ticket, msg.partition, msg.put, self.unit_id, msg.indexes, msg.fields)
        ):
            self.unplanned += 1
            raise ProtocolError(
                f"storage unit {self.unit_id} refused a write of {len(msg.indexes)} rows of partition "
                f"{msg.partition!r} for put {msg.put}: the controller did not place these rows and fields "
                "here (no valid ticket from its PutPlan)"
            )

    async def _reported(self, msg: Write, ticket: Ticket[Handled | None]) -> Handled | None:
        """A put's write waiting for space: its failure or withdrawal is reported too."""
        try:
            return await ticket
        except Exception as exc:  # noqa: BLE001 - reported as the service answers it, then raised
            self._land(msg, exc)
            raise
        except asyncio.CancelledError:
            self._land(msg, ServiceError(f"the write to storage unit {self.unit_id} was withdrawn by its producer"))
            raise

    def report_to(self, controller: AsyncChannel, secret: str, lane: AsyncLocalChannel | None = None) -> None:
        """Report the outcome of put writes to `controller` (the channel the unit registered on),
        and from now on store an open put's rows only with its ticket (signed with `secret`);
        over the controller's local `lane` while it is open (a controller that restarts comes
        back on `controller`'s address, not on its old lane)."""
        self._controller = controller, secret
        self._controller_lane = lane
        self._tickets = WriteTickets(secret)

    def _land(self, msg: Write, error: BaseException | None = None, new_rows: bool = False, now: bool = False) -> None:
        """Tell the controller how a put's write ended, once the handler returned and with it the
        write's frames (dropped, or staged within their share of memory), or `now` for a write
        that carried none: the report lets the controller commit the put and admit the next one
        to this unit, whose frames must not arrive while this write's are still held (what
        `_LATE_REPLY_BYTES` does for replies). A
        write refused before its handler ran (undecodable) cannot be reported: its put ends at its
        producer's commit timeout.

        New columns (`put` -1) are reported only when stored for rows this unit did not hold
        (`new_rows`, a keyed sample's first field, or rows nobody placed): the controller frees
        those of them that are no live sample of the partition, so a unit never keeps them."""
        if self._controller is None or (msg.put < 0 and (error is not None or not new_rows)):
            return
        _, secret = self._controller
        failed = None if error is None else error_reply(error)  # what the producer is answered
        code, message = ("", "") if failed is None else (failed.code, failed.message)
        report = WriteLanded(self.unit_id, msg.partition, msg.put, msg.indexes, secret, code, message)
        if now:
            self._report(report)
        else:
            asyncio.get_running_loop().call_soon(self._report, report)

    def _report(self, report: WriteLanded) -> None:
        """Post `report` to the controller: over its local lane while that is open, else over
        ZeroMQ, decided as it is sent (an ended lane drops what is posted to it)."""
        assert self._controller is not None  # reports are made only once it is known
        lane = self._controller_lane
        if lane is not None and not lane.closed:
            lane.post(report)
        else:
            self._controller[0].post(report)

    def _write(self, msg: Write, frames: list[Any]) -> Handled | Awaitable[Handled] | Ticket[Handled | None] | None:
        sizes = field_sizes(msg)
        check_frames(msg, frames, sizes)
        if frames:
            self._received += sum(sizes)
        self.table.check_specs(msg.partition, msg.fields)
        need = self.space.need(sizes)
        if need > self.arena.capacity:
            raise CapacityError(
                f"a write of {need} bytes to partition {msg.partition!r} can never fit storage unit "
                f"{self.unit_id} of {self.arena.capacity} bytes; split the put or raise storage_capacity"
            )
        if msg.ahead and (msg.via != "shm" or msg.put >= 0):
            raise SchemaError("only a mapped write of no put yet (Write.put -1) may reserve space ahead")
        shape = Shape(msg, sizes)
        placed = self.space.alloc_now(shape)
        if placed is None and msg.ahead:  # its producer must not wait holding a put's BeginPut
            raise CapacityError(self._full_message(need, "; space reserved ahead is never waited for"))
        if placed is not None:
            reply = self._store(msg, frames, placed)
            if reply is not None and msg.via == "frames" and sum(sizes) >= _LATE_REPLY_BYTES:
                return _Answer(reply)  # the frames go before the reply, not after the next put's arrive
            return reply
        # Wait for space, in line. Waiting writes keep their frames in memory outside the arena,
        # so they may hold at most capacity / _HELD_SHARE bytes (or one write): the controller
        # admits a put only when its units have room, so waits here are short (a Free still on
        # its way, page rounding) and anything beyond is refused at once, never buffered.
        held = sum(sizes) if msg.via == "frames" else 0
        if held and self.space.held and self.space.held + held > self.arena.capacity // _HELD_SHARE:
            why = f" and {self.space.held} bytes of written frames already wait for space, so this write is refused at once"
            raise CapacityError(self._full_message(need, why))
        return self.space.enqueue(shape, msg.timeout, lambda got: self._store(msg, frames, got), held)

    def _store(self, msg: Write, frames: list[Any], placed: Placed) -> Handled | None:
        """Store frames into freshly allocated extents (`staging`) and register the rows, or
        reserve them (a shm write's fields are never split: one piece each)."""
        if msg.via == "shm":
            return self._reserve(msg, [pieces[0].chunk for pieces in placed])
        try:
            self.table.check_specs(msg.partition, msg.fields)  # may have changed while it waited
        except SchemaError:
            self.space.release(chunks_of(placed))
            raise  # reported by whoever called (`_on_write`, `_reported`)
        self.staging.store(placed, frames)
        self._register(msg, placed)
        self.staging.keep(self.arena.capacity // _HELD_SHARE - self.space.held)
        return _answer(msg, WriteReply())

    def _register(self, msg: Write, placed: Placed) -> None:
        """Register the rows of a stored write and report it (`_land`). A mapped write holds no
        frames, so its report goes first, in this same step: the controller's handling of it runs
        beside the registration, and no request is served here before the rows are in place."""
        new_rows = msg.put < 0 and self._controller is not None and not self.table.holds(msg.partition, msg.indexes)
        mapped = msg.via == "shm"
        if mapped:
            self._land(msg, new_rows=new_rows, now=True)
        for (name, spec), pieces in zip(msg.fields.items(), placed):
            lengths = msg.lengths.get(name) if spec.ragged else None
            for chunk, lo, hi, _ in pieces:
                part = None if lengths is None else lengths[lo:hi]
                self.table.insert(msg.partition, name, spec, msg.indexes[lo:hi], chunk, part)
        self.space.release(chunks_of(placed))  # the creator's references; replaced rows may have freed space
        if not mapped:
            self._land(msg, new_rows=new_rows)

    def _reserve(self, msg: Write, chunks: list[Chunk]) -> WriteReply:
        token = self._next_token
        self._next_token += 1
        loop = asyncio.get_running_loop()
        timer = loop.call_later(max(msg.timeout, 0.0), self._expire_reservation, token)
        self.reservations[token] = Reservation(token, msg, chunks, timer)
        return WriteReply(token=token, offsets={name: c.offset for name, c in zip(msg.fields, chunks)})

    def _expire_reservation(self, token: int) -> None:
        res = self.reservations.pop(token, None)
        if res is None:
            return
        self._expired[token] = res.msg.timeout
        while len(self._expired) > _EXPIRED_KEPT:
            self._expired.popitem(last=False)
        self.space.release(res.chunks)
        self._land(res.msg, TimeoutError(f"reservation {token} on storage unit {self.unit_id} was never committed"))

    def _on_commit(self, msg: CommitWrite, frames: list[Any]) -> Handled | None:
        """Register a filled reservation, or drop it (`abort`); for an open put's rows a notice
        (reported to the controller instead)."""
        _no_frames(msg, frames)
        res = self.reservations.pop(msg.token, None)
        if res is None:
            if msg.abort:
                return Ok()  # aborting is idempotent; an expired reservation is already freed
            if msg.token in self._expired:
                raise TimeoutError(
                    f"reservation {msg.token} on storage unit {self.unit_id} expired: it was not "
                    f"committed within its timeout of {self._expired[msg.token]} s and its space was "
                    "freed; write again (with a longer timeout)"
                )
            raise SchemaError(
                f"storage unit {self.unit_id} has no reservation {msg.token} (never made or already committed)"
            )
        res.timer.cancel()
        if msg.abort:
            self.space.release(res.chunks)
            self._land(res.msg, ServiceError(f"the write to storage unit {self.unit_id} was aborted by its producer"))
            return Ok()  # answered even for a put's rows: a withdrawn reservation is given back this way
        try:
            write = self._taken(res.msg, msg)
        except (SchemaError, ProtocolError):  # not reported: these are no planned rows of a put
            self.space.release(res.chunks)
            raise
        try:
            self.table.check_specs(write.partition, write.fields)
        except SchemaError as exc:
            self.space.release(res.chunks)
            self._land(write, exc)
            raise
        rows = len(write.indexes)
        self._register(write, [[Piece(chunk, 0, rows, 0)] for chunk in res.chunks])
        return _answer(write, Ok())

    def _taken(self, write: Write, commit: CommitWrite) -> Write:
        """The write a commit registers: the reserved one, or for space reserved ahead the put's
        rows that `commit` names (checked as a put's `Write` is).

        Raises:
            SchemaError: the commit names rows where it must not, or not the reservation's count.
            ProtocolError: the rows lack the ticket of the controller's plan (`unplanned`)."""
        if not write.ahead:
            if commit.put >= 0 or commit.indexes:
                raise SchemaError("only space reserved ahead (Write.ahead) is committed with a put's rows")
            return write
        n = len(write.indexes)
        if commit.put < 0 or len(commit.indexes) != n or len(set(commit.indexes)) != n:
            raise SchemaError(
                f"space reserved ahead for {n} rows is committed with put {commit.put} and "
                f"{len(commit.indexes)} indexes; it needs the put and its {n} distinct rows here"
            )
        taken = msgspec.structs.replace(
            write, indexes=commit.indexes, put=commit.put, ticket=commit.ticket, ahead=False
        )
        self._check_ticket(taken)
        return taken

    # -- Read ----------------------------------------------------------------------------

    def _on_read(self, msg: Read, frames: list[Any]) -> Handled:
        _no_frames(msg, frames)
        if len(set(msg.fields)) != len(msg.fields):
            raise SchemaError(f"read of partition {msg.partition!r} lists a field twice: {msg.fields}")
        plan = self.table.read(msg.partition, msg.indexes, msg.fields)
        reply = ReadReply(lengths=plan.lengths, runs=plan.runs)
        for chunks in plan.chunks:  # a mapped reader reads the arena; a run over chunks is one view of it
            if msg.via == "shm" or len(chunks) > 1:
                self.staging.copy(chunks)
        if msg.via == "shm":
            return reply
        if len(plan.chunks) > MAX_DATA_FRAMES:
            raise SchemaError(
                f"this read spans {len(plan.chunks)} separate arena runs, more than the "
                f"{MAX_DATA_FRAMES} frames one message may carry; read fewer rows per request"
            )
        runs = (run for name in msg.fields for run in plan.runs[name])
        return reply, [self._frame(off, n, chunks) for (off, n), chunks in zip(runs, plan.chunks)]

    def _frame(self, offset: int, nbytes: int, chunks: list[Chunk]) -> Any:
        """A reply frame of arena bytes.

        Frames below ZeroMQ's copy threshold are copied while the reply is sent. Larger ones
        are sent zero-copy, so their chunks stay referenced until ZeroMQ drops the frame: a Free
        or a replacing Write meanwhile cannot hand the bytes to a new write before they left.
        """
        staged = chunks[0].staged
        source = self.arena.array if staged is None else staged
        start = offset if staged is None else offset - chunks[0].offset
        if nbytes < zmq.COPY_THRESHOLD:
            return source[start : start + nbytes].data
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        frame = source[start : start + nbytes]
        for chunk in chunks:
            chunk.refs += 1
        weakref.finalize(frame, self._unpin_soon, chunks).atexit = False
        return frame

    def _unpin_soon(self, chunks: list[Chunk]) -> None:
        # Runs in whichever thread drops the frame last (pyzmq's garbage-collector thread).
        loop = self._loop
        if loop is None or self._closed:
            return
        try:
            loop.call_soon_threadsafe(self._unpin, chunks)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _unpin(self, chunks: list[Chunk]) -> None:
        if not self._closed:
            self.space.release(chunks)
            self.staging.drop_freed()

    # -- Free / UnitStatus ---------------------------------------------------------------

    def _on_free(self, msg: Free, frames: list[Any]) -> Handled:
        _no_frames(msg, frames)
        if self.table.remove(msg.partition, msg.indexes, msg.fields):
            self.staging.drop_freed()
            self.space.wake()
        return Ok()

    def _on_status(self, msg: UnitStatus, frames: list[Any]) -> Handled:
        _no_frames(msg, frames)
        return StatusReply(status=self.status())

    def status(self) -> dict[str, Any]:
        """A snapshot of the unit: capacity, bytes in use, rows per partition, queues, counters."""
        alloc = self.arena.allocator
        return {
            "unit_id": self.unit_id,
            "address": self.address,
            "shm_path": self.arena.path,
            "capacity": alloc.capacity,
            "used": alloc.used,
            "free": alloc.free_bytes,
            "largest_free": alloc.largest_free,
            "align": alloc.align,
            "free_extents": len(alloc.extents()),
            "prefaulted": self.arena.prefaulted,
            "rows": self.table.row_counts(),
            "pending_writes": len(self.space),
            "writes_waited": self.space.waited,
            "fields_split": self.space.split,
            "pending_bytes": self.space.held,
            "staged_bytes": self.staging.bytes,
            "unstaged_bytes": self.staging.copied,
            "reservations": len(self.reservations),
            "reserved_bytes": sum(r.nbytes for r in self.reservations.values()),
            "rejected": self.rejected,
            "unplanned": self.unplanned,
            "auth_refused": self.auth_refused,
            "served": self.served,
        }

    def _full_message(self, need: int, why: str = "") -> str:
        alloc = self.arena.allocator
        return (
            f"storage unit {self.unit_id} is full: {alloc.used} of {alloc.capacity} bytes used "
            f"(this write needs {need} bytes, the largest free extent is {alloc.largest_free}){why}; "
            "clear consumed samples or raise storage_capacity"
        )


class _Answer:
    """An awaitable of a ready `reply`: the service loop sends it once the handler (and the data
    frames it was given) is gone. Not a coroutine, so dropping one unawaited warns of nothing."""

    __slots__ = ("reply",)

    def __init__(self, reply: Handled):
        self.reply = reply

    def __await__(self) -> Generator[Any, None, Handled]:
        return self.reply
        yield  # a generator: returns at once


def _answer(msg: Write, reply: Handled) -> Handled | None:
    """`reply`, or None for the rows of an open put: the controller hears of them (`WriteLanded`)."""
    return None if msg.put >= 0 else reply


def _no_frames(msg: Any, frames: list[Any]) -> None:
    if frames:
        raise ProtocolError(f"{type(msg).__name__} carries no data frames, got {len(frames)}")
