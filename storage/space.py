"""Placing a write's fields in the arena, and backpressure: writes that find the arena full wait
here, first come first served.

A write needs one chunk per field, all or nothing. A field of a frame write that no single free
extent holds is placed in up to `MAX_PIECES` extents instead, split between rows (`Piece`), so
an arena whose free bytes are scattered by a long run of small and large writes and frees still
places any write whose rows fit: only a row larger than every free extent waits. When a write
does not fit (or others already wait: no overtaking, so a large write is never starved by a
stream of small ones), the write takes its place in a FIFO at once and its handler returns a
`Ticket` to await. Whoever frees space calls `wake()`, which hands extents to waiters from the
head of the queue for as long as they fit. A waiter whose `timeout` passes first gets `CapacityError` from a `loop.call_later`
timer: nothing polls, nothing sleeps.

A waiting write can also vanish: the client withdraws it (`Cancel`) or the service stops, maybe
before its task ever ran. Whatever way its ticket goes, a finalizer takes the waiter out of the
queue and gives back chunks it may already have been handed, so neither space nor the queue's
head is ever lost to a request nobody waits for.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np

from transfer_queue.wire.errors import CapacityError

from .arena import Arena, Chunk
from .writes import Shape

__all__ = ["MAX_PIECES", "Piece", "Placed", "chunks_of", "SpaceQueue", "Ticket"]

T = TypeVar("T")

MAX_PIECES = 16
"""A field is placed in at most this many extents (each is a separate run, and a reply frame, of
every read of its rows)."""


class Piece(NamedTuple):
    """One extent of a field of a write: rows `lo` to `hi` (positions in the write), whose bytes
    start at `start` in the field's frame."""

    chunk: Chunk
    lo: int
    hi: int
    start: int


Placed = list[list[Piece]]
"""A write's extents: per field (in `Write.fields` order) its pieces, in row order."""


def chunks_of(placed: Placed) -> list[Chunk]:
    return [piece.chunk for pieces in placed for piece in pieces]


class _Waiter:
    __slots__ = ("shape", "future", "timer", "settled", "held")

    def __init__(self, shape: Shape, future: asyncio.Future, held: int):
        self.shape = shape
        self.future = future
        self.held = held  # bytes of received data frames this write keeps while it waits
        self.timer: asyncio.TimerHandle | None = None
        self.settled = False  # its chunks (or error) reached the write, or it was abandoned


class Ticket(Generic[T]):
    """A place in the queue: awaiting it gives `then(placed)` once the write's extents are allocated.

    It is a plain awaitable, not a coroutine, so a ticket that is dropped without ever being
    awaited leaves no "never awaited" coroutine behind, only its finalizer's clean-up.
    """

    __slots__ = ("_space", "_waiter", "_then", "__weakref__")

    def __init__(self, space: SpaceQueue, waiter: _Waiter, then: Callable[[Placed], T]):
        self._space = space
        self._waiter = waiter
        self._then: Callable[[Placed], T] | None = then

    def __await__(self) -> Generator[Any, None, T]:
        placed = yield from self._space._wait(self._waiter).__await__()
        then, self._then = self._then, None  # drop what `then` holds (a write's frames) before replying
        assert then is not None  # awaited once
        return then(placed)


class SpaceQueue:
    """Allocates the extents of a write now or later, in arrival order.

    `full_message(need)` builds the `CapacityError` text for a write of `need` bytes.
    """

    def __init__(self, arena: Arena, full_message: Callable[[int], str]):
        self.arena = arena
        self.full_message = full_message
        self._queue: deque[_Waiter] = deque()
        self.held = 0
        """Bytes of data frames that waiting writes keep in memory (outside the arena)."""
        self.waited = 0
        """Writes that found no room at once and joined the queue (ever)."""
        self.split = 0
        """Fields placed in several extents because no free extent held them whole (ever)."""

    def __len__(self) -> int:
        """Writes waiting for space."""
        return len(self._queue)

    def need(self, sizes: Sequence[int]) -> int:
        """Arena bytes the chunks of `sizes` occupy (each rounded up to the arena's alignment)."""
        rounded = self.arena.allocator.rounded
        return sum(rounded(s) for s in sizes)

    def alloc_now(self, shape: Shape) -> Placed | None:
        """The write's extents, if nobody waits ahead and they fit right now; else None."""
        return None if self._queue else self._alloc(shape)

    def enqueue(self, shape: Shape, timeout: float, then: Callable[[Placed], T], held: int = 0) -> Ticket[T]:
        """Join the queue now (so no later write overtakes this one) and return its ticket.

        Awaiting the ticket gives `then(placed)`, or raises `CapacityError` after `timeout` s.
        `held` is the bytes of data frames the write keeps in memory while it waits.
        """
        loop = asyncio.get_running_loop()
        waiter = _Waiter(shape, loop.create_future(), held)
        self.waited += 1
        self.held += held
        self._queue.append(waiter)
        waiter.timer = loop.call_later(max(timeout, 0.0), self._expire, waiter)
        ticket = Ticket(self, waiter, then)
        weakref.finalize(ticket, self._abandon, waiter).atexit = False
        return ticket

    async def _wait(self, waiter: _Waiter) -> Placed:
        try:
            placed = await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        except BaseException:
            waiter.settled = True
            raise
        waiter.settled = True
        return placed

    def release(self, chunks: Sequence[Chunk]) -> None:
        """Drop one reference on each chunk (the creator's) and serve waiters with what freed."""
        unref = self.arena.unref
        for chunk in chunks:
            unref(chunk)
        self.wake()

    def wake(self) -> None:
        """Serve waiting writes from the head of the queue while their chunks fit."""
        queue = self._queue
        while queue:
            head = queue[0]
            if head.future.done():  # abandoned
                self._leave(queue.popleft())
                continue
            placed = self._alloc(head.shape)
            if placed is None:
                return
            self._leave(queue.popleft())
            assert head.timer is not None
            head.timer.cancel()
            head.future.set_result(placed)

    def _abandon(self, waiter: _Waiter) -> None:
        """Nobody will take this waiter's chunks: leave the queue, give back what it got."""
        if waiter.settled:
            return
        waiter.settled = True
        if waiter.timer is not None:
            waiter.timer.cancel()
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(chunks_of(fut.result()))
            return
        fut.cancel()
        self._remove(waiter)
        self.wake()

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._remove(waiter)
        waiter.future.set_exception(CapacityError(self.full_message(self.need(waiter.shape.sizes))))
        self.wake()  # the writes behind it may fit now

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._queue.remove(waiter)
        except ValueError:
            return
        self._leave(waiter)

    def _leave(self, waiter: _Waiter) -> None:
        self.held -= waiter.held
        waiter.held = 0

    def _alloc(self, shape: Shape) -> Placed | None:
        """Each field in one extent, or (`shape.split`) in pieces; None, with nothing held, when
        a field does not fit."""
        placed: Placed = []
        for field, size in enumerate(shape.sizes):
            chunk = self.arena.new_chunk(size)
            pieces = [Piece(chunk, 0, shape.rows, 0)] if chunk is not None else None
            if pieces is None and shape.split:
                pieces = self._split(shape, field)
            if pieces is None:
                self._unref(chunks_of(placed))
                return None
            placed.append(pieces)
        return placed

    def _split(self, shape: Shape, field: int) -> list[Piece] | None:
        """The field's rows in extents of the arena, each taking as many rows as the largest free
        extent holds, up to `MAX_PIECES`; None (nothing held) when they do not fit."""
        ends = shape.ends(field)
        allocator = self.arena.allocator
        pieces: list[Piece] = []
        lo = start = 0
        while lo < len(ends) and len(pieces) < MAX_PIECES:
            hi = int(np.searchsorted(ends, start + allocator.largest_free, side="right"))
            if hi <= lo:
                break  # the next row is larger than every free extent
            end = int(ends[hi - 1])
            chunk = self.arena.new_chunk(end - start)
            assert chunk is not None, "the largest free extent holds these rows"
            pieces.append(Piece(chunk, lo, hi, start))
            lo, start = hi, end
        if lo < len(ends):
            self._unref([p.chunk for p in pieces])
            return None
        self.split += 1
        return pieces

    def _unref(self, chunks: Sequence[Chunk]) -> None:
        for chunk in chunks:
            self.arena.unref(chunk)
