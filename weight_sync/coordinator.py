"""Rank 0's bookkeeping for a publisher group: which ranks have staged which versions, the
newest version complete on every rank, and the subscribers waiting to hear about it.

It lives in rank 0's control-server thread (no locks): `handle` serves `Join`, `Staged`,
`Latest` and `Confirm`; the publisher calls `on_started` and `on_staged` for rank 0 itself.
A version becomes complete when every rank reported it staged; it is recorded with `record`
(the controller's `set_version`) before any subscriber is told, so the controller's version
never runs ahead of what subscribers can fetch, nor behind what they apply. That record is a
controller round trip (up to seconds): it runs on a worker thread of its own, in version
order, and its outcome comes back to the server thread through `submit`, so leases, releases
and `Latest` are answered meanwhile.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import msgspec

from transfer_queue import SchemaError, WeightSyncError

from .protocol import (
    Confirm,
    Granted,
    Join,
    Latest,
    Offer,
    Ok,
    Pending,
    RankInfo,
    Staged,
)

__all__ = ["Coordinator"]

log = logging.getLogger("sluice.weight_sync")

RECENT = 64
"""How many recent complete (and abandoned) versions are remembered for `Confirm`."""


class Coordinator:
    """Tracks versions across `world_size` publisher ranks; `info` is rank 0's own.

    `park(pending, timeout, what)` keeps a request waiting (the server fails it at its
    deadline); `submit(fn)` runs `fn` in the server thread; `record(version)` registers a
    complete version with the controller (blocking; it runs on the coordinator's own worker
    thread), or is None without one, and may raise when the controller cannot be reached.
    `grant(version, transport, peer)` leases rank 0's slot holding `version` to the connection
    `peer` of a `Latest` that asks for it (None when it cannot be pinned: the subscriber then
    sends a `Lease`). `claimed()` is the newest version rank 0 has claimed a staging slot for
    (complete or still staging).
    """

    def __init__(
        self,
        info: RankInfo,
        world_size: int,
        park: Callable[[Pending, float, str], None],
        submit: Callable[[Callable[[], None]], None],
        record: Callable[[int], None] | None,
        grant: Callable[[int, str, bytes], Granted | None],
        claimed: Callable[[], int],
    ):
        self.world_size = world_size
        self.grant = grant
        self.claimed = claimed
        self.park = park
        self.submit = submit
        self.record = record
        self._recorder = None if record is None else ThreadPoolExecutor(1, thread_name_prefix="sluice-ws-record")
        self.ranks: dict[int, RankInfo] = {info.rank: info}
        self.joined: dict[int, bytes] = {}
        """Rank > 0 -> the connection its `Join` came over, while it is open (`left`)."""
        self.holders: dict[int, set[int]] = {}
        """Version -> ranks that have it complete (until every rank has; the last `RECENT`)."""
        self._unrecorded: list[int] = []
        """Versions complete on every rank whose record waits for the one in flight (the last
        `RECENT`): the next record takes them all at once."""
        self._recording = False
        """Whether a record is in flight on the recording worker."""
        self.complete = -1
        self.started = -1
        self.recent: deque[int] = deque(maxlen=RECENT)
        self.abandoned: deque[int] = deque(maxlen=RECENT)
        self.waiters: list[tuple[Latest | Confirm, Pending]] = []

    def handle(self, msg: msgspec.Struct, pending: Pending) -> None:
        """Serve one request meant for the coordinator."""
        match msg:
            case Join(info=info):
                self._check_join(info, pending.peer)
                self.ranks[info.rank] = info
                self.joined[info.rank] = pending.peer
                pending.reply(Ok())
                self._wake()
            case Staged(rank=rank, version=version, complete=ok):
                if self.joined.get(rank, pending.peer) != pending.peer:
                    raise SchemaError(f"rank {rank} was replaced by a rank {rank} that joined later")
                self.on_staged(rank, version, ok)
                pending.reply(Ok())
            case Latest() | Confirm():
                if not self._answer(msg, pending):
                    self.waiters.append((msg, pending))
                    self.park(pending, msg.timeout, "no newer version in time")

    def _check_join(self, info: RankInfo, peer: bytes) -> None:
        """Admit a rank only into its own place in this group: one that counts another group
        size would leave subscribers a rank list that does not add up (a launcher's
        misconfiguration, said to that rank at once). A rank that joins where one still
        connected was takes its place (a restart while the old process hangs, its connection
        open): said in the log, and the old one's `Staged` are refused from then on.

        Raises:
            SchemaError: `info`'s world size differs, or its rank is not in 1..world_size-1.
        """
        if info.world_size != self.world_size:
            raise SchemaError(
                f"rank {info.rank} counts {info.world_size} publisher ranks; rank 0 counts {self.world_size}"
            )
        if not 0 < info.rank < self.world_size:
            raise SchemaError(f"rank {info.rank} has no place among ranks 1..{self.world_size - 1} of this channel")
        holder = self.joined.get(info.rank)
        if holder is not None and holder != peer:
            log.warning(
                "rank %d joined again from %s; the rank %d at %s, still connected, is replaced",
                info.rank,
                info.control,
                info.rank,
                self.ranks[info.rank].control,
            )

    def left(self, peer: bytes) -> None:
        """A connection closed: a rank that joined over it may join again (a restarted rank)."""
        for rank in [r for r, p in self.joined.items() if p == peer]:
            del self.joined[rank]

    def on_started(self, version: int) -> None:
        """Rank 0 began staging `version` (subscribers may start pulling it)."""
        self.started = version
        self._wake()

    def on_staged(self, rank: int, version: int, ok: bool) -> None:
        """`rank` finished staging `version` (or abandoned it: `ok` False)."""
        if not ok:
            self.abandoned.append(version)
            self.holders.pop(version, None)
        else:
            ranks = self.holders.setdefault(version, set())
            ranks.add(rank)
            for old in sorted(self.holders)[:-RECENT]:
                del self.holders[old]  # never complete (a rank died or failed it): forgotten
            if len(ranks) == self.world_size and version > self.complete:
                self._complete(version)
        self._wake()

    def _complete(self, version: int) -> None:
        for old in [v for v in self.holders if v <= version]:
            del self.holders[old]
        if self._recorder is None:
            self._recorded([version], None)
            return
        self._unrecorded = [*self._unrecorded, version][-RECENT:]
        self._record_next()

    def _record_next(self) -> None:
        """Server thread: hand the versions waiting for a record to the worker, unless one is in
        flight. Records go one at a time, each for the newest version complete by then, so a
        slow or unreachable controller (seconds per call) delays versions, never queues them."""
        if self._recording or not self._unrecorded:
            return
        assert self._recorder is not None  # versions wait for a record only with a recorder
        self._recording = True
        versions, self._unrecorded = self._unrecorded, []
        self._recorder.submit(self._record, versions)

    def _record(self, versions: list[int]) -> None:
        """Worker thread: record the newest of `versions` in the controller, then report to the
        server thread."""
        assert self.record is not None  # the recording worker exists only with a `record`
        error: Exception | None = None
        try:
            self.record(max(versions))
        except Exception as exc:  # noqa: BLE001 - the controller refused or is gone: nobody is told
            error = exc
        self.submit(lambda: self._recorded(versions, error))

    def _recorded(self, versions: list[int], error: Exception | None) -> None:
        """Server thread: the newest of `versions` is recorded, and with it the others (or it
        could not be: they are abandoned); tell waiters, and start the next record."""
        self._recording = False
        newest = max(versions)
        if error is not None:
            log.error("could not record version %d in the controller: %s", newest, error)
            self.abandoned.extend(versions)
        elif newest > self.complete:
            self.complete = newest
            self.recent.extend(versions)
        self._record_next()
        self._wake()

    def close(self) -> None:
        """Stop the recording worker (a record in flight finishes; nobody hears of it)."""
        if self._recorder is not None:
            self._recorder.shutdown(wait=False, cancel_futures=True)

    def _answer(self, msg: Latest | Confirm, pending: Pending) -> bool:
        """Answer `msg` now if it can be; False to keep waiting. Rank 0's lease goes with a
        complete offer, also to a request that waited for it: the lease is held by the
        request's connection, so a subscriber that died while it waited (its connection
        closed: the server drops its requests) is never granted one, and one that dies after
        the offer went out frees it when its connection closes, not when it expires."""
        if isinstance(msg, Confirm):
            if msg.version in self.recent:
                pending.reply(Ok())
            elif msg.version in self.abandoned or msg.version < self.complete:
                pending.fail(WeightSyncError(f"version {msg.version} was abandoned by the trainer"))
            else:
                return False
            return True
        ready = len(self.ranks) == self.world_size
        if ready and self.complete > msg.after:
            granted = self.grant(self.complete, msg.lease, pending.peer) if msg.lease else None
            if msg.lease and granted is None and self.claimed() > self.complete:
                # rank 0 is staging a newer version in the slot that held this one (one slot):
                # no lease can pin it any more, so offer the newer one once it is whole
                if msg.timeout > 0:
                    return False
                pending.reply(Offer(msg.after, True, self._rank_list()))  # nothing to apply now
                return True
            pending.reply(Offer(self.complete, True, self._rank_list(), granted))
        elif (
            ready
            and not msg.complete
            and self.started > max(msg.after, self.complete)
            and self.started not in self.abandoned
        ):
            pending.reply(Offer(self.started, False, self._rank_list()))
        elif msg.timeout <= 0:
            pending.reply(Offer(self.complete if ready else -1, True, self._rank_list() if ready else []))
        else:
            return False
        return True

    def _rank_list(self) -> list[RankInfo]:
        return [self.ranks[r] for r in range(self.world_size)]

    def _wake(self) -> None:
        waiting, self.waiters = self.waiters, []
        for msg, pending in waiting:
            if not pending.done and not self._answer(msg, pending):
                self.waiters.append((msg, pending))
