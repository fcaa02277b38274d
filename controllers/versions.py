"""The trainer's weight version: monotone, with a bounded history so no waiter misses a step."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from transfer_queue.wire.errors import TimeoutError, VersionError

__all__ = ["VersionClock"]

_HISTORY = 4096


class VersionClock:
    """Current version, the versions set so far (newest `_HISTORY`), and parked waiters."""

    def __init__(self) -> None:
        self.current = 0
        self.history: deque[tuple[int, float]] = deque([(0, time.time())], maxlen=_HISTORY)
        self._waiters: set[tuple[int, asyncio.Future]] = set()
        """Parked `wait`s (the version they wait to pass), each removed when it ends."""

    def set(self, version: int) -> bool:
        """Advance to `version`; returns False if it is the current one already."""
        if version < self.current:
            raise VersionError(
                f"version {version} is older than the current version {self.current}; versions only grow"
            )
        if version == self.current:
            return False
        self.current = version
        self.history.append((version, time.time()))
        passed = {(after, fut) for after, fut in self._waiters if version > after}
        self._waiters -= passed
        for after, fut in passed:
            if not fut.done():
                fut.set_result(self.since(after))
        return True

    def since(self, after: int) -> list[int]:
        """Every recorded version newer than `after`, oldest first."""
        return [v for v, _ in self.history if v > after]

    async def wait(self, after: int, timeout: float) -> list[int]:
        """Versions newer than `after`, as soon as there is one."""
        if self.current > after:
            return self.since(after)
        fut = asyncio.get_running_loop().create_future()
        waiter = (after, fut)
        self._waiters.add(waiter)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"version stayed at {self.current} (waited {timeout:g}s for a version after {after})"
            ) from None
        finally:  # a wait that gave up must not stay parked until the next version
            self._waiters.discard(waiter)
