"""Put intake: a `BeginPut` is placed only when its storage units have room for it.

A storage unit must never receive frame bytes it cannot place at once, or it holds them outside
its arena and grows past its capacity. So the controller, which places every new row, admits a
put only when each unit it lands on has (1) room for its bytes within the unit's capacity and
(2) room in the unit's *frame window*: the bytes of open puts that travel as data frames (not
through a co-located client's own mapping) are at most `capacity / 32` per unit, or one put when
none is open. The frames in flight to a unit then stay within about 3% of its capacity (or one
put), and with the unit's allocator settings (`transfer_queue.host.keep_freed_memory`) its memory
outside the arena within 10%.

Puts that do not fit wait in arrival order (no overtaking, so a large put is not starved by small
ones) until rows are freed or open puts end, or their timeout passes (`CapacityError`). Placement
happens in the same step as admission, so nothing can take the room between the two. Puts of new
columns for existing rows (`put(td, meta=...)`) are admitted on capacity alone (they are not
open puts); a unit refuses at once frames beyond its own small allowance (`storage/service.py`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Mapping

from transfer_queue.wire.errors import CapacityError
from transfer_queue.wire.messages import PutPlan, UnitInfo

__all__ = ["Intake", "WINDOW_SHARE"]

WINDOW_SHARE = 32
"""A unit's frame window is its capacity / WINDOW_SHARE bytes of open puts sent as frames."""

Place = Callable[[], "PutPlan | None"]
"""Places a put now and returns its plan, or None while its units have no room (may raise)."""


class Intake:
    """The queue of puts waiting for room, and each unit's frame bytes in flight."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Place, asyncio.Future]] = deque()
        self.in_flight: dict[int, int] = {}
        """Unit id -> bytes of open puts that reach it as data frames."""

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

    def opened(self, framed: Mapping[int, int]) -> None:
        """Count a placed put's frame bytes as in flight."""
        for unit_id, nbytes in framed.items():
            if nbytes:
                self.in_flight[unit_id] = self.in_flight.get(unit_id, 0) + nbytes

    def closed(self, framed: Mapping[int, int]) -> None:
        """A put committed or ended: its frames are no longer in flight."""
        for unit_id, nbytes in framed.items():
            if unit_id in self.in_flight:
                self.in_flight[unit_id] = max(0, self.in_flight[unit_id] - nbytes)
        self.wake()

    def forget(self, unit_id: int) -> None:
        """A unit was retired."""
        self.in_flight.pop(unit_id, None)
        self.wake()

    def admit(self, place: Place, timeout: float, full: Callable[[], str]) -> PutPlan | Awaitable[PutPlan]:
        """The plan, placed now if nobody waits ahead and it fits; else an awaitable of it that
        waits in line for room (the common case costs no task).

        Raises (or the awaitable raises) `CapacityError` (text from `full()`) when no room came
        within `timeout` seconds, and whatever `place` raises (a sealed partition, a schema
        conflict)."""
        if not self._queue:
            plan = place()
            if plan is not None:
                return plan
        return self._wait(place, timeout, full)

    async def _wait(self, place: Place, timeout: float, full: Callable[[], str]) -> PutPlan:
        fut = asyncio.get_running_loop().create_future()
        entry = (place, fut)
        self._queue.append(entry)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise CapacityError(full()) from None
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
