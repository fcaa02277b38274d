"""Admission control for producers: AReaL's generation-slot budget.

A producer asks for generation slots before it generates. Slots are granted only while (but
for `lend`, below)

    accepted + running + n <= (max_staleness + version + 1) * consumer_batch_size

where `accepted` counts samples put under a grant (less those dropped or requeued as stale, which
must be generated again) and `running` the slots granted but not yet put. Requests wait in FIFO
order without polling: a version bump or returned slots re-run `pump`. A grant that is not
used up within `grant_timeout` (its producer died or gave up) returns its slots. Grants live
only as long as the controller: a put under a grant its predecessor made (before a restart) counts
as accepted, like one under an expired grant.

`consumer_batch_size` means what AReaL means by it: the samples the trainer consumes per version.
A setting below the truth starves the trainer for good once the η versions of slack are used up
(with the trainer waiting for samples that admission will not let in until the trainer publishes
a version). So by default the budget follows the consumers (`follow_consumers`): when admission
is what holds a consumer's request back (`holds_back`), the scheduler reports that consumer's
demand under the current version, that is the granted samples one task was handed from one
partition since the version began and did not give back plus the batches it is waiting for; and
`consumer_batch_size` grows to the largest demand seen (never below the configured value, never
shrinking). A grant names no partition, so every partition fed under grants draws on this one
budget: the demand a held-back request reports includes what the other partitions hold for
their consumers (`Scheduler._held_for`), lest a producer that fed one partition leave another
partition's consumer waiting for a version; a partition counts at most what its consumers were
seen to take in one version (at least the configured `consumer_batch_size`) plus one acquire per
partition fed under grants, so one overfed partition does not grow the budget without bound.
Samples served from the budget's slack (a batch taken ahead of its version), a request that
waits only for producers the budget lets in, or one that ends empty, count nothing by
themselves. A producer's batch is the smallest unit a
grant has, so one acquire always fits: `consumer_batch_size` grows to cover it as well. Both
growths are logged and shown by `status()`. The rule itself is unchanged, so the budget still
follows the trainer's versions and the staleness bound (checked on every consumed sample) holds
whatever the budget.

With `follow_consumers=False` the configured value is pinned, and a request it can never admit
fails at once with `UnsatisfiableError` naming the budget and the fix, instead of waiting out
its timeout: an acquire larger than `(η + 1) * consumer_batch_size`, or a consumer whose demand
exceeds `consumer_batch_size` while what admission can still let in under the current version
does not cover its batch (`holds_back`).

Producers acquire in units of their own (a batch of prompts times the group size), and the
budget's leftover need not be a whole one: a producer waiting for more than the leftover lets
no one in (FIFO), so while one waits the leftover is no room for a consumer (`room`). When a
consumer is held back and its demand fits the budget, the producer at the head of the queue is
granted anyway (`lend`), overdrawing the budget by at most its acquire: `accepted` counts what
was put, so the next version's budget pays the overdraft back, as verl's rollouter, which starts
a sample while any budget is left, overshoots by less than one. A spent budget (leftover zero)
lends too: a consumer whose demand fits it is held back by samples no consumer takes under this
version (a filter task cleared them, another partition holds more than its consumers take), and
only a producer can bring its batch. Pinned or following, a leftover smaller than a producer's
unit never deadlocks a consumer waiting for that producer, and the overdraft is bounded:
nothing more is lent until the budget is back at zero or above.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from transfer_queue.wire.errors import SchemaError, TimeoutError, UnsatisfiableError
from transfer_queue.wire.staleness import admission_limit

from .status import AdmissionStatus

__all__ = ["Admission"]

log = logging.getLogger("sluice.controller")


@dataclass
class _Grant:
    remaining: int
    expiry: asyncio.TimerHandle | None = None


class Admission:
    """Generation-slot budget under a staleness bound; unlimited when `max_staleness` is None.

    `batch_size` is the configured `consumer_batch_size`; with `follow` it is a floor that
    `follow_demand` and `acquire` raise (see the module's docstring)."""

    def __init__(
        self,
        max_staleness: float | None,
        batch_size: int,
        grant_timeout: float,
        version_of: Callable[[], int],
        follow: bool,
        stalled: Callable[[], None],
    ):
        """`stalled` is called when a producer starts to wait with none waiting before, or
        granted slots come back while one waits: what was room for the consumers (`room`) is
        gone, so a parked consumer may be held back now (the controller has each one check,
        `Scheduler.producers_stalled`)."""
        self.version_of = version_of
        self.stalled = stalled
        self.max_staleness = max_staleness
        self.configured_batch_size = batch_size
        self.batch_size = batch_size
        self.follow = follow
        self.grown_by = ""
        """Who last raised `batch_size` above the configured value, and why ("" if no one)."""
        self.grant_timeout = grant_timeout
        self.accepted = 0
        self.running = 0
        self.waits = 0
        self.wait_seconds = 0.0
        self.expired = 0
        self.overdrafts = 0
        self.largest_acquire = 0
        """The most slots one acquire asked for: the unit by which producers overfeed."""
        self._grants: dict[int, _Grant] = {}
        # Grants are not journaled: a restarted controller knows none of its predecessor's, so its
        # ids start at a random base lest a put under an old grant use up a new one with its id.
        self._ids = itertools.count(secrets.randbits(48) + 1)
        self._queue: deque[tuple[int, asyncio.Future]] = deque()

    @property
    def bounded(self) -> bool:
        return self.max_staleness is not None

    def limit(self) -> int:
        """`(η + version + 1) * consumer_batch_size`: what accepted + running may reach now."""
        assert self.max_staleness is not None
        return admission_limit(self.max_staleness, self.version_of(), self.batch_size)

    def budget(self) -> float:
        """Slots that may be granted now."""
        if self.max_staleness is None:
            return float("inf")
        return self.limit() - self.accepted - self.running

    def describe(self) -> str:
        """The budget in words, for error messages."""
        return (
            f"admission lets accepted + running samples reach (η + version + 1) * consumer_batch_size = "
            f"({self.max_staleness:g} + {self.version_of()} + 1) * {self.batch_size} = {self.limit()}; "
            f"now accepted {self.accepted}, running {self.running}"
        )

    def follow_demand(self, demand: int, why: str) -> None:
        """The consumers take `demand` granted samples under the current version (`why` says
        whose): grow `consumer_batch_size` to it when following the consumers."""
        if self.bounded and self.follow and demand > self.batch_size:
            self._grow(demand, why)

    def room(self) -> float:
        """All that admission can still let in under this version without a consumer's help
        (`lend`): the running grants, and the budget's leftover while no producer waits (one that
        waits asked for more than the leftover, and the producers behind it wait their turn);
        infinite when unbounded."""
        return self.running + (0 if self.producer_waits() else max(0.0, self.budget()))

    def producer_waits(self) -> bool:
        """A producer waits for budget."""
        return any(not fut.done() for _, fut in self._queue)

    def lend(self, ready: int, batch: int) -> None:
        """A consumer whose demand fits the budget waits for `batch` with `ready` samples: when
        it is held back while the producer at the head of the queue waits for more than a
        leftover of zero or more, grant that producer now, overdrawing the budget by at most its
        acquire (the next version's budget pays it back)."""
        while self._queue and self._queue[0][1].done():
            self._queue.popleft()
        if not self._queue or self.budget() < 0 or not self.holds_back(ready, batch):
            return
        n, fut = self._queue.popleft()
        self.overdrafts += 1
        log.info(
            "admission lends %d slots to a producer over a leftover of %d: a consumer waits for it", n, self.budget()
        )
        fut.set_result((self._grant(n), self.version_of()))

    def holds_back(self, ready: int, batch: int) -> bool:
        """The `ready` samples plus the `room` fall short of a consumer's `batch`: it waits for
        a new version, or for the budget to grow."""
        return ready + self.room() < batch

    def _grow(self, batch_size: int, why: str) -> None:
        log.warning(
            "admission budget grows: consumer_batch_size %d -> %d (%s); start the cluster with "
            "consumer_batch_size=%d (sluice serve --consumer-batch-size %d) to begin there",
            self.batch_size,
            batch_size,
            why,
            batch_size,
            batch_size,
        )
        self.batch_size = batch_size
        self.grown_by = why
        self.pump()

    async def acquire(self, n: int, timeout: float) -> tuple[int, int]:
        """(grant id, version) once `n` slots fit the budget; FIFO among waiting producers."""
        if n <= 0:
            raise SchemaError(f"acquire needs n > 0, got {n}")
        self.largest_acquire = max(self.largest_acquire, n)
        eta = self.max_staleness
        if eta is not None and n > admission_limit(eta, 0, self.batch_size):
            if not self.follow:
                most = admission_limit(eta, 0, self.batch_size)
                raise UnsatisfiableError(
                    f"acquire({n}) can never fit: the budget is (staleness + 1) * consumer_batch_size = {most} "
                    f"slots (consumer_batch_size {self.batch_size} is pinned); ask for at most {most}, or start the "
                    f"cluster with consumer_batch_size >= {math.ceil(n / (eta + 1))} (sluice serve "
                    "--consumer-batch-size)"
                )
            covering = math.ceil(n / (eta + 1))
            while admission_limit(eta, 0, covering) < n:  # the floor of a fractional η may fall one short
                covering += 1
            self._grow(covering, f"a producer acquires {n} slots at once")
        if not self._queue and n <= self.budget():
            return self._grant(n), self.version_of()
        fut = asyncio.get_running_loop().create_future()
        stalls = not self.producer_waits()
        self._queue.append((n, fut))
        self.waits += 1
        start = time.monotonic()
        if stalls:
            self.stalled()  # may `lend` to this very request
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._give_back(fut, n)
            raise TimeoutError(
                f"no generation budget for {n} samples within {timeout:g}s ({self.describe()}); "
                "the trainer has not published a version to open more"
            ) from None
        except asyncio.CancelledError:
            self._give_back(fut, n)
            raise
        finally:
            self.wait_seconds += time.monotonic() - start
            self._queue = deque((m, f) for m, f in self._queue if f is not fut)
            self.pump()  # a request that gave up at the head may have held back ones that fit

    def _give_back(self, fut: asyncio.Future, n: int) -> None:
        """Release a grant made just as its requester gave up (timed out or was cancelled)."""
        if fut.done() and not fut.cancelled():
            self.release(fut.result()[0], n)

    def _grant(self, n: int) -> int:
        grant_id = next(self._ids)
        self.running += n
        grant = self._grants[grant_id] = _Grant(n)
        grant.expiry = asyncio.get_running_loop().call_later(self.grant_timeout, self._expire, grant_id)
        return grant_id

    def pump(self) -> None:
        """Grant waiting requests, in order, while the head fits."""
        while self._queue:
            n, fut = self._queue[0]
            if fut.done():
                self._queue.popleft()
                continue
            if n > self.budget():
                return
            self._queue.popleft()
            fut.set_result((self._grant(n), self.version_of()))

    def check_fits(self, grant_id: int, n: int) -> None:
        """Refuse a put of `n` samples under `grant_id` beyond the slots it has left (a grant
        that expired is not known any more: its samples count once they exist, `used`).

        Raises:
            SchemaError: the grant has fewer than `n` slots left."""
        grant = self._grants.get(grant_id)
        if grant is not None and n > grant.remaining:
            raise SchemaError(
                f"a put of {n} samples under grant {grant_id}, which has {grant.remaining} slots left: put at most "
                "as many samples as acquired (acquire more, or split the batch over several grants)"
            )

    def used(self, grant_id: int, n: int) -> None:
        """`n` samples were put under `grant_id`: they move from running to accepted."""
        grant = self._grants.get(grant_id)
        if grant is None:
            self.accepted += n  # expired grant: the samples still count once they exist
            return
        k = min(n, grant.remaining)
        grant.remaining -= k
        self.running -= k
        self.accepted += n
        if grant.remaining == 0:
            self._close(grant_id)

    def release(self, grant_id: int, n: int) -> None:
        """Return up to `n` unused slots of a grant."""
        grant = self._grants.get(grant_id)
        if grant is None:
            return
        k = min(n, grant.remaining)
        grant.remaining -= k
        self.running -= k
        if grant.remaining == 0:
            self._close(grant_id)
        self._returned()

    def _returned(self) -> None:
        """Granted slots came back unused: grant the waiting producers that fit now. While one
        still waits, the leftover is no room for consumers (`room`), so those slots, room while
        they ran, are gone: a parked consumer may be held back now (`stalled`)."""
        self.pump()
        if self.producer_waits():
            self.stalled()

    def forget(self, n: int) -> None:
        """`n` accepted samples were dropped or requeued as stale: they will be generated again."""
        self.accepted = max(0, self.accepted - n)
        self.pump()

    def _close(self, grant_id: int) -> None:
        grant = self._grants.pop(grant_id)
        if grant.expiry is not None:
            grant.expiry.cancel()

    def _expire(self, grant_id: int) -> None:
        grant = self._grants.get(grant_id)
        if grant is None:
            return
        self.expired += 1
        self.running -= grant.remaining
        grant.remaining = 0
        self._close(grant_id)
        self._returned()

    def status(self) -> AdmissionStatus:
        return AdmissionStatus(
            accepted=self.accepted,
            running=self.running,
            budget=None if self.max_staleness is None else int(self.budget()),
            consumer_batch_size=self.batch_size,
            configured_consumer_batch_size=self.configured_batch_size,
            follows_consumers=self.follow,
            grown_by=self.grown_by,
            open_grants=len(self._grants),
            waiting=len(self._queue),
            waits=self.waits,
            wait_seconds=round(self.wait_seconds, 6),
            expired_grants=self.expired,
            overdrafts=self.overdrafts,
        )
