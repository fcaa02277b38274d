"""Scheduling consumers: find ready samples for `get_meta`, apply the staleness bound and its
policy, sample, lease, or park; acks, nacks and lease expiry.

A request that cannot be served now is parked as a `Waiter` on its partition and re-evaluated
whenever that partition changes (a commit, a nack, an expired lease, a seal) or the version
moves; a put under a grant into another partition spends admission's budget, so the request
checks its demand again then, with the samples ready for it at its last evaluation. Its
deadline is a loop timer. A consumer's demand under the current version is the granted samples
its task was handed from the partition since the version began and did not give back, plus the
batches its task waits for. A request reports it to admission, which grows the producers'
budget to it, only while admission is what holds it back (more puts may come, but what
admission can still let in under this version falls short of its batch); when the budget is
pinned and can never let that batch in, the request fails at once with `UnsatisfiableError`
instead (see `controllers/admission.py`). So a batch served from the budget's slack ahead of
the version it is for reports nothing by itself (its samples count in what a later request held
back reports), nor does a request on a sealed partition (a stream's last, answered empty once
the partition drains), nor one that waits only for producers the budget already lets in. A
stream's prefetch thus counts nothing while the budget has a batch of slack for it, and counts
when it does not: with η = 0 it is held back and asks for a second batch under one version.
Partitions share the budget, so the demand a held-back request reports includes what the other
partitions hold for their consumers (`_held_for`), and while a producer waits for more than the
budget's leftover, a held-back request lets it in (`Admission.lend`); docs/staleness.md says why.
Nothing here sleeps or polls, so a waiting consumer never slows anyone else. Leases are loop
timers too: an expired lease returns its unacked samples to the ready pool (at-least-once
delivery).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from transfer_queue.wire.errors import TimeoutError, UnsatisfiableError
from transfer_queue.wire.messages import ClusterConfig, GetMeta
from transfer_queue.wire.meta import BatchMeta

from .admission import Admission
from .samplers import SamplerRegistry, SampleView
from .status import SchedulerStatus, StalenessStatus
from .table import Partition, TaskState
from .versions import VersionClock

__all__ = ["Scheduler", "StaleCounters"]


@dataclass
class StaleCounters:
    """Staleness of the samples served, and what happened to those too stale to serve."""

    dropped: int = 0
    kept: int = 0
    requeued: int = 0
    served_histogram: dict[int, int] = field(default_factory=dict)

    def served(self, staleness: np.ndarray) -> None:
        """Count served samples by staleness (one `np.unique` per batch, not a loop per sample)."""
        values, counts = np.unique(staleness, return_counts=True)
        for s, c in zip(values.tolist(), counts.tolist()):
            self.served_histogram[s] = self.served_histogram.get(s, 0) + c

    def status(self) -> StalenessStatus:
        histogram = {str(k): v for k, v in sorted(self.served_histogram.items())}
        return StalenessStatus(histogram, self.dropped, self.kept, self.requeued)


@dataclass
class _Demand:
    """Granted samples each consumer, a (partition, task), was handed under `version` and did not
    give back: a sample nacked, or whose lease expired, stops counting, so one handed out again
    counts once."""

    version: int = 0
    taken: dict[tuple[str, str], int] = field(default_factory=dict)

    def at(self, version: int) -> dict[tuple[str, str], int]:
        """The counts under `version` (a new version starts from nothing)."""
        if version != self.version:
            self.version, self.taken = version, {}
        return self.taken

    def took(self, version: int, key: tuple[str, str], n: int) -> None:
        """`key` was handed `n` granted samples under `version`."""
        taken = self.at(version)
        taken[key] = taken.get(key, 0) + n

    def gave_back(self, version: int, key: tuple[str, str], n: int) -> None:
        """`n` granted samples handed to `key` under `version` went back to the ready pool (a
        version already over is forgotten)."""
        if version == self.version and key in self.taken:
            self.taken[key] = max(0, self.taken[key] - n)


@dataclass
class _Held:
    """`Scheduler._held_for` of every partition, computed once for a pass over many parked
    requests (a commit's, or one partition's wake: neither changes what the others hold)."""

    each: dict[str, int] | None = None
    total: int = 0


@dataclass
class _Waiter:
    req: GetMeta
    future: asyncio.Future
    deadline: asyncio.TimerHandle | None = None
    ready: int = 0
    """Samples ready for it when it was last evaluated: what it reports demand with when a
    granted put elsewhere spends the budget (`granted_commit`)."""


@dataclass
class _Lease:
    partition: str
    task: str
    indexes: np.ndarray
    """Global indexes of the leased samples (row numbers change when the table compacts)."""
    outstanding: int
    timer: asyncio.TimerHandle
    version: int
    """The version it was handed out under: what its samples count as demand for."""


@dataclass
class Scheduler:
    """Consumer-side scheduling over the controller's partitions: parked requests and leases."""

    config: ClusterConfig
    partitions: dict[str, Partition]
    clock: VersionClock
    admission: Admission
    samplers: SamplerRegistry
    free_rows: Callable[[Partition, np.ndarray], None]
    """Kill rows and release their bytes on the storage units (owned by the controller)."""
    stale: StaleCounters = field(default_factory=StaleCounters)
    waiters: dict[str, list[_Waiter]] = field(default_factory=dict)
    leases: dict[int, _Lease] = field(default_factory=dict)
    served: int = 0
    acked: int = 0
    ack_refused: int = 0
    """Sample-acks refused: their lease had expired and the sample went to another consumer
    (a sample acked late twice counts twice)."""
    demand: _Demand = field(default_factory=_Demand)
    _recount: set[str] = field(default_factory=set)
    """Partitions where samples stopped being ready for parked requests after those were last
    evaluated (served to another request, acked from the pool, cleared, dropped as stale): their
    `_Waiter.ready` may be too high, so `granted_commit` evaluates them in full."""
    _peak: dict[str, int] = field(default_factory=dict)
    """Per partition, the most its consumers were seen to take in one version (one task's
    granted samples taken plus the batches it waited for): what `_held_for` counts at most."""
    _fed: set[str] = field(default_factory=set)
    """Names of the partitions a put under a grant has fed, until cleared: a consumer of one that
    does not exist (yet, or again) waits for a grant (`_fed_under_grants`)."""
    # lease ids start at the controller's start time in microseconds: a journaled controller
    # started again never hands out the id of a lease a client still holds from before
    _lease_ids: itertools.count = field(default_factory=lambda: itertools.count(time.time_ns() // 1000))

    def status(self) -> SchedulerStatus:
        parked = sum(len(queue) for queue in self.waiters.values())
        return SchedulerStatus(self.served, self.acked, len(self.leases), parked, self.ack_refused)

    # -- get_meta ----------------------------------------------------------------------

    async def get_meta(self, req: GetMeta) -> BatchMeta:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(req, loop.create_future())
        meta = self._evaluate(waiter, final=False)
        if meta is not None:
            return meta
        waiter.deadline = loop.call_later(max(req.timeout, 0.0), self._expire_waiter, waiter)
        self.waiters.setdefault(req.partition, []).append(waiter)
        try:
            return await waiter.future
        finally:
            waiter.deadline.cancel()
            queue = self.waiters.get(req.partition, [])
            if waiter in queue:
                queue.remove(waiter)

    def wake(self, partition: str) -> None:
        """Re-evaluate the partition's parked requests in arrival order."""
        self._recount.discard(partition)
        held = _Held()
        for waiter in list(self.waiters.get(partition, ())):
            if not waiter.future.done():
                self._settle(waiter, final=False, held=held)

    def wake_all(self) -> None:
        """Re-evaluate every partition's parked requests: the version moved."""
        for name in list(self.waiters):
            self.wake(name)

    def granted_commit(self, partition: str) -> None:
        """A put under a grant committed to `partition`: re-evaluate the requests parked there.
        It raised admission's `accepted`, which may now hold back a request parked on any other
        partition that it did not hold back before; that request must report its consumer's
        demand, or the budget may never grow to it. Its ready samples did not change since it
        was last evaluated (a partition where they may have dropped is in `_recount`), so it
        reports with those (`_Waiter.ready`) instead of being sampled again: a commit costs one
        demand check per request parked elsewhere, not a full evaluation."""
        self._fed.add(partition)
        self._room_fell(partition)

    def producers_stalled(self) -> None:
        """A producer waits for more than the budget's leftover, which then stops being room for
        the consumers (`Admission.room`): a request parked anywhere may be held back now, and
        must report its consumer's demand (and so let that producer in, `Admission.lend`)."""
        self._room_fell(None)

    def _room_fell(self, woken: str | None) -> None:
        """What admission can still let in fell: re-evaluate the requests parked on `woken` (if
        any) in full, and have each one parked elsewhere check its demand (`granted_commit`)."""
        adm = self.admission
        held = _Held()

        # the room only grows in this pass (a report grows the budget or lends it, a stale drop
        # returns budget): looked up again only when what it counts changes
        def counts() -> tuple[int, int, int]:
            return adm.batch_size, adm.running, adm.accepted

        seen, room = counts(), adm.room()
        for name in list(self.waiters):
            if name == woken or name in self._recount:
                self.wake(name)
                continue
            if seen != counts():
                seen, room = counts(), adm.room()
            parked = [w for w in self.waiters[name] if not w.future.done()]
            short = [w for w in parked if w.ready + room < w.req.batch_size]
            part = self.partitions.get(name)
            if not short or not self._fed_under_grants(part, name):
                continue  # admission holds back no request parked there
            waiting: dict[str, int] = {}  # per task, the batches its parked requests wait for
            for waiter in parked:
                waiting[waiter.req.task] = waiting.get(waiter.req.task, 0) + waiter.req.batch_size
            for waiter in short:
                req = waiter.req
                if seen != counts():
                    seen, room = counts(), adm.room()
                if waiter.future.done() or waiter.ready + room >= req.batch_size:
                    continue  # failed by a report above (same task, pinned budget), or let in since
                try:
                    self._report_held(req, waiter.ready, waiting[req.task] - req.batch_size, held, part is not None)
                except Exception as exc:  # noqa: BLE001 - the waiting client gets the typed error
                    waiter.future.set_exception(exc)
                    waiting[req.task] -= req.batch_size

    def ready_fell(self, partition: str) -> None:
        """Samples of `partition` stopped being ready for a task without the requests parked
        there being evaluated again (leased to another request, acked from the ready pool,
        cleared, dropped as stale): the next granted commit evaluates them in full."""
        if self.waiters.get(partition):
            self._recount.add(partition)

    def _expire_waiter(self, waiter: _Waiter) -> None:
        if not waiter.future.done():
            self._settle(waiter, final=True)

    def _settle(self, waiter: _Waiter, final: bool, held: _Held | None = None) -> None:
        try:
            meta = self._evaluate(waiter, final, held)
        except Exception as exc:  # noqa: BLE001 - the waiting client gets the typed error
            waiter.future.set_exception(exc)
            return
        if meta is not None:
            waiter.future.set_result(meta)

    def _evaluate(self, waiter: _Waiter, final: bool, held: _Held | None = None) -> BatchMeta | None:
        """A leased batch, or None to keep waiting (`waiter.ready` then says how many samples
        are ready for it); at the deadline a short batch or an error. `held`: see
        `_report_demand`."""
        req = waiter.req
        part = self.partitions.get(req.partition)
        sampler = self.samplers.get(req.sampler)
        if part is None:
            if not final:
                waiter.ready = 0
                self._report_demand(None, req, 0, held=held)
                return None
            if not req.allow_partial:
                return self._give_up(req, None, 0)
            return BatchMeta(req.partition, [], [], [], [], [], {}, task=req.task)  # what is ready: nothing
        task = part.task(req.task)
        mask = part.available(task, req.fields)
        ready = np.empty(0, np.int64) if mask is None else np.flatnonzero(mask) + task.cursor
        bound = self.config.max_staleness if req.max_staleness is None else req.max_staleness
        if bound is not None and len(ready):
            age = self.clock.current - part.v_first[ready]
            too_stale = part.versioned[ready] & (age > bound)
            if too_stale.any():
                cluster = self.config.max_staleness
                if cluster is not None:  # a tighter bound of this call only filters what it is served
                    self._handle_stale(part, ready[too_stale & (age > cluster)])
                ready = ready[~too_stale]
        view = SampleView(part.group, part.seqlen, part.v_first)
        rows = sampler.sample(ready, req.batch_size, view, req.sampler_options, False)
        if rows is None and self._drained(part, task, len(ready), bound):
            rows = sampler.sample(ready, req.batch_size, view, req.sampler_options, True)
        if rows is None:
            if not final:
                waiter.ready = len(ready)
                self._report_demand(part, req, len(ready), held=held)
                return None
            if not req.allow_partial:
                return self._give_up(req, part, len(ready))
            rows = sampler.sample(ready, req.batch_size, view, req.sampler_options, True)
        assert rows is not None  # asked for a partial batch, a sampler returns one (maybe short or empty)
        return self._lease(part, task, req, rows)

    def _drained(self, part: Partition, task: TaskState, n_ready: int, bound: int | None) -> bool:
        """Sealed, and every committed sample the task may still get is ready now: nothing more
        will come (a seal ends the puts still in flight, so uncommitted rows never count)."""
        if not part.sealed:
            return False
        w = part.window(task)
        pending = part.alive[w] & part.committed[w] & ~task.consumed[w]
        if bound is not None:
            pending &= ~part.versioned[w] | ((self.clock.current - part.v_first[w]) <= bound)
        return int(np.count_nonzero(pending)) == n_ready

    def _report_demand(self, part: Partition | None, req: GetMeta, n_ready: int, held: _Held | None = None) -> None:
        """A request waits: when admission is what holds it back (the partition is fed under
        grants, `_fed_under_grants`, and the `n_ready` samples plus what admission can still let
        in under this version fall short of its batch), report the demand (`_report_held`). A
        request that waits only for producers the budget lets in is no demand, nor is one on a
        sealed partition, which no put can feed: the samples handed out (`_lease`) count only in
        what a request held back reports. `held`: the caller's `_Held`, for a pass over many
        requests.

        Raises:
            UnsatisfiableError: a pinned budget can never let its batch in."""
        if not self.admission.holds_back(n_ready, req.batch_size) or not self._fed_under_grants(part, req.partition):
            return
        others = sum(
            w.req.batch_size
            for w in self.waiters.get(req.partition, ())
            if w.req.task == req.task and w.req is not req and not w.future.done()
        )
        self._report_held(req, n_ready, others, _Held() if held is None else held, part is not None)

    def _report_held(self, req: GetMeta, n_ready: int, others: int, held: _Held, created: bool) -> None:
        """A request admission holds back: tell admission what the consumers take under this
        version: what its consumer takes, the batches it waits for included (`others`: those of
        its task's other requests parked on the partition), plus what the other partitions hold
        for theirs (`_held_for`, from `held`). Those samples spend the same budget, and their
        consumers may take them only after this one (a trainer that takes a batch from each
        partition before it publishes): counted apart, a producer that fed another partition
        would leave this consumer waiting for a version. Then, if admission still holds it back
        while a producer waits for more than the budget's leftover, that producer is let in
        (`Admission.lend`). `created`: the partition exists; a consumer of one that does not
        may be waiting for puts that need no grant (prompts), so it never fails.

        Raises:
            UnsatisfiableError: a pinned budget can never let its batch in."""
        adm = self.admission
        name = req.partition
        key = (name, req.task)
        own = self.demand.at(self.clock.current).get(key, 0) + others + req.batch_size
        self._peak[name] = max(self._peak.get(name, 0), own)
        elsewhere = self._held_elsewhere(name, held)
        demand = own + elsewhere
        if demand > adm.batch_size:
            takes = f"takes {own} samples per version"
            if elsewhere:
                takes += f" and other partitions hold {elsewhere} for theirs"
            adm.follow_demand(demand, f"task {req.task!r} on partition {name!r} {takes}")
        if demand > adm.batch_size and created:  # a budget that follows has just grown to it: this one is pinned
            shared = (
                " A pinned budget shared by several partitions needs headroom of about one producer acquire per "
                "partition (their leftovers need not add up to a whole acquire)."
                if elsewhere
                else ""
            )
            raise UnsatisfiableError(
                f"get_meta(task={req.task!r}, partition={name!r}, batch_size={req.batch_size}) can never be "
                f"served: this consumer {takes}, but the admission budget is pinned at "
                f"consumer_batch_size={adm.batch_size} and {adm.describe()}, so producers stop short of this "
                f"batch ({n_ready} ready) until a new version is published. Start the cluster with "
                f"consumer_batch_size >= {demand} (sluice serve --consumer-batch-size {demand}), or let the "
                f"budget follow the consumers (the default; drop follow_consumers=False / --no-follow-consumers).{shared}"
            )
        adm.lend(n_ready, req.batch_size)

    def _held_elsewhere(self, own: str, held: _Held) -> int:
        """What the partitions other than `own` hold for their consumers (`_held_for`), computed
        for every partition once per `held`."""
        if held.each is None:
            # one acquire (the largest seen) per partition fed under grants now (live granted
            # samples, not sealed): producers are granted in arrival order, and while one waits
            # for its turn the others may each be granted once more for the partition they feed;
            # a consumer held back by that surplus must count it, or it waits for a version its
            # own batch comes before. Partitions fed before and consumed since add nothing.
            fed = sum(1 for p in self.partitions.values() if not p.sealed and (p.granted[: p.n] & p.alive[: p.n]).any())
            allowance = self.admission.largest_acquire * fed
            held.each = {name: self._held_for(part, allowance) for name, part in self.partitions.items()}
            held.total = sum(held.each.values())
        return held.total - held.each.get(own, 0)

    def _held_for(self, part: Partition, allowance: int) -> int:
        """The granted samples `part` holds for its consumers under this version: for the task
        that needs most, those it was handed under this version and kept, plus the larger of
        those ready for it and the batches it waits for. Only committed, live samples its
        consumers may still get count (not too stale). A partition that holds no granted sample
        and handed none out under this version (prompts put without grants, say) holds nothing,
        whatever its consumers wait for. What a partition holds beyond what its consumers take
        per version (`_peak`, at least the configured `consumer_batch_size`; with no task yet,
        just that, plus `allowance`) does not count: a producer that overfeeds it would otherwise
        have every one of its puts grow the budget, without bound, for a consumer elsewhere that
        no one feeds."""
        n = part.n
        mask = part.granted[:n] & part.alive[:n] & part.committed[:n]
        # what was handed out counts, cleared since or not (only granted samples are counted there)
        taken = {name: self.demand.at(self.clock.current).get((part.name, name), 0) for name in part.tasks}
        if not mask.any():
            if not any(taken.values()):
                return 0  # not fed under grants in this version: its consumers wait for no grant
        elif (bound := self.config.max_staleness) is not None:
            mask &= ~part.versioned[:n] | ((self.clock.current - part.v_first[:n]) <= bound)
        every = int(np.count_nonzero(mask))
        configured = self.admission.configured_batch_size
        if not part.tasks:
            return min(every, configured + allowance)
        waiting: dict[str, int] = {}  # per task, the batches its parked requests wait for
        for waiter in self.waiters.get(part.name, ()):
            if not waiter.future.done():
                waiting[waiter.req.task] = waiting.get(waiter.req.task, 0) + waiter.req.batch_size
        peak = max(self._peak.get(part.name, 0), *(taken[name] + waiting.get(name, 0) for name in part.tasks))
        self._peak[part.name] = peak
        most = 0
        for name, task in part.tasks.items():
            wants = waiting.get(name, 0)
            if wants < every:  # else what is ready for it, at most `every`, changes nothing
                wants = max(wants, int(np.count_nonzero(mask & ~task.consumed[:n] & (task.lease[:n] == 0))))
            most = max(most, taken[name] + wants)
        return min(most, max(peak, configured) + allowance)

    def _fed_under_grants(self, part: Partition | None, name: str) -> bool:
        """More samples may come to `part` (named `name`) through a bounded admission: a put
        under a grant brought some, and it is not sealed. A partition no put has made (None,
        not yet or cleared) counts when a put under a grant fed that name before, or a producer
        waits for budget (maybe to put its first samples there); not merely because another
        partition is fed under grants, as its first samples may need no grant (prompts)."""
        if not self.admission.bounded:
            return False
        if part is None:
            return name in self._fed or self.admission.producer_waits()
        return not part.sealed and bool(part.granted[: part.n].any())

    def _give_up(self, req: GetMeta, part: Partition | None, n_ready: int) -> BatchMeta:
        """`TimeoutError`, naming fields no put has brought yet (a typo, or a column that another
        task writes later: waiting for those is legitimate, so this stays a timeout)."""
        have = "no such partition yet" if part is None else f"{part.n} samples in partition"
        unknown = [] if part is None else [f for f in req.fields if f not in part.schema]
        if part is not None and unknown:
            raise TimeoutError(
                f"get_meta(task={req.task!r}, partition={req.partition!r}) waited {req.timeout:g}s for field(s) "
                f"{unknown} that no put has brought yet (the partition has {sorted(part.schema)}): check the "
                "names, or wait longer for the task that writes them"
            )
        adm = self.admission
        held_by_admission = part is not None and adm.bounded and part.granted[: part.n].any()
        if held_by_admission and adm.holds_back(n_ready, req.batch_size):
            raise TimeoutError(
                f"get_meta(task={req.task!r}, partition={req.partition!r}, batch_size={req.batch_size}) found "
                f"{n_ready} ready samples within {req.timeout:g}s, and admission lets no more producers in "
                f"until a new version is published: {adm.describe()}. Publish versions while you wait, or "
                "raise the cluster's consumer_batch_size (sluice serve --consumer-batch-size)"
            )
        raise TimeoutError(
            f"get_meta(task={req.task!r}, partition={req.partition!r}, batch_size={req.batch_size}, "
            f"fields={req.fields}) found too few ready samples within {req.timeout:g}s ({have}, {n_ready} ready); "
            "the producers are slow or gone: pass allow_partial=True to take what is ready, or a longer timeout"
        )

    def _lease(self, part: Partition, task: TaskState, req: GetMeta, rows: np.ndarray) -> BatchMeta:
        lease_id = 0
        if len(rows):
            lease_id = next(self._lease_ids)
            task.lease[rows] = lease_id
            timeout = req.lease_timeout if req.lease_timeout is not None else self.config.lease_timeout
            timer = asyncio.get_running_loop().call_later(timeout, self._expire_lease, lease_id)
            lease = _Lease(part.name, req.task, part.gidx[rows], len(rows), timer, self.clock.current)
            self.leases[lease_id] = lease
            if any(w.req.task == req.task and w.req is not req for w in self.waiters.get(part.name, ())):
                self.ready_fell(part.name)  # the other requests of the task parked there
        granted = int(np.count_nonzero(part.granted[rows]))
        if granted:
            self.demand.took(self.clock.current, (part.name, req.task), granted)
        staleness = self.clock.current - part.v_first[rows[part.versioned[rows]]]
        self.stale.served(staleness)  # versionless rows (prompts) are not in the histogram
        self.served += len(rows)
        return BatchMeta(
            partition=part.name,
            indexes=part.gidx[rows].tolist(),
            policy_versions=part.v_first[rows].tolist(),
            version_last=part.v_last[rows].tolist(),
            groups=part.group[rows].tolist(),
            units=part.unit[rows].tolist(),
            fields={name: part.schema[name] for name in req.fields if name in part.schema},
            task=req.task,
            lease_id=lease_id,
        )

    # -- staleness policy ----------------------------------------------------------------

    def _handle_stale(self, part: Partition, rows: np.ndarray) -> None:
        """Apply `stale_policy` to `rows`, staler than the cluster's bound (a call's tighter one
        drops nothing: other tasks may still be served those). Rows another task holds under a
        lease are left until it acks them or the lease expires: freeing them would fail its
        `get_data`."""
        if not len(rows):
            return
        policy = self.config.stale_policy
        if policy == "keep":
            fresh = rows[~part.stale_seen[rows]]
            part.stale_seen[fresh] = True
            self.stale.kept += len(fresh)
            return
        rows = rows[~part.leased(rows)]
        if not len(rows):
            return
        if policy == "requeue":
            self.stale.requeued += len(rows)
            self._requeue_sources(part, rows)
        else:
            self.stale.dropped += len(rows)
        self.admission.forget(int(np.count_nonzero(part.granted[rows])))  # only granted samples were counted
        self.free_rows(part, rows)
        self.ready_fell(part.name)

    def _requeue_sources(self, part: Partition, rows: np.ndarray) -> None:
        """Offer the prompts that produced `rows` to their producers again."""
        for ref in np.unique(part.source[rows]):
            if ref == 0:
                continue
            src_name, src_task = part.sources[ref]
            src = self.partitions.get(src_name)
            if src is None:
                continue
            picked = rows[part.source[rows] == ref]
            src_rows = src.rows_of(part.source_index[picked], alive=False)
            src_rows = src_rows[src.alive[src_rows]]
            state = src.task(src_task)
            state.consumed[src_rows] = False
            state.lease[src_rows] = 0
            if len(src_rows):
                state.cursor = min(state.cursor, int(src_rows.min()))
            self.wake(src_name)

    def lose(self, part: Partition, rows: np.ndarray) -> None:
        """Rows whose storage unit died: requeue the prompts that produced them, return their
        admission budget (they must be generated again) and drop them; never served again."""
        unconsumed = np.zeros(len(rows), bool) if part.tasks else np.ones(len(rows), bool)
        for task in part.tasks.values():
            unconsumed |= ~task.consumed[rows]
        self._requeue_sources(part, rows[unconsumed])  # a consumed sample needs no new rollout
        self.admission.forget(int(np.count_nonzero(part.granted[rows] & part.committed[rows])))
        part.kill(rows)
        self.wake(part.name)

    # -- ack / nack / leases -------------------------------------------------------------

    def ack(self, part: Partition, task_name: str, indexes: list[int], lease_id: int = 0) -> tuple[list[int], int]:
        """Mark the samples at `indexes` consumed by the task and end the leases they are under;
        returns the indexes it took (what the journal records) and how many it refused.

        With the `lease_id` they were handed out under, a sample under another lease, or consumed
        under another, is refused and left alone: that lease expired and the sample went to
        another consumer of the task, whose lease stays whole (`ack_refused` counts them; the
        caller reports them). Samples under no lease and not consumed (the lease expired, nobody
        took them) are taken, and those already consumed under this lease (a repeated ack) or
        under an unknown one are a no-op. `lease_id=0` takes every sample, whatever lease it is
        under. Samples cleared and compacted away are neither taken nor refused: who consumed
        them is forgotten, so a late ack goes unnoticed for those.

        Raises:
            SchemaError: an index the partition was never given (nothing is acked)."""
        task = part.task(task_name)
        rows, known = part.given(indexes)  # `known` stays aligned with `indexes`: what is taken
        whole = bool(known.all())
        if not whole:
            rows = rows[known]
        held = task.lease[rows]
        refused = 0
        if lease_id and (held == lease_id).all():
            # the usual ack: its own lease still holds every sample, so none is consumed yet
            self._release_lease(lease_id, len(rows))
            self.acked += len(rows)
            part.consume(task, rows)
            task.lease[rows] = -lease_id
        else:
            if lease_id:
                ours = (held == 0) | (np.abs(held) == lease_id)
                refused = int(np.count_nonzero(~ours))
                if refused:
                    self.ack_refused += refused
                    rows, held = rows[ours], held[ours]
                    known[known] = ours
                    whole = False
            self._release_leases(part, held)
            before = task.consumed[rows]
            if ((held == 0) & ~before).any():  # taken from the ready pool
                self.ready_fell(part.name)
            self.acked += int(np.count_nonzero(~before))
            # a consumed sample keeps minus the lease it was consumed under, so that a late ack of
            # another lease can tell it went to someone else (0: under none, or unknown); one taken
            # now was consumed under this ack's lease, or without one under the lease holding it
            marks = np.where(before, held, -lease_id if lease_id else -held)
            part.consume(task, rows)
            task.lease[rows] = marks
        if part.sealed:  # the task's last lease may have been all that kept a waiter from `_drained`
            self.wake(part.name)
        taken = indexes if whole else np.asarray(indexes, np.int64)[known].tolist()
        return taken, refused

    def nack(self, part: Partition, task_name: str, indexes: list[int], lease_id: int = 0) -> None:
        """Give the unconsumed samples at `indexes` back to the task's ready pool. With a
        `lease_id`, only those still under that lease: the others are in the pool already (it
        expired) or another consumer's now, so a late nack is a no-op for them."""
        task = part.task(task_name)
        rows = part.rows_of(indexes, alive=False)
        rows = rows[~task.consumed[rows]]
        if lease_id:
            rows = rows[task.lease[rows] == lease_id]
        if not len(rows):
            return
        self._release_leases(part, task.lease[rows], given_back=part.granted[rows])
        task.lease[rows] = 0
        self.wake(part.name)

    def _release_leases(self, part: Partition, lease_ids: np.ndarray, given_back: np.ndarray | None = None) -> None:
        """One sample under each of `lease_ids` (0 or below: under none) was acked or went back
        to the ready pool: close the leases left with none. With `given_back` (a nack: a mask
        aligned with `lease_ids`, True for a granted sample), the granted samples given back no
        longer count as demand under the version their lease was handed out in; one
        `np.unique` serves both."""
        held = lease_ids > 0
        ids, inverse, counts = np.unique(lease_ids[held], return_inverse=True, return_counts=True)
        granted = [0] * len(ids)
        if given_back is not None:
            granted = np.bincount(inverse, weights=given_back[held], minlength=len(ids)).astype(np.int64).tolist()
        for lease_id, count, n_granted in zip(ids.tolist(), counts.tolist(), granted):
            lease = self.leases.get(lease_id)
            if lease is not None and n_granted:
                self.demand.gave_back(lease.version, (part.name, lease.task), n_granted)
            self._release_lease(lease_id, count)

    def _release_lease(self, lease_id: int, count: int) -> None:
        """`count` of the lease's samples were acked or given back: close it when none is left."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        lease.outstanding -= count
        if lease.outstanding <= 0:
            lease.timer.cancel()
            del self.leases[lease_id]

    def _expire_lease(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        part = self.partitions.get(lease.partition)
        if part is None:
            return
        task = part.task(lease.task)
        rows, known = part.locate(lease.indexes)
        rows = rows[known]
        back = rows[task.lease[rows] == lease_id]
        task.lease[back] = 0
        self.demand.gave_back(lease.version, (part.name, lease.task), int(np.count_nonzero(part.granted[back])))
        self.wake(part.name)

    def forget_partition(self, name: str) -> None:
        """Drop the leases of a cleared partition (its parked waiters stay parked), and what was
        seen of it (`_peak`, `_fed`): the names of partitions made per step must not pile up (a
        consumer of it waits for a grant again only while a producer waits)."""
        self._peak.pop(name, None)
        self._fed.discard(name)
        for lease_id in [k for k, v in self.leases.items() if v.partition == name]:
            self.leases.pop(lease_id).timer.cancel()
