"""Landings: the outcome of each open put's write, told to the controller that commits the put.

A producer sends its writes and its `CommitPut` at the same time; the controller commits the new
rows only once every unit of the put answered its `AwaitWrite` with `Ok` (the rows are stored) or
ends the put with the unit's error. The `AwaitWrite` is sent when the put is placed, so it almost
always arrives before the write; an outcome that comes first is kept until it is asked for (at
most `KEPT` of them: one whose controller never asks, after a restart, is forgotten in time).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable

from transfer_queue._errors import SluiceError, TimeoutError
from transfer_queue._messages import Ok

__all__ = ["Landings"]

KEPT = 4096
"""Outcomes remembered while nobody asks for them."""

Key = tuple[str, int]
"""(partition, first index of the put)."""


class Landings:
    """Outcomes of open puts' writes on one unit, and the controller's requests waiting for them."""

    def __init__(self, unit_id: int):
        self.unit_id = unit_id
        self._outcomes: OrderedDict[Key, SluiceError | None] = OrderedDict()
        self._waiting: dict[Key, asyncio.Future] = {}

    def __len__(self) -> int:
        """Requests waiting for a write."""
        return len(self._waiting)

    def wait(self, key: Key, timeout: float) -> Ok | Awaitable[Ok]:
        """`Ok` once the write of `key` is stored; raises its error if it failed.

        Raises:
            TimeoutError: no write of `key` arrived within `timeout` seconds (the producer died
                or stalled; the controller expires the put)."""
        if key in self._outcomes:
            error = self._outcomes.pop(key)
            if error is not None:
                raise error
            return Ok()
        fut = self._waiting.get(key)
        if fut is None:
            fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        return self._await(key, fut, timeout)

    async def _await(self, key: Key, fut: asyncio.Future, timeout: float) -> Ok:
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"the write of the put at index {key[1]} of partition {key[0]!r} did not reach storage unit "
                f"{self.unit_id} within {timeout:g} s"
            ) from None
        finally:
            if self._waiting.get(key) is fut:
                del self._waiting[key]
        return Ok()

    def landed(self, key: Key, error: SluiceError | None = None) -> None:
        """Record the write of `key` stored (`error` None) or failed, answering whoever waits."""
        fut = self._waiting.pop(key, None)
        if fut is not None:
            if not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)
            return
        self._outcomes[key] = error
        self._outcomes.move_to_end(key)
        while len(self._outcomes) > KEPT:
            self._outcomes.popitem(last=False)
