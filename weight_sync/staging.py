"""Staging memory: pre-faulted segments that stay mapped, and the slots that hold versions.

A `Segment` is one buffer allocated and touched once, then reused for every version (first
touch costs far more than a warm copy: docs/architecture.md, section 3). Shared segments are
`memfd`s: another process on the host maps one through `/proc/<pid>/fd/<fd>` and it vanishes
with its last user, so a killed publisher leaves nothing behind in /dev/shm. Private segments
(a subscriber's receive buffer) are anonymous memory advised to use huge pages.

A segment copied to or from GPU memory is registered with CUDA (`pin`), once, in a process that
uses CUDA, and unregistered before it is unmapped.

A `Slot` is a segment plus the version staged in it, how many bytes of it are staged so far
(readers may stream bucket k while bucket k+1 is packed) and the leases of its readers: a slot
is reused only once every lease on it is released or has expired. `SlotTable` keeps a
publisher's slots under one condition variable; a table `retire`d gives its memory back as its
readers and writers let go of each slot.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from transfer_queue import ClosedError, TimeoutError, WeightSyncError
from transfer_queue.cuda import HostRegistry, synchronize, tensor_ptr
from transfer_queue.host import map_file, unmap

__all__ = ["Segment", "Slot", "SlotTable", "map_segment"]


class Segment:
    """`size` bytes of memory, mapped once and touched up front; `tensor` is a uint8 view. On a
    `device` it is that device's memory instead (CUDA: shared through CUDA IPC, not a file)."""

    def __init__(
        self, size: int, shared: bool = True, name: str = "sluice-weights", device: torch.device | None = None
    ):
        self.size = size
        self.fd = -1
        self.derived: dict[str, Any] = {}
        """What the owner derives from this segment and reuses while it lives (views into it,
        e.g. where each tensor is packed): dropped when it closes, so nothing keeps it alive."""
        self._pinned = HostRegistry()
        if device is not None:
            self._mm = None
            self.tensor = torch.zeros(max(size, 1), dtype=torch.uint8, device=device)[:size]
            # the fill is done before anyone gets the memory: libraries that copy into it (UCX,
            # through NIXL) or processes that open it do not order themselves after this stream
            synchronize(device)
            return
        length = max(size, 1)
        if shared:
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(self.fd, length)
            self._mm = map_file(self.fd, length)
        else:
            self._mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)[:size]
        # Fault every page in now, not on the data path, by writing it: torch lets the process's
        # other threads run meanwhile, where `MAP_POPULATE` holds the GIL for the whole mapping
        # (seconds for a model: a publisher's control thread would answer no one meanwhile).
        self.tensor.zero_()

    def pin(self) -> bool:
        """Register the (host) segment with CUDA (once) so copies between it and a GPU run at
        pinned speed; False where CUDA is absent or refuses, or the segment is GPU memory."""
        return self._mm is not None and self._pinned.register(tensor_ptr(self.tensor), self.size)

    @property
    def path(self) -> str:
        """Where a co-located process opens this (shared, host) segment; "" for others."""
        return f"/proc/{os.getpid()}/fd/{self.fd}" if self.fd >= 0 else ""

    def close(self) -> None:
        """Unmap and free. A view still alive elsewhere keeps the mapping until it is gone."""
        if not hasattr(self, "tensor"):
            return  # closed already
        self._pinned.clear()  # before the memory goes
        self.derived.clear()
        del self.tensor
        if self._mm is None:  # GPU memory: freed with its tensor
            return
        unmap(self._mm)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_segment(path: str, size: int) -> tuple[mmap.mmap, torch.Tensor]:
    """Map another process's shared segment read-only: (mapping, uint8 view of `size` bytes),
    its pages faulted in at once (not one fault per page during the first apply) by a torch
    read of a byte per page, which lets the process's other threads run (`MAP_POPULATE` holds
    the GIL for the whole mapping: 0.13 s a GiB here).

    Raises `OSError` if the segment cannot be opened (not co-located, or its owner is gone).
    """
    mm = map_file(path, size, writable=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only ever read it
        view = torch.frombuffer(mm, dtype=torch.uint8)[:size]
    view[:: mmap.PAGESIZE].sum()
    return mm, view


class Slot:
    """One segment holding (part of) one version, with staging progress and reader leases."""

    def __init__(self, index: int, cond: threading.Condition):
        self.index = index
        self.generation = 0
        """Bumped whenever the segment is replaced (readers must remap)."""
        self.segment: Segment | None = None
        self.version = -1
        self.filled = 0
        """Bytes staged so far, from the start; readers may read below this mark."""
        self.complete = False
        self.failed = False
        self.leases: dict[int, float] = {}
        """Lease id -> monotonic deadline."""
        self.manifest: Any = None
        """What the owner staged here (a publisher's `Manifest`), set after `claim`."""
        self._cond = cond

    @property
    def size(self) -> int:
        return self.segment.size if self.segment is not None else 0

    @property
    def mapped(self) -> Segment:
        """The segment of a claimed slot (only a slot never claimed has none)."""
        if self.segment is None:
            raise WeightSyncError(f"staging slot {self.index} was never claimed")
        return self.segment

    def busy(self, now: float) -> bool:
        return any(deadline > now for deadline in self.leases.values())

    @property
    def finishing(self) -> bool:
        """Claimed for a version that is neither complete nor failed yet: its publisher's
        finisher has still to mark it, so the slot must not be claimed again before that."""
        return self.version >= 0 and not self.complete and not self.failed

    def wait_filled(self, end: int, version: int, timeout: float) -> None:
        """Block until bytes [0, end) of `version` are staged.

        Raises `WeightSyncError` if staging of that version failed or the slot moved on, and
        `TimeoutError` after `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.version != version or self.failed:
                    raise WeightSyncError(f"version {version} was abandoned while it was being read")
                if self.filled >= end:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"version {version}: bytes up to {end} not staged within {timeout} s")
                self._cond.wait(left)


class SlotTable:
    """A fixed number of slots, reused oldest-first once their readers are done."""

    def __init__(self, count: int, shared: bool, lease_timeout: float, ids: Iterator[int] | None = None):
        """`ids`: where lease ids come from; tables whose leases one `Release` may name share it
        (a publisher's host and GPU staging), so an id names one lease in all of them."""
        self.device: torch.device | None = None
        """Where new segments are allocated: None for host memory, else a CUDA device."""
        self.cond = threading.Condition()
        self.slots = [Slot(i, self.cond) for i in range(count)]
        self.shared = shared
        self.lease_timeout = lease_timeout
        self.pin = False
        """Register every segment with CUDA (set once the owner copies GPU tensors through them)."""
        self._lease_ids = ids if ids is not None else itertools.count(1)
        self._lease_slot: dict[int, Slot] = {}
        self._lease_holder: dict[int, bytes] = {}
        """Lease id -> the client connection it was granted to (`lease(holder=)`)."""
        self._in_hand: set[int] = set()
        """Indexes of slots whose segment `prepare` or `claim` allocates, or `pin_all` registers,
        outside the lock: no other `claim` takes them (it waits for one being prepared), and
        nothing else replaces or unmaps their segment."""
        self._closed = False
        self._retired = False
        """Set by `retire`: no slot is claimed or allocated again, and each one's memory is
        freed once no reader holds it and no writer is finishing it."""

    def claim(self, version: int, size: int, timeout: float, keep_newer: bool = False) -> Slot:
        """A slot to stage `version` into (`size` bytes), waiting for its readers to finish.

        The slot holding the newest complete version is taken only when it is the only one; a
        slot whose version is still being finished is never taken (the finisher would mark the
        new version complete half-staged); with `keep_newer`, nor is one holding a complete
        version newer than `version` (a copy of an older version must not evict it).

        A slot whose segment is missing or smaller than `size` gets a new one, made (and
        registered, when `pin` is set) outside the lock as `prepare` makes them: for a model's
        size that takes seconds, and leases and releases go on meanwhile. The slot is in hand
        and claimed for `version` then: no other claim takes it, and no lease is granted on it
        until its segment is in.

        Raises:
            TimeoutError: readers still hold every candidate after `timeout` seconds.
            WeightSyncError: `keep_newer`, and every slot holds a newer complete version; or
                the table was retired (before or while the slot's segment was made).
            ClosedError: the table was closed (before or while the slot's segment was made).
            OSError: no host memory for the slot's new segment (`torch.OutOfMemoryError`: no
                GPU memory); the slot is left free, holding no version.
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while (slot := self._free_slot(version, keep_newer)) is None:
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(
                        f"every staging slot is still being read after {timeout} s; subscribers are stuck or too slow"
                    )
                self._wait(now, deadline)
            self._reset(slot, version)
            if slot.segment is not None and slot.segment.size >= size:
                return slot
            old, slot.segment = slot.segment, None  # its readers are gone; `_make` frees it
            self._in_hand.add(slot.index)
        if not self._make(slot, size, old):
            self._check_open()  # it was freed because the table closed or retired meanwhile: raises
        return slot

    def _free_slot(self, version: int, keep_newer: bool) -> Slot | None:
        """The slot `claim` takes now, or None while it must wait (for readers, or for the best
        free slot being prepared). Under the lock.

        Raises:
            WeightSyncError, ClosedError: as `claim`, at once.
        """
        self._check_open()
        now = time.monotonic()
        newest = max((s.version for s in self.slots if s.complete), default=-1)
        if keep_newer and all(s.complete and not s.failed and s.version > version for s in self.slots):
            raise WeightSyncError(f"staging holds only newer versions than {version} (up to {newest})")
        candidates = sorted(self.slots, key=lambda s: (s.version == newest and len(self.slots) > 1, s.version))
        for slot in candidates:
            if slot.busy(now) or slot.finishing:
                continue
            if keep_newer and slot.complete and not slot.failed and slot.version > version:
                continue
            if slot.index in self._in_hand:
                return None  # the best free slot is being prepared: wait for it, not the next best
            return slot
        return None

    def _check_open(self) -> None:
        """Raises `ClosedError` once the table is closed, `WeightSyncError` once it is retired."""
        if self._closed:
            raise ClosedError("this staging was closed")
        if self._retired:
            raise WeightSyncError("this staging was retired: its memory is being given back")

    def prepare(self, size: int) -> None:
        """Allocate and fault in (and register, when `pin` is set) `size` bytes in every slot
        never claimed yet, now rather than in the first versions' `claim`. The memory is made
        outside the lock, so readers and releases go on meanwhile; `claim` waits for a slot
        being prepared rather than allocating it twice."""
        for slot in self.slots:
            with self.cond:
                if slot.version >= 0 or slot.index in self._in_hand or self._closed or self._retired:
                    continue
                if slot.segment is not None and slot.segment.size >= size:
                    if self.pin:
                        slot.segment.pin()
                    continue
                self._in_hand.add(slot.index)
            self._make(slot, size)

    def prepare_in_background(self, size: int, failed: Callable[[Exception], None]) -> threading.Thread:
        """`prepare(size)` on a thread (started and returned), so that the slots are ready
        before the versions that need them: a publisher's host slots once its first version
        told the model's size, its GPU staging's once a subscriber reads it. If it fails (no
        memory), `failed` is called with the error from that thread; the slots it did not
        allocate are allocated by the `claim`s that need them, if there is memory then."""

        def run() -> None:
            try:
                self.prepare(size)
            except Exception as exc:  # noqa: BLE001 - the owner decides what a failure means
                failed(exc)

        thread = threading.Thread(target=run, name="sluice-ws-staging", daemon=True)
        thread.start()
        return thread

    def _make(self, slot: Slot, size: int, old: Segment | None = None) -> bool:
        """Make `slot`'s segment of `size` bytes (registered when `pin` is set), the slot in
        hand (the caller put it there), outside the lock: `old`, the segment it replaces, is
        freed first (the two may not fit at once). Then `_install` it; returns whether it went
        in (False: the table closed or retired meanwhile, and it was freed).

        Raises what allocating or registering raised (no memory): the segment is freed and the
        slot handed back without one.
        """
        segment = None
        try:
            if old is not None:
                old.close()
            segment = Segment(size, shared=self.shared, device=self.device)
            if self.pin:
                segment.pin()
        except BaseException:
            if segment is not None:
                segment.close()
                segment = None
            raise
        finally:
            self._install(slot, segment)
        return slot.segment is segment

    def _install(self, slot: Slot, segment: Segment | None) -> None:
        """Put a segment `_make` made into `slot` (`claim` skips it until then), unless the
        table closed or retired meanwhile (then the segment is freed). A slot it leaves without
        a new segment holds no version: a claim's that failed is free for the next claim."""
        with self.cond:
            self._hand_back(slot)
            if self._closed or self._retired:
                if segment is not None:
                    segment.close()
                segment = None
            if segment is None:
                self._reset(slot, -1)
                return
            if slot.segment is not None:
                slot.segment.close()
            slot.segment = segment
            slot.generation += 1
            if self.pin:
                segment.pin()  # `pin_all` may have come while it was being made

    def pin_all(self) -> None:
        """Register every segment with CUDA, those there now and those made later. Registering
        takes long for large segments, so it runs outside the lock (leases and releases go
        on); the slots being registered are in hand meanwhile: `claim` waits for them rather
        than replace their segment, and `close` leaves their unmapping to this."""
        with self.cond:
            self.pin = True
            mine = [s for s in self.slots if s.segment is not None and s.index not in self._in_hand]
            self._in_hand.update(s.index for s in mine)
        handed = 0
        try:
            for slot in mine:
                slot.mapped.pin()
                with self.cond:
                    self._hand_back(slot)
                handed += 1
        finally:  # a registration raised: the slots not handed back yet are, unregistered
            with self.cond:
                for slot in mine[handed:]:
                    self._hand_back(slot)

    def _hand_back(self, slot: Slot) -> None:
        """A slot `prepare`, `claim` or `pin_all` held outside the lock is back (under the
        lock): `claim` may take it again, and what `close` or `retire` left to its holder is
        done now."""
        self._in_hand.discard(slot.index)
        self.cond.notify_all()
        if self._closed and slot.segment is not None:
            slot.segment.close()
            slot.segment = None
        self._free_if_done(slot)

    def _reset(self, slot: Slot, version: int) -> None:
        """Claim `slot` for `version` (-1: for none, its memory gone): the leases on it end,
        nothing is staged yet."""
        for lease in slot.leases:
            self._lease_slot.pop(lease, None)
            self._lease_holder.pop(lease, None)
        slot.leases.clear()
        slot.version, slot.filled, slot.complete, slot.failed = version, 0, False, False

    def advance(self, slot: Slot, filled: int, complete: bool = False) -> None:
        """Mark bytes [0, filled) staged (and the version complete), waking waiting readers."""
        with self.cond:
            slot.filled = filled
            slot.complete = complete
            self.cond.notify_all()
            self._free_if_done(slot)

    def fail(self, slot: Slot) -> None:
        """Abandon the version being staged in `slot`; its readers get `WeightSyncError`."""
        with self.cond:
            slot.failed = True
            self.cond.notify_all()
            self._free_if_done(slot)

    def retire(self) -> None:
        """Free this table's slots: every slot's segment no reader holds and no writer is
        finishing (`Slot.finishing`: its owner has still to mark it complete or failed) at
        once, and each other one as its last lease is released (one that expired unreleased:
        at the table's next release of any lease) or its writer marks it. No slot is claimed
        or allocated, nor leased, again. Freeing a GPU slot does not wait for the GPU: whoever
        queued copies into or out of it has them done before marking or releasing it (a
        publisher's finisher waits for its copies' events, `publish` synchronizes the stream of
        a pack that failed, a catch-up and a reader wait for their copies)."""
        with self.cond:
            self._retired = True
            self.cond.notify_all()  # a claim waiting for readers raises now
            for slot in self.slots:
                self._free_if_done(slot)

    def wait_freed(self, timeout: float) -> bool:
        """Wait, at most `timeout` seconds, until a retired table has freed every slot (each as
        its last lease is released or expires, its writer done); whether it has."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for slot in self.slots:
                    self._free_if_done(slot)  # one whose last lease expired meanwhile
                if not self._in_hand and all(s.segment is None for s in self.slots):
                    return True
                now = time.monotonic()
                if now >= deadline:
                    return False
                self._wait(now, deadline)

    def _wait(self, now: float, deadline: float) -> None:
        """Wait (under the lock) for the table to change: a notify (a release, a slot prepared
        or marked), or else the first lease's expiry, or `deadline`."""
        expiry = min((d for s in self.slots for d in s.leases.values() if d > now), default=deadline)
        self.cond.wait(min(deadline, expiry) - now)

    def _free_if_done(self, slot: Slot) -> None:
        """Free `slot`'s segment if the table is retired and nothing holds it (a lease not
        expired, a finishing writer, a holder outside the lock: `prepare`, `claim` or `pin_all`);
        its version is then gone. Under the lock."""
        if (
            not self._retired
            or slot.segment is None
            or slot.finishing
            or slot.index in self._in_hand
            or slot.busy(time.monotonic())
        ):
            return
        slot.segment.close()
        slot.segment = None
        slot.generation += 1
        self._reset(slot, -1)

    def newest(self) -> int:
        """The newest version a slot is claimed for, complete or still being staged (-1: none;
        a failed one is no longer claimed)."""
        with self.cond:
            return max((s.version for s in self.slots if not s.failed), default=-1)

    def find(self, version: int) -> Slot | None:
        with self.cond:
            return next((s for s in self.slots if s.version == version and not s.failed), None)

    def lease(self, version: int, holder: bytes = b"") -> tuple[int, Slot] | None:
        """Pin the slot holding `version` (complete or being staged) for one reader; a lease
        with a `holder` (the reader's connection) also ends with `release_holder(holder)`.
        None if no slot holds it, its slot's segment is still being made (`claim`), or the table
        was retired (its memory is being given back)."""
        with self.cond:
            slot = next((s for s in self.slots if s.version == version and not s.failed), None)
            if slot is None or slot.segment is None or self._retired:
                return None
            lease = next(self._lease_ids)
            slot.leases[lease] = time.monotonic() + self.lease_timeout
            self._lease_slot[lease] = slot
            if holder:
                self._lease_holder[lease] = holder
            return lease, slot

    def renew(self, lease: int) -> bool:
        """Extend `lease` to `lease_timeout` from now if it still pins its slot: a reader that
        makes progress (a stream sending a version piece by piece, slower than `lease_timeout`
        in all) is not presumed dead, and one that expired while nothing reclaimed its slot read
        nothing torn. False once it was released or its slot claimed again (`_reset` ends its
        leases before anything is written): what is read under it may hold a later version."""
        with self.cond:
            slot = self._lease_slot.get(lease)
            if slot is None:
                return False
            slot.leases[lease] = time.monotonic() + self.lease_timeout
            return True

    def leased(self, lease: int) -> Slot | None:
        """The slot `lease` pins, or None if it was released or the slot reused."""
        with self.cond:
            return self._lease_slot.get(lease)

    def release(self, lease: int) -> bool:
        """End `lease` (nothing if it is not held); whether it still pinned its slot, i.e. the
        slot was not claimed again since it was granted, so what was read under it is whole
        (expired but not yet reused counts as held). In a retired table, every slot is looked at
        again: one whose last lease expired unreleased is freed here, at the next release of
        any lease (a publisher passes each release to all its tables)."""
        with self.cond:
            self._lease_holder.pop(lease, None)
            slot = self._lease_slot.pop(lease, None)
            if slot is not None:
                slot.leases.pop(lease, None)
                self.cond.notify_all()
            for held in self.slots if self._retired else ():
                self._free_if_done(held)
            return slot is not None

    def release_holder(self, holder: bytes) -> None:
        """Release every lease granted to `holder`: its connection closed, so no reader is
        left behind it (a dead reader frees its slots now, not when its leases expire)."""
        with self.cond:
            for lease in [k for k, h in self._lease_holder.items() if h == holder]:
                self.release(lease)  # the condition's lock is reentrant

    def close(self) -> None:
        """Free every segment now (one in hand, being made or registered outside the lock, is
        freed by its holder when done). A `claim` after it raises `ClosedError`."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()  # a claim waiting for readers raises now
            for slot in self.slots:
                if slot.segment is not None and slot.index not in self._in_hand:
                    slot.segment.close()
                    slot.segment = None
