"""Tests wait on observable state (a status counter, a queue event), never on a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually"]


def eventually(check: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Wait until `check()` (a look at observable state) is truthy and return it; fail after
    `timeout` s. It looks every 20 ms: the wait ends as soon as the state is reached."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)
