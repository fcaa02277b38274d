"""Backpressure: writes that find the arena full wait here, first come first served.

A write needs one chunk per field, all or nothing. When they do not fit (or others already
wait: no overtaking, so a large write is never starved by a stream of small ones), the write
takes its place in a FIFO at once and its handler returns a `Ticket` to await. Whoever frees
space calls `wake()`, which hands chunks to waiters from the head of the queue for as long as
they fit. A waiter whose `timeout` passes first gets `CapacityError` from a `loop.call_later`
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
from typing import Any, Generic, TypeVar

from transfer_queue.wire.errors import CapacityError

from .arena import Arena, Chunk

__all__ = ["SpaceQueue", "Ticket"]

T = TypeVar("T")


class _Waiter:
    __slots__ = ("sizes", "future", "timer", "settled", "held")

    def __init__(self, sizes: Sequence[int], future: asyncio.Future, held: int):
        self.sizes = sizes
        self.future = future
        self.held = held  # bytes of received data frames this write keeps while it waits
        self.timer: asyncio.TimerHandle | None = None
        self.settled = False  # its chunks (or error) reached the write, or it was abandoned


class Ticket(Generic[T]):
    """A place in the queue: awaiting it gives `then(chunks)` once the write's chunks are allocated.

    It is a plain awaitable, not a coroutine, so a ticket that is dropped without ever being
    awaited leaves no "never awaited" coroutine behind, only its finalizer's clean-up.
    """

    __slots__ = ("_space", "_waiter", "_then", "__weakref__")

    def __init__(self, space: SpaceQueue, waiter: _Waiter, then: Callable[[list[Chunk]], T]):
        self._space = space
        self._waiter = waiter
        self._then = then

    def __await__(self) -> Generator[Any, None, T]:
        chunks = yield from self._space._wait(self._waiter).__await__()
        then, self._then = self._then, None  # drop what `then` holds (a write's frames) before replying
        return then(chunks)


class SpaceQueue:
    """Allocates the chunks of a write now or later, in arrival order.

    `full_message(need)` builds the `CapacityError` text for a write of `need` bytes.
    """

    def __init__(self, arena: Arena, full_message: Callable[[int], str]):
        self.arena = arena
        self.full_message = full_message
        self._queue: deque[_Waiter] = deque()
        self.held = 0
        """Bytes of data frames that waiting writes keep in memory (outside the arena)."""

    def __len__(self) -> int:
        """Writes waiting for space."""
        return len(self._queue)

    def need(self, sizes: Sequence[int]) -> int:
        """Arena bytes the chunks of `sizes` occupy (each rounded up to the arena's alignment)."""
        rounded = self.arena.allocator.rounded
        return sum(rounded(s) for s in sizes)

    def alloc_now(self, sizes: Sequence[int]) -> list[Chunk] | None:
        """The chunks, if nobody waits ahead and they fit right now; else None."""
        return None if self._queue else self._alloc(sizes)

    def enqueue(
        self, sizes: Sequence[int], timeout: float, then: Callable[[list[Chunk]], T], held: int = 0
    ) -> Ticket[T]:
        """Join the queue now (so no later write overtakes this one) and return its ticket.

        Awaiting the ticket gives `then(chunks)`, or raises `CapacityError` after `timeout` s.
        `held` is the bytes of data frames the write keeps in memory while it waits.
        """
        loop = asyncio.get_running_loop()
        waiter = _Waiter(sizes, loop.create_future(), held)
        self.held += held
        self._queue.append(waiter)
        waiter.timer = loop.call_later(max(timeout, 0.0), self._expire, waiter)
        ticket = Ticket(self, waiter, then)
        weakref.finalize(ticket, self._abandon, waiter).atexit = False
        return ticket

    async def _wait(self, waiter: _Waiter) -> list[Chunk]:
        try:
            chunks = await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        except BaseException:
            waiter.settled = True
            raise
        waiter.settled = True
        return chunks

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
            chunks = self._alloc(head.sizes)
            if chunks is None:
                return
            self._leave(queue.popleft())
            assert head.timer is not None
            head.timer.cancel()
            head.future.set_result(chunks)

    def _abandon(self, waiter: _Waiter) -> None:
        """Nobody will take this waiter's chunks: leave the queue, give back what it got."""
        if waiter.settled:
            return
        waiter.settled = True
        if waiter.timer is not None:
            waiter.timer.cancel()
        fut = waiter.future
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            self.release(fut.result())
            return
        fut.cancel()
        self._remove(waiter)
        self.wake()

    def _expire(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._remove(waiter)
        waiter.future.set_exception(CapacityError(self.full_message(self.need(waiter.sizes))))
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

    def _alloc(self, sizes: Sequence[int]) -> list[Chunk] | None:
        chunks: list[Chunk] = []
        for size in sizes:
            chunk = self.arena.new_chunk(size)
            if chunk is None:
                for c in chunks:
                    self.arena.unref(c)
                return None
            chunks.append(chunk)
        return chunks
