"""What a client operation is, written once for both drivers (`_drivers`): a *flow* yields the
`Call`s of one step (sent in parallel) and receives their replies until it returns its result;
a *plan* is an iterator a client hands out (`stream`, `versions`), a generator of the steps
below. Nothing here touches a socket.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

from .wire.rpc import GRACE, Message

__all__ = ["CONTROLLER", "Call", "Flow", "Plan", "Run", "Launch", "Finish", "Withdraw", "Give"]

CONTROLLER = -1
"""`Call.target` of the controller; storage units are addressed by their unit id."""


@dataclass(frozen=True)
class Call:
    """One request of a flow: `msg` (and raw `data` frames) to `target`, awaited `wait` s."""

    target: int
    msg: Message
    data: Sequence[Any] = ()
    wait: float | None = GRACE
    """Seconds to wait for the reply (None: as long as the service is alive)."""
    notice: bool = False
    """Posted, not awaited: the service answers only a refusal, and reports that its own way
    (a put's write fails its commit). Its reply in the flow is `NOTICED`."""


Flow = Generator[list[Call], list[tuple[Any, list[Any]]], Any]

NOTICED: tuple[Any, list[Any]] = (None, [])
"""The reply a flow gets for a notice."""


@dataclass(frozen=True)
class Run:
    """A plan's step: drive `flow` to its end; the plan receives its result."""

    flow: Flow


@dataclass(frozen=True)
class Launch:
    """A plan's step: start `flow` and leave it in flight; the plan receives a handle to
    `Finish` or `Withdraw` later."""

    flow: Flow


@dataclass(frozen=True)
class Finish:
    """A plan's step: the result of a launched flow, once it has ended."""

    task: Any


@dataclass(frozen=True)
class Withdraw:
    """A plan's step: withdraw a launched flow (its clean-up runs); the plan receives its
    result if it had already ended, else None."""

    task: Any


@dataclass(frozen=True)
class Give:
    """A plan's step: hand `item` to the caller iterating the plan."""

    item: Any


Plan = Generator[Run | Launch | Finish | Withdraw | Give, Any, None]
"""An iterator a client hands out (`stream`, `versions`), written once: a generator of the
steps above, driven by either driver's `_iterate`. When the caller stops iterating,
`GeneratorExit` is thrown in at its `Give`, so that its clean-up steps still run."""
