"""Put intake: a `BeginPut` is placed only when its storage units have room for it.

A storage unit must never receive frame bytes it cannot place at once, or it holds them outside
its arena and grows past its capacity. So the controller, which places every new row, admits a
put only when each unit it lands on has (1) room for its bytes within the unit's capacity and
(2) room in the unit's *frame window*: the bytes of open puts that travel as data frames (not
through a co-located client's own mapping) are at most `capacity / 32` per unit, or one put when
none is open. The frames in flight to a unit then stay within about 3% of its capacity (or one
put), and with the unit's allocator settings (`transfer_queue.host.keep_freed_memory`) its memory
outside the arena within 10%.

What one `BeginPut` may make the controller hold is bounded before anything is allocated: at
most `MAX_PUT_ROWS` new rows, whose declared bytes (at least `ROW_FLOOR` a row, so a put of
empty rows is not free) fit the cluster's capacity; at most `MAX_OPEN_PUTS` open puts in all and
`MAX_OPEN_PUTS_PER_PEER` per connection; at most `MAX_WAITING` puts waiting for room. Beyond any
of them a put is refused at once with a `CapacityError` that names the limit.

Puts that do not fit wait in arrival order (no overtaking, so a large put is not starved by small
ones) until rows are freed, open puts' writes land or the puts end, or their timeout passes (the
error says what they waited for: room, `CapacityError`, or a frame window, `TimeoutError`). Placement
happens in the same step as admission, so nothing can take the room between the two. Puts of new
columns for existing rows (`put(td, meta=...)`) are admitted on capacity alone (they are not
open puts); a unit refuses at once frames beyond its own small allowance (`storage/service.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping

from transfer_queue.wire.errors import CapacityError, SluiceError
from transfer_queue.wire.messages import PutPlan, UnitInfo

__all__ = [
    "Intake",
    "WINDOW_SHARE",
    "MAX_PUT_ROWS",
    "ROW_FLOOR",
    "MAX_OPEN_PUTS",
    "MAX_OPEN_PUTS_PER_PEER",
    "MAX_WAITING",
]

WINDOW_SHARE = 32
"""A unit's frame window is its capacity / WINDOW_SHARE bytes of open puts sent as frames."""
MAX_PUT_ROWS = 1 << 16
"""New rows one put may place: with their reply, under 16 MiB of controller memory."""
ROW_FLOOR = 64
"""Bytes a row counts for at least when a put's declared size is checked against the capacity."""
MAX_OPEN_PUTS = 1 << 14
"""Open puts (placed, not yet committed or ended) in the whole cluster."""
MAX_OPEN_PUTS_PER_PEER = 1 << 10
"""Open puts of one connection (a client keeps a few; a stuck or hostile one cannot hold them all)."""
MAX_WAITING = 1 << 14
"""Puts waiting for room."""

Place = Callable[[], "PutPlan | None"]
"""Places a put now and returns its plan, or None while its units have no room (may raise)."""


class Intake:
    """The queue of puts waiting for room, and each unit's frame bytes in flight."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Place, asyncio.Future]] = deque()
        self.in_flight: dict[int, int] = {}
        """Unit id -> bytes of open puts that reach it as data frames."""
        self.open_by_peer: Counter[bytes] = Counter()
        """Connection -> its open puts."""

    def check(self, n: int, row_bytes: int, capacity: int, open_puts: int, peer: bytes) -> None:
        """Refuse a put of `n` new rows of `row_bytes` from `peer` beyond a limit (module doc).

        Raises:
            CapacityError: naming the limit."""
        if n > MAX_PUT_ROWS:
            raise CapacityError(f"a put may place at most {MAX_PUT_ROWS} new samples (MAX_PUT_ROWS), got {n}; split it")
        if n * max(row_bytes, ROW_FLOOR) > capacity:
            raise CapacityError(
                f"a put of {n} samples x {row_bytes} bytes (at least {ROW_FLOOR} counted a sample) exceeds the whole "
                f"capacity of the cluster's storage, {capacity} bytes; put smaller batches or raise storage_capacity"
            )
        if open_puts >= MAX_OPEN_PUTS:
            raise CapacityError(f"{open_puts} puts are open, the most the controller keeps (MAX_OPEN_PUTS); put again")
        if self.open_by_peer[peer] >= MAX_OPEN_PUTS_PER_PEER:
            raise CapacityError(
                f"this connection has {self.open_by_peer[peer]} puts open, the most one may (MAX_OPEN_PUTS_PER_PEER); "
                "commit or abort some first"
            )
        if len(self._queue) >= MAX_WAITING:
            raise CapacityError(f"{len(self._queue)} puts already wait for room, the most that may (MAX_WAITING)")

    def __len__(self) -> int:
        """Puts waiting for room."""
        return len(self._queue)

    def fits(
        self,
        shares: Mapping[int, int],
        framed: Mapping[int, int],
        used: Mapping[int, int],
        units: Mapping[int, UnitInfo],
    ) -> bool:
        """Whether a put of `shares` bytes per unit (`framed` of them as frames) fits now, with
        `used[unit]` bytes in use of `units[unit].capacity`."""
        for unit_id, nbytes in shares.items():
            capacity = units[unit_id].capacity
            if used[unit_id] + nbytes > capacity:
                return False
            sent = framed.get(unit_id, 0)
            flying = self.in_flight.get(unit_id, 0)
            if sent and flying and flying + sent > capacity // WINDOW_SHARE:
                return False
        return True

    def opened(self, framed: Mapping[int, int], peer: bytes) -> None:
        """Count a placed put of `peer`, and its frame bytes as in flight."""
        self.open_by_peer[peer] += 1
        for unit_id, nbytes in framed.items():
            if nbytes:
                self.in_flight[unit_id] = self.in_flight.get(unit_id, 0) + nbytes

    def ended(self, framed: Mapping[int, int], peer: bytes) -> None:
        """A put of `peer` committed or ended: it and its frames are no longer in flight."""
        self.open_by_peer[peer] -= 1
        if not self.open_by_peer[peer]:
            del self.open_by_peer[peer]
        self.closed(framed)

    def closed(self, framed: Mapping[int, int]) -> None:
        """Frames no longer in flight: stored on their unit, or their put committed or ended."""
        for unit_id, nbytes in framed.items():
            if unit_id in self.in_flight:
                self.in_flight[unit_id] = max(0, self.in_flight[unit_id] - nbytes)
        self.wake()

    def forget(self, unit_id: int) -> None:
        """A unit was retired."""
        self.in_flight.pop(unit_id, None)
        self.wake()

    def admit(self, place: Place, timeout: float, full: Callable[[], SluiceError]) -> PutPlan | Awaitable[PutPlan]:
        """The plan, placed now if nobody waits ahead and it fits; else an awaitable of it that
        waits in line for room (the common case costs no task).

        Raises (or the awaitable raises) the error `full()` makes (naming what the put waited
        for) when no room came within `timeout` seconds, and whatever `place` raises (a sealed
        partition, a schema conflict)."""
        if not self._queue:
            plan = place()
            if plan is not None:
                return plan
        return self._wait(place, timeout, full)

    async def _wait(self, place: Place, timeout: float, full: Callable[[], SluiceError]) -> PutPlan:
        fut = asyncio.get_running_loop().create_future()
        entry = (place, fut)
        self._queue.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise full() from None
        finally:
            if not fut.done():  # timed out or withdrawn: leave the line, let the next one try
                fut.cancel()
                self._queue.remove(entry)
                self.wake()
            # withdrawn after it was placed: its open put expires at its deadline like any other

    def wake(self) -> None:
        """Place waiting puts from the head of the line while they fit."""
        queue = self._queue
        while queue:
            place, fut = queue[0]
            try:
                plan = place()
            except Exception as exc:  # noqa: BLE001 - the waiting handler raises it
                queue.popleft()
                fut.set_exception(exc)
                continue
            if plan is None:
                return
            queue.popleft()
            fut.set_result(plan)
