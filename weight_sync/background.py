"""Receivers that work ahead of the caller: a thread brings each new version into the
subscriber's own pre-faulted buffers while the worker keeps generating, and `poll` applies a
version once all of it is in (in the caller's thread, like every apply).

- `ReadsReceiver` ("reads": tcp, ucx) pulls each rank's planned reads back to back; with tcp
  the subscriber also relays what it received to the subscribers the publisher points at it
  (`RelaySource`), falling back to the rank itself when its own relay fails.
- `ImageReceiver` ("image": torch) is broadcast rank 0's whole slot, or a delta against the
  last version it received, applied to a copy of that version's image.

A transfer that fails is discarded and its `WeightSyncError` raised by the next `poll`; the
tensors keep the version they had.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from transfer_queue import SchemaError, SluiceError, TimeoutError, WeightSyncError
from transfer_queue.cuda import in_use

from .delta import WHOLE, Frame
from .layout import numel
from .plan import Copy, Plan
from .protocol import Checksums, Confirm, Granted, Latest, Offer, Pull, RelayPull, RpcClient
from .ranks import PublisherRanks
from .receivers import Receiver, ReceiveSettings, Targets
from .staging import Slot, SlotTable
from .transports import Job, Source
from .transports.stream import FrameLog, as_bytes, read_chunks

__all__ = ["BackgroundReceiver", "ReadsReceiver", "ImageReceiver", "RelaySource"]

log = logging.getLogger("sluice.weight_sync")

_RETRY_SECONDS = 0.2
"""Pause after a failed transfer before trying the newest version again."""


@dataclass
class _Received:
    """A version whole in the receive buffer, waiting to be applied."""

    version: int
    plan: Plan
    buffer: torch.Tensor
    """What the copies read from: the version's image (image) or its reads back to back (reads)."""
    lease: int
    """The subscriber's own lease that keeps the buffer from being reused before apply."""
    checksums: dict[int, Checksums]


class BackgroundReceiver(Receiver):
    """Receives in a thread into pre-faulted buffers; `poll` applies what is whole."""

    buffers: ClassVar[int] = 1
    """Receive buffers unless the subscriber asks for another number."""

    def __init__(self, ranks: PublisherRanks, targets: Targets, coordinator: str, settings: ReceiveSettings):
        super().__init__(ranks, targets, coordinator, settings)
        self.table = SlotTable(settings.buffers or self.buffers, shared=False, lease_timeout=1e9)
        self.table.device = ranks.transport.receive_device
        if in_use():  # GPU targets: their host-to-device applies read registered buffers
            self.table.pin_all()
        self.cond = threading.Condition()
        self.closed = False
        self.holding: tuple[int, Plan] | None = None
        """(version, plan) of what the receive buffer holds or is filling (relays serve it)."""
        self.frame_logs: dict[int, FrameLog] = {}
        """Per publisher rank, the delta frames received of `holding`'s version (relays
        forward them to subscribers on the same base); set with `holding`."""
        self._received: _Received | None = None
        self._error: WeightSyncError | SchemaError | None = None
        """What the thread's last try raised, for `poll` to raise: a `SchemaError` (the tensors do
        not fit what is published) until a version is received, others once."""
        self._fetched = -1
        """The newest version the thread brought in (applied or not)."""
        self._coordinator: RpcClient | None = None
        if settings.relay and ranks.transport.fanout is not None and ranks.transport.receive_device is None:
            # a relay serves from its receive buffer, which must be host memory to send from
            ranks.relay_endpoint = ranks.transport.serve(RelaySource(self))
        self._thread = threading.Thread(target=self._loop, args=(coordinator,), name="sluice-ws-receiver", daemon=True)
        self._thread.start()

    # -- the receiver thread ----------------------------------------------------------------

    @abstractmethod
    def _receive(self) -> None:
        """Bring the next version in, if there is one (called in a loop by the thread)."""

    @abstractmethod
    def _source(self, received: _Received) -> Callable[[Copy], torch.Tensor]:
        """Where each planned copy reads from in a received version."""

    def _loop(self, coordinator: str) -> None:
        self._coordinator = RpcClient(
            coordinator, timeout=self.timeout, credentials=self.ranks.credentials
        )  # sockets stay with one thread
        while not self.closed:
            try:
                self._receive()
            except Exception as exc:  # noqa: BLE001 - whatever failed, the transfer is discarded
                if not isinstance(exc, SluiceError):
                    log.exception("weight transfer failed")
                with self.cond:
                    if self.closed:
                        return
                    self._error = (
                        exc
                        if isinstance(exc, (WeightSyncError, SchemaError))
                        else WeightSyncError(f"weight transfer failed: {exc!r}")
                    )
                    self.cond.notify_all()
                    self.cond.wait(_RETRY_SECONDS)

    def _await_free_buffer(self) -> bool:
        """With one buffer, wait until the version in it was applied; False once closed."""
        with self.cond:
            while (
                len(self.table.slots) == 1
                and self._received is not None
                and self._received.version > self.targets.version
            ):
                if self.closed:
                    return False
                self.cond.wait(1.0)
            return not self.closed

    def _ready(
        self, version: int, plan: Plan, slot: Slot, filled: int, buffer: torch.Tensor, checksums: dict[int, Checksums]
    ) -> None:
        """Mark `version` whole in `slot`; it stays pinned until applied or superseded."""
        self._fetched = version
        self.table.advance(slot, filled, complete=True)
        leased = self.table.lease(version)
        assert leased is not None  # `slot` holds `version`, whole, and only this thread fails slots
        lease, _ = leased
        with self.cond:
            old, self._received = self._received, _Received(version, plan, buffer, lease, checksums)
            self._error = None
            self.cond.notify_all()
        if old is not None:
            self.table.release(old.lease)

    # -- the caller's thread ------------------------------------------------------------------

    def poll(self, timeout: float) -> int | None:
        applied = self._apply_received()
        if applied is None and timeout > 0:
            with self.cond:  # nothing new yet: wait for the thread's next news
                received = self._received
                if (received is None or received.version <= self.targets.version) and self._error is None:
                    self.cond.wait(min(timeout, 1.0))
        return applied

    def _apply_received(self) -> int | None:
        with self.cond:
            received, error = self._received, self._error
            if not isinstance(error, SchemaError):  # it stands until the publisher's tensors change
                self._error = None
        held = self.targets.version
        if error is not None and (received is None or received.version <= held):
            raise error
        if received is None or received.version <= held:
            return None
        got = self.table.lease(received.version)
        if got is None:
            return None
        lease, _ = got
        try:
            self.targets.apply(
                received.version, received.plan, map(self._source(received), received.plan.copies), received.checksums
            )
        except WeightSyncError:
            with self.cond:  # checksums disagree: discard this copy, wait for the next version
                if self._received is received:
                    self._received = None
            raise
        finally:
            self.table.release(lease)
            with self.cond:
                if self._received is None or self.targets.version >= received.version:
                    self.table.release(received.lease)  # applied or discarded: the buffer may be reused
                    self.cond.notify_all()
        return received.version

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.ranks.transport.close()  # unblocks a thread waiting on a socket
        self._thread.join(timeout=self._join_timeout())
        if self._coordinator is not None:
            self._coordinator.close()
        self.table.close()

    def _join_timeout(self) -> float:
        return self.timeout


class ReadsReceiver(BackgroundReceiver):
    """ "reads" transports: pull each rank's planned reads back to back into one buffer.

    A buffer that still holds the version received before it, for the same plan, is the base
    of a delta pull from every rank that offers one against that version (`Granted.base`);
    the delta is applied to the buffer, so `poll` applies a whole version as always. From the
    moment the buffer is claimed until the new version is whole in it, it is no one's base:
    a transfer that fails (a refused or corrupt delta included) is pulled whole next time."""

    mode = "reads"

    def __init__(self, ranks: PublisherRanks, targets: Targets, coordinator: str, settings: ReceiveSettings):
        self._bases: dict[int, tuple[int, Plan, int]] = {}
        """Buffer slot index -> (version, plan, segment generation) it holds whole."""
        super().__init__(ranks, targets, coordinator, settings)

    def _receive(self) -> None:
        if not self._await_free_buffer():
            return
        after = max(self._fetched, self.targets.version)
        coordinator = self._coordinator
        assert coordinator is not None  # made when the thread started (`_loop`)
        try:
            offer: Offer = coordinator.call(Latest(after, not self.settings.pipelined, 1.0), timeout=1.0 + self.timeout)
        except TimeoutError:
            return
        if offer.version <= after:
            return
        version = offer.version
        since = time.monotonic()  # the leases are granted after this
        try:
            grants = self.ranks.lease_all(version)
        except SluiceError:
            if self._superseded(coordinator, version):
                return  # the publisher moved past it before its lease: the next turn takes the newest
            raise
        slot = None
        released = False
        try:
            plan = self.ranks.plan(tuple(g.manifest for g in grants))
            slot = self.table.claim(version, plan.nbytes, self.timeout)
            held = self._bases.pop(slot.index, None)
            base = held[0] if held is not None and held[1] is plan and held[2] == slot.generation else -1
            bases = [self._delta_base(g, base) for g in grants]
            logs = {r: FrameLog(b) for r, b in enumerate(bases) if b >= 0 and self.ranks.relay_endpoint}
            with self.cond:
                self.holding, self.frame_logs = (version, plan), logs
                self.cond.notify_all()
            pulled = [
                self._pull(r, version, g, plan, slot, bases[r]) if plan.reads(r) else ("", 0)
                for r, g in enumerate(grants)
            ]
            if not offer.complete:
                coordinator.call(Confirm(version, self.timeout), timeout=self.timeout * 2)
            checksums = self._checksums(plan, grants)
            released = True  # the ranks read from directly vouch that their slots held, if need be
            direct = {r for r, (source, _) in enumerate(pulled) if plan.reads(r) and not source}
            self.ranks.release(grants, direct, since)
        except BaseException:
            if slot is not None:
                self.table.fail(slot)
            raise
        finally:
            if not released:
                self.ranks.release(grants)
        self.last_sources = [source for source, _ in pulled]
        self.last_received = [received for _, received in pulled]
        self._ready(version, plan, slot, plan.nbytes, slot.mapped.tensor, checksums)
        self._bases[slot.index] = (version, plan, slot.generation)

    def _superseded(self, coordinator: RpcClient, version: int) -> bool:
        """Whether the publisher already offers a version above `version`: a lease refused
        because its slot went to a newer version is no failure of the transfer (a trainer that
        publishes faster than this subscriber pulls makes it happen), so it is not reported."""
        try:
            offer: Offer = coordinator.call(Latest(version, not self.settings.pipelined, 0.0), timeout=self.timeout)
        except SluiceError:
            return False
        return offer.version > version

    def _delta_base(self, grant: Granted, base: int) -> int:
        """The version to pull `grant`'s reads against: `base` when the rank offers a delta
        against it, or a relay serves them (it forwards its frames if it pulled them against
        the same base, else its bytes as WHOLE frames); -1: whole."""
        if base >= 0 and (grant.base == base or grant.source) and self.ranks.transport.deltas:
            return base
        return -1

    def _pull(self, rank: int, version: int, grant: Granted, plan: Plan, slot: Slot, base: int) -> tuple[str, int]:
        """Receive rank `rank`'s reads (a delta against `base` if >= 0); if a relay fails, once
        more straight from the rank and whole, since the relay's stream may have left part of
        the buffer new. Returns where they came from ("" for the rank itself) and the bytes
        the stream carried."""
        transport = self.ranks.transport
        job = self.ranks.job(rank, version, grant, plan, slot, self.table)
        job.base, job.log, job.delta_threads = base, self.frame_logs.get(rank), self.settings.delta_threads
        try:
            transport.receive(job)
            return grant.source, job.received
        except WeightSyncError as exc:
            if not grant.source:
                raise
            log.info("relay %s failed (%s); pulling from rank %d directly", grant.source, exc, rank)
            direct = self.ranks.lease(rank, version, direct=True)
            try:
                job = self.ranks.job(rank, version, direct, plan, slot, self.table)
                transport.receive(job)
            finally:
                self.ranks.release_one(rank, direct)
            return "", job.received

    def _source(self, received: _Received) -> Callable[[Copy], torch.Tensor]:
        buffer = received.buffer
        return lambda c: buffer[c.recv : c.recv + c.read.nbytes].view(c.dtype).view(c.read.box_shape)


class ImageReceiver(BackgroundReceiver):
    """ "image" transports: rank 0's whole slot is broadcast into a buffer of ours; keeps two
    buffers by default, so it can go on receiving while a version waits to be applied.

    The buffer that holds the last version received whole is the base of a delta broadcast
    (`Job.base`, `Job.base_image`): the transport copies it into the buffer it claims (with
    two buffers, the other one) and applies the delta there, so the base stays intact until
    the new version is whole. Once a buffer is claimed for a newer version it is no one's base."""

    mode = "image"
    buffers = 2

    def __init__(self, ranks: PublisherRanks, targets: Targets, coordinator: str, settings: ReceiveSettings):
        self._base: tuple[int, Slot, int] | None = None
        """(version, buffer slot, its segment generation) of the last version received whole."""
        super().__init__(ranks, targets, coordinator, settings)

    def _receive(self) -> None:
        if not self._await_free_buffer():
            return
        slot = None

        def into(nbytes: int) -> torch.Tensor:
            nonlocal slot
            slot = self.table.claim(job.version, nbytes, self.timeout)
            return slot.mapped.tensor

        job = Job(
            0,
            max(self._fetched, self.targets.version) + 1,
            0,
            self.ranks.info[0].data[self.ranks.transport.name],
            None,
            [],
            [],
            0,
            into,
            lambda n: None,
            self.timeout,
        )
        held = self._base
        if held is not None and held[1].version == held[0] and held[1].generation == held[2] and not held[1].failed:
            job.base, job.base_image = held[0], held[1].mapped.tensor
        try:
            image = self.ranks.transport.receive(job)
            self.last_received = [job.received]
            plan = self.ranks.plan((job.manifest,))
            assert self._coordinator is not None  # made when the thread started (`_loop`)
            self._coordinator.call(Confirm(job.version, self.timeout), timeout=self.timeout * 2)
            checksums = {}
            if self.settings.validate:
                grants = self.ranks.lease_all(job.version)
                try:
                    checksums = self.ranks.verify(plan, grants)
                finally:
                    self.ranks.release(grants)
        except BaseException:
            if slot is not None:
                self.table.fail(slot)
            raise
        assert slot is not None  # the transport received into the buffer `into` claimed
        self._ready(job.version, plan, slot, slot.size, image, checksums)
        self._base = (job.version, slot, slot.generation)

    def _source(self, received: _Received) -> Callable[[Copy], torch.Tensor]:
        image = received.buffer
        return lambda c: c.read.view(image, c.dtype)

    def _join_timeout(self) -> float:
        return 1.0  # a broadcast cannot be interrupted; the thread is a daemon


class RelaySource(Source):
    """Serves `RelayPull`s from a subscriber's receive buffer, as its bytes arrive: whole, or
    with a base, as the delta frames this subscriber received against that base (`FrameLog`),
    else its bytes as WHOLE frames."""

    def __init__(self, receiver: BackgroundReceiver):
        self.receiver = receiver

    def open(self, request: Pull | RelayPull):  # noqa: ANN201
        rx = self.receiver
        if not isinstance(request, RelayPull) or request.plan != rx.ranks.signature:
            raise WeightSyncError("this relay serves only subscribers with the same plan")
        with rx.cond:  # the downstream may ask before this relay has started on the version
            rx.cond.wait_for(
                lambda: rx.closed or (rx.holding is not None and rx.holding[0] >= request.version), rx.timeout
            )
            holding, frame_log = rx.holding, rx.frame_logs.get(request.rank)
        if holding is None or holding[0] != request.version:
            raise WeightSyncError(f"this relay does not hold version {request.version}")
        got = rx.table.lease(request.version)
        if got is None:
            raise WeightSyncError(f"this relay moved past version {request.version}")
        lease, slot = got
        copies = [c for c in holding[1].copies if c.rank == request.rank]
        version, base, timeout = request.version, request.base, rx.timeout

        def views():  # noqa: ANN202
            buffer = slot.mapped.tensor
            for c in copies:
                slot.wait_filled(c.recv + c.read.nbytes, version, timeout)
                position = c.recv
                for lo, hi in read_chunks(c.read):
                    n = c.read.itemsize * numel(lo, hi)
                    if base >= 0:
                        yield memoryview(Frame(WHOLE, n, 0, 0, base, 0, 0).pack())
                    yield as_bytes(buffer[position : position + n])
                    position += n

        def forwarded(frames: list[tuple[Frame, torch.Tensor | None]]):  # noqa: ANN202
            buffer, taken = slot.mapped.tensor, 0
            for c in copies:
                covered = 0
                while covered < c.read.nbytes:
                    slot.wait_filled(c.recv + covered + 1, version, timeout)  # frames are logged first
                    if taken == len(frames):
                        raise WeightSyncError(f"this relay's delta stream of version {version} broke off")
                    frame, payload = frames[taken]
                    taken += 1
                    yield memoryview(frame.pack())
                    start = c.recv + covered
                    yield as_bytes(buffer[start : start + frame.span] if payload is None else payload)
                    covered += frame.span

        if base >= 0 and frame_log is not None and frame_log.base == base:
            return forwarded(frame_log.frames), lambda ok: rx.table.release(lease)
        return views(), lambda ok: rx.table.release(lease)
