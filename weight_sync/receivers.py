"""How a subscriber brings versions in: one receiver strategy per transport mode, chosen once.

- `MappedReceiver` ("map": shm, cuda_ipc, here): nothing moves ahead of time. `poll` asks rank 0
  for the newest complete version and its lease in one call (`Latest.lease`), leases it on the
  other ranks, copies the planned reads straight out of the mapped slots into the tensors, and
  posts the releases.
- `ReadsReceiver` ("reads": tcp, ucx) and `ImageReceiver` ("image": torch), in `background`: a
  thread pulls (or is broadcast) each new version into the subscriber's own pre-faulted buffer
  while the worker keeps generating; `poll` applies a version once all of it is in.

Every receiver writes through `Targets.apply`, only ever a whole version.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from transfer_queue import WeightSyncError
from transfer_queue.cuda import copies, copy_each
from transfer_queue.host import host_id

from .checksum import compare
from .plan import Copy, Plan
from .protocol import Checksums, Granted, Latest, Offer, connect
from .ranks import PublisherRanks, close_after_posts
from .transports.stream import contiguous_span

__all__ = ["Targets", "ReceiveSettings", "Receiver", "MappedReceiver", "coalesce"]


class Targets:
    """The version the subscriber's tensors hold, and how it was applied."""

    def __init__(self) -> None:
        self.version = -1
        """The version the tensors hold (-1: none applied yet, or copies straight from a
        publisher's slot that cannot be vouched for: the next apply brings a whole one)."""
        self.apply_seconds = 0.0
        """How long the last apply (the copy into the tensors) took."""

    def apply(
        self,
        version: int,
        plan: Plan,
        sources: Iterable[torch.Tensor],
        checksums: dict[int, Checksums],
        dsts: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Copy every planned read (from `sources`, one per copy of `plan`, in order) into the
        tensors, then check checksums if validating. `dsts`: where each source goes when it is
        not one copy's read (a "map" receiver merges copies: `coalesce`); default each copy's
        `dst`.

        A source tensor the publisher found changed since staging, or (one source per copy)
        bytes that arrived different from the publisher's, stop the apply before any copy: the
        tensors keep their version (a background receiver drops the version and waits for the
        next one). Merged copies (`dsts`) are checked once written: a slice that differs is
        reported by name and `version` is -1, as the tensors then hold no whole version.

        Raises:
            WeightSyncError: the checksums disagree.
        """
        corrupt = sorted({name for c in checksums.values() for name in c.corrupt})
        if corrupt:
            raise WeightSyncError(
                f"version {version} changed in the publisher's staging after its checksums were taken: {', '.join(corrupt)}"
            )
        sources = list(sources)
        if checksums and dsts is None:
            compare(plan, checksums, sources)
        start = time.perf_counter()
        device = plan.device
        targets = [c.dst for c in plan.copies] if dsts is None else list(dsts)
        with torch.no_grad(), copies(device):  # GPU tensors: copies on a side stream, one wait at the end
            copy_each(targets, sources, non_blocking=device is not None)
        self.apply_seconds = time.perf_counter() - start
        if checksums and dsts is not None:
            try:
                compare(plan, checksums)
            except WeightSyncError:
                self.version = -1
                raise
        self.version = version


@dataclass(frozen=True)
class ReceiveSettings:
    """How a subscriber asked to receive (see `WeightSubscriber`'s arguments)."""

    validate: bool = False
    """Compare checksums of every applied slice with the publisher's snapshot."""
    relay: bool = True
    """Re-serve received bytes to other subscribers (transports that relay)."""
    pipelined: bool = True
    """Pull a version while it is still being staged."""
    buffers: int | None = None
    """Receive buffers of background receivers (None: the receiver's default)."""
    delta_threads: int = 1
    """Threads a delta pull applies its frames on (`delta.threads()`)."""


class Receiver(ABC):
    """Brings versions of the channel whose coordinator (rank 0) is at `coordinator` into `targets`."""

    mode: ClassVar[str]

    def __init__(self, ranks: PublisherRanks, targets: Targets, coordinator: str, settings: ReceiveSettings):
        self.ranks = ranks
        self.targets = targets
        self.settings = settings
        self.timeout = ranks.timeout
        self.last_sources: list[str] = []
        """Per publisher rank, where the last received version came from: "" for the rank
        itself, else the endpoint of the subscriber that relayed it."""
        self.last_received: list[int] = []
        """Per publisher rank, the bytes its stream carried for the last received version:
        delta frames, or the whole reads (0 where the transport does not stream)."""

    @abstractmethod
    def poll(self, timeout: float) -> int | None:
        """Apply the newest whole version newer than the targets', waiting up to `timeout` for
        one; returns the version applied, or None.

        Raises:
            WeightSyncError: a transfer failed (the tensors keep their version).
        """

    @abstractmethod
    def close(self) -> None:
        """Stop receiving; the tensors keep the version they hold."""

    def _checksums(self, plan: Plan, grants: list[Granted]) -> dict[int, Checksums]:
        return self.ranks.verify(plan, grants) if self.settings.validate else {}


class MappedReceiver(Receiver):
    """ "map" transports: each `poll` copies straight from the publishers' mapped slots."""

    mode = "map"

    def __init__(self, ranks: PublisherRanks, targets: Targets, coordinator: str, settings: ReceiveSettings):
        super().__init__(ranks, targets, coordinator, settings)
        self._here = host_id()
        self._coordinator = connect(ranks.info[0], self._here, self.timeout, ranks.credentials)
        """Rank 0's control server, over its local lane (the rank is on this host): each
        version's offer and rank 0's release wake one thread on their way, not three."""
        self._released = False
        """Whether a release was posted to `_coordinator` (it is then flushed before closing)."""
        self._views: dict[
            tuple[tuple[int, ...], tuple[tuple[int, int], ...]], tuple[list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        """(manifest ids, (slot index, generation) per rank) -> (destinations, sources) of the
        plan's copies out of those slots, merged where they can be (`coalesce`): made once, not
        per version."""

    def poll(self, timeout: float) -> int | None:
        held = self.targets.version
        latest = Latest(held, True, timeout, lease=self.ranks.transport.name)
        since = time.monotonic()  # no lease this poll takes is granted before
        try:
            offer: Offer = self._coordinator.call(latest, timeout=timeout + self.timeout)
        except BaseException:
            # an offer still to come would carry a lease held by this connection: closing it
            # releases that lease at rank 0 (a new connection asks next time)
            self._coordinator.close()
            self._coordinator = connect(self.ranks.info[0], self._here, self.timeout, self.ranks.credentials)
            self._released = False
            raise
        if offer.version <= held:
            return None
        grants = self.ranks.lease_all(offer.version, first=offer.granted)
        try:
            plan = self.ranks.plan(tuple(g.manifest for g in grants))
            dsts, sources = self._sources(offer.version, grants, plan)
            checksums = self._checksums(plan, grants)
            self.targets.apply(offer.version, plan, sources, checksums, dsts)
        except BaseException:
            self._release(grants)
            raise
        try:
            self._release(grants, {r for r in range(len(grants)) if plan.reads(r)}, since)
        except WeightSyncError as exc:
            self.targets.version = -1  # the copies went straight into the tensors
            raise WeightSyncError(
                f"version {offer.version} was copied straight from staging that cannot be vouched for ({exc}): "
                "the tensors hold no whole version until the next one is applied"
            ) from exc
        return offer.version

    def _release(self, grants: list[Granted], read: Collection[int] = (), since: float = 0.0) -> None:
        """Release the leases (`PublisherRanks.release`, `read` and `since` as there): rank 0's
        over the connection that holds it (were it lost, that connection's closing frees it)."""
        self._released = True  # what was posted over `_coordinator` is flushed before it closes
        self.ranks.release(grants, read, since, first=self._coordinator)

    def _sources(
        self, version: int, grants: list[Granted], plan: Plan
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) of the copies of `plan` out of the granted slots (`coalesce`):
        views made once per set of manifests and slot generations (a replaced slot is mapped
        again and its views are dropped, so they do not keep its old mapping alive)."""
        key = (tuple(g.manifest for g in grants), tuple((g.slot.index, g.slot.generation) for g in grants))
        views = self._views.get(key)
        if views is None:
            slots = {
                rank: self.ranks.transport.receive(self.ranks.job(rank, version, grant, plan))
                for rank, grant in enumerate(grants)
            }
            views = coalesce(plan, slots)
            self._views = {k: v for k, v in self._views.items() if _same_memory(k, key)}
            while len(self._views) >= _KEPT_VIEWS:
                del self._views[next(iter(self._views))]
            self._views[key] = views
        return views

    def close(self) -> None:
        self._views.clear()
        self.ranks.transport.close()
        close_after_posts(self._coordinator, self._released)


def coalesce(plan: Plan, slots: dict[int, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(destinations, sources) of `plan`'s copies out of rank r's slot `slots[r]` (uint8), as
    few copies as they allow: consecutive copies that read one contiguous run of a slot and
    write one contiguous run of one target's memory (the parts of a fused qkv_proj staged as
    q, k and v one after another; targets kept in one flat buffer) become one copy of those
    bytes. Each copy costs a launch on a GPU and a Python step on a CPU, whatever its size."""
    groups: list[list[Copy]] = []
    # the last group's rank, slot end, storage, memory end, and the end of its first target's
    # storage (the merged view is made on that storage: it must hold the whole run)
    ends: tuple[int, int, int, int, int] | None = None
    for c in plan.copies:
        span = contiguous_span(c.read)
        dst = c.dst
        mergeable = span is not None and dst.is_contiguous()
        if mergeable:
            assert span is not None  # mergeable says so
            storage = dst.untyped_storage()
            end = dst.data_ptr() + c.read.nbytes
            if (
                ends is not None
                and ends[:4] == (c.rank, span[0], storage.data_ptr(), dst.data_ptr())
                and end <= ends[4]
            ):
                groups[-1].append(c)
                limit = ends[4]
            else:
                groups.append([c])
                limit = storage.data_ptr() + storage.nbytes()
            ends = (c.rank, span[1], storage.data_ptr(), end, limit)
        else:
            groups.append([c])
            ends = None
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for group in groups:
        first = group[0]
        if len(group) == 1:
            dsts.append(first.dst)
            srcs.append(first.read.view(slots[first.rank], first.dtype))
            continue
        start = contiguous_span(first.read)
        stop = contiguous_span(group[-1].read)
        assert start is not None and stop is not None  # merged copies are contiguous
        nbytes = stop[1] - start[0]
        dst = first.dst
        dsts.append(
            torch.empty(0, dtype=torch.uint8, device=dst.device).set_(
                dst.untyped_storage(), dst.storage_offset() * dst.element_size(), (nbytes,), (1,)
            )
        )
        srcs.append(slots[first.rank][start[0] : stop[1]])
    return dsts, srcs


_KEPT_VIEWS = 8
"""Sets of source views a "map" receiver keeps (one per combination of slots in use)."""


def _same_memory(
    kept: tuple[tuple[int, ...], tuple[tuple[int, int], ...]], new: tuple[tuple[int, ...], tuple[tuple[int, int], ...]]
) -> bool:
    """Whether views kept for `kept` still read live slots once `new`'s are in use: same
    manifests, and no slot of a rank replaced by a newer generation."""
    return kept[0] == new[0] and all(a[0] != b[0] or a[1] == b[1] for a, b in zip(kept[1], new[1]))
