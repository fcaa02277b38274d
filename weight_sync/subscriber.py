"""`WeightSubscriber`: the rollout worker's side of the weight channel.

It updates the worker's own tensors in place (same storage, no reallocation), only ever with a
whole version: `poll()` and `wait()` apply in the caller's thread, at a point the caller
chose, so the model never holds a mix of versions.

How bytes arrive depends on the transport's mode (see `transports.base`):

- map (shm): nothing moves ahead of time. `poll()` leases the newest complete version on
  every publisher rank, copies the planned reads straight out of the mapped slots into the
  tensors, and releases the leases.
- reads / image (tcp, ucx / torch): a receiver thread pulls (or is broadcast) each new version
  into the subscriber's own pre-faulted buffer while the worker keeps generating; `poll()`
  applies a version once all of it is in. With tcp the subscriber also relays what it
  received to subscribers the publisher points at it.

A transfer that fails is discarded with `WeightSyncError` (raised by the next `poll`/`wait`);
the tensors keep the version they had.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import msgspec
import torch
import xxhash

import transfer_queue as tq
from transfer_queue._errors import SluiceError, TimeoutError, WeightSyncError

from .checksum import compare
from .layout import numel
from .manifest import Manifest
from .mapping import NameMapping, TPShard
from .plan import Copy, Plan, build_plan
from .protocol import (
    Checksums,
    Confirm,
    Describe,
    Granted,
    Latest,
    Lease,
    Offer,
    Pull,
    RankInfo,
    RelayPull,
    Release,
    RpcClient,
    Verify,
)
from transfer_queue._host import host_id

from .publisher import directory_key
from .staging import SlotTable
from .transports import AUTO_ORDER, Job, Source, Transport, resolve
from .transports.base import read_chunks

__all__ = ["WeightSubscriber"]

log = logging.getLogger("sluice.weight_sync")

_RETRY_SECONDS = 0.2
"""Pause after a failed background transfer before trying the newest version again."""


@dataclass
class _Received:
    """A version whole in the receive buffer, waiting to be applied."""

    version: int
    plan: Plan
    sources: dict[int, torch.Tensor]
    """Rank -> what its copies read from ("image": the slot image; "reads": the buffer)."""
    lease: int
    """The subscriber's own lease that keeps the buffer from being reused before apply."""
    checksums: dict[int, Checksums]


class WeightSubscriber:
    """Keeps `model_or_tensors` at the newest weights published on channel `name`.

    Args:
        address: the controller's address, or None to use `publisher` directly.
        model_or_tensors: an `nn.Module` (its state dict) or a dict of tensors, updated in place.
        transport: "auto" (shm when co-located, else ucx when installed, else tcp), a name, a
            `Transport` instance, or a list; the first one every publisher rank can serve wins.
        name: the channel.
        publisher: rank 0's `WeightPublisher.endpoint`, when there is no controller.
        shard: the tensor-parallel slice this worker holds (default: everything).
        mapping: how trainer names map to these tensors (default: same names, wrappers
            stripped; `mapping.LLAMA` fuses q/k/v and gate/up like vLLM).
        validate: after each apply, compare xxh3-64 checksums of every applied slice with the
            publisher's snapshot; `WeightSyncError` names the tensors that differ.
        relay: re-serve received bytes to other subscribers (tcp), so the trainer's link is
            not the bottleneck.
        pipelined: pull a version while it is still being staged (bucket k on the wire while
            k+1 is packed). Shortest end-to-end time; False waits for complete versions, which
            keeps the trainer's cores to itself while it packs.
        buffers: receive buffers for background transports (default 1, or 2 for torch, which
            must keep receiving while a version waits to be applied).
        timeout: seconds to wait on the publisher for any one step of a transfer.
    """

    def __init__(
        self,
        address: str | None,
        model_or_tensors: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        transport: str | Transport | list = "auto",
        name: str = "policy",
        publisher: str | None = None,
        shard: TPShard | None = None,
        mapping: NameMapping | None = None,
        validate: bool = False,
        relay: bool = True,
        pipelined: bool = True,
        buffers: int | None = None,
        timeout: float = 30.0,
        host: str = "127.0.0.1",
    ):
        if address is None and publisher is None:
            raise ValueError("give the controller's address or the publisher's endpoint")
        self.name = name
        self.targets = _tensors(model_or_tensors)
        self.shard = shard or TPShard()
        self.mapping = mapping or NameMapping()
        self.validate = validate
        self.timeout = timeout
        self.version = -1
        """The version the tensors hold (-1: none applied yet)."""
        self.last_apply_seconds = 0.0
        """How long the last apply (the copy into the tensors) took."""
        self.last_sources: list[str] = []
        """Per publisher rank, where the last received version came from: "" for the rank
        itself, else the endpoint of the subscriber that relayed it."""
        self._relay = relay
        self._pipelined = pipelined
        self._host = host
        self._buffers = buffers
        self._offered = [t for t in resolve(transport)]
        self._client = tq.ControlClient(address) if address is not None else None
        self._publisher = publisher
        self._coordinator: RpcClient | None = None  # used by the thread that applies (map) or receives
        self._ranks: list[RankInfo] = []
        self._rank_clients: dict[int, RpcClient] = {}
        self._transport: Transport | None = None
        self._manifests: dict[int, Manifest] = {}
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._signature = _signature(self.targets, self.shard, self.mapping)
        self._cond = threading.Condition()
        self._received: _Received | None = None
        self._error: WeightSyncError | None = None
        self._closed = False
        self._recv: SlotTable | None = None
        self._receiver: threading.Thread | None = None
        self._relay_endpoint = ""
        self._fetched = -1
        """The newest version the receiver brought in (applied or not)."""
        self._holding: tuple[int, Plan] | None = None
        """(version, plan) of what the receive buffer holds or is filling (relays serve it)."""

    # -- public ---------------------------------------------------------------------------

    def poll(self) -> int | None:
        """Apply the newest complete version if it is newer than `version`.

        Returns the version applied, or None. Raises `WeightSyncError` if a transfer failed
        since the last call (the tensors keep their version) or checksums disagree.
        """
        self._check_open()
        if self._transport is None and not self._start(timeout=0.0):
            return None
        if self._transport.mode == "map":
            return self._poll_mapped(timeout=0.0)
        return self._apply_received()

    def wait(self, version: int, timeout: float = 30.0) -> int:
        """Block until a version >= `version` is applied; returns the version applied.

        Raises `tq.TimeoutError` after `timeout` seconds and `WeightSyncError` if the
        transfer failed.
        """
        self._check_open()
        deadline = time.monotonic() + timeout
        while self.version < version:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"version {version} was not applied within {timeout} s (holding {self.version})")
            if self._transport is None and not self._start(timeout=left):
                continue
            if self._transport.mode == "map":
                self._poll_mapped(timeout=left)
                continue
            self._apply_received()
            with self._cond:
                if self.version < version and (self._received is None or self._received.version <= self.version) and self._error is None:
                    self._cond.wait(min(left, 1.0))
        return self.version

    def close(self) -> None:
        """Stop receiving and relaying; the tensors keep the version they hold."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for transport in self._offered:
            transport.close()  # unblocks a receiver waiting on a socket
        if self._receiver is not None:
            self._receiver.join(timeout=1.0 if self._transport.mode == "image" else self.timeout)
        for client in [self._coordinator, *self._rank_clients.values()]:
            if client is not None:
                client.close()
        if self._recv is not None:
            self._recv.close()
        if self._client is not None:
            self._client.close()

    def __enter__(self) -> WeightSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- discovery ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise tq.ClosedError("this subscriber was closed")

    def _start(self, timeout: float) -> bool:
        """Find the publishers and pick a transport; False if none is there yet."""
        endpoint = self._publisher
        if endpoint is None:
            raw = self._client.lookup(directory_key(self.name), timeout=timeout)
            if raw is None:
                return False
            endpoint = msgspec.msgpack.decode(raw, type=RankInfo).control
        coordinator = RpcClient(endpoint, timeout=self.timeout)
        try:
            offer = coordinator.call(Latest(after=-1, complete=True, timeout=0.0))
        except WeightSyncError:
            coordinator.close()
            if timeout > 0:
                time.sleep(min(timeout, _RETRY_SECONDS))
            return False
        if not offer.ranks:
            coordinator.close()
            if timeout > 0:
                time.sleep(min(timeout, _RETRY_SECONDS))  # some trainer ranks have not joined yet
            return False
        self._ranks = offer.ranks
        self._transport = self._choose(offer.ranks)
        if self._transport.mode == "map":
            self._coordinator = coordinator
            return True
        coordinator.close()  # the receiver thread opens its own: sockets stay with one thread
        self._recv = SlotTable(self._buffers or (2 if self._transport.mode == "image" else 1), shared=False, lease_timeout=1e9)
        if self._relay and self._transport.fanout is not None:
            self._relay_endpoint = self._transport.serve(_RelaySource(self))
        self._receiver = threading.Thread(target=self._receive_loop, args=(endpoint,), name="sluice-ws-receiver", daemon=True)
        self._receiver.start()
        return True

    def _choose(self, ranks: list[RankInfo]) -> Transport:
        """The first offered transport that every rank serves (shm only on this host)."""
        here = host_id()
        order = sorted(self._offered, key=lambda t: AUTO_ORDER.index(t.name) if t.name in AUTO_ORDER else len(AUTO_ORDER))
        for transport in order:
            if all(transport.name in r.data and (transport.mode != "map" or r.host == here) for r in ranks):
                for other in self._offered:
                    if other is not transport:
                        other.close()
                self._offered = [transport]
                return transport
        raise WeightSyncError(f"no common transport: this side has {[t.name for t in self._offered]}, the publishers serve {sorted(ranks[0].data)}")

    def _rank(self, rank: int) -> RpcClient:
        client = self._rank_clients.get(rank)
        if client is None:
            client = self._rank_clients[rank] = RpcClient(self._ranks[rank].control, timeout=self.timeout)
        return client

    def _plan(self, ids: tuple[int, ...]) -> Plan:
        """The plan for the ranks' manifests `ids` (fetched once per id, planned once per set)."""
        plan = self._plans.get(ids)
        if plan is None:
            for rank, mid in enumerate(ids):
                if mid not in self._manifests:
                    self._manifests[mid] = self._rank(rank).call(Describe(mid)).manifest
            manifests = [self._manifests[mid] for mid in ids]
            shapes = {e.name: e.layout.shape for m in manifests for e in m.entries}
            bindings = self.mapping.bind(shapes, self.targets, self.shard)
            plan = self._plans[ids] = build_plan(manifests, bindings, first=self.shard.rank)
        return plan

    def _lease_all(self, version: int) -> list[Granted]:
        """Leases on `version` from every rank; none are left held if one fails."""
        grants: list[Granted] = []
        try:
            for rank in range(len(self._ranks)):
                lease = Lease(version, self._transport.name, self._signature, self._relay_endpoint, timeout=self.timeout)
                grants.append(self._rank(rank).call(lease, timeout=self.timeout + 5))
        except SluiceError:
            self._release(grants)
            raise
        return grants

    def _release(self, grants: list[Granted]) -> None:
        for rank, grant in enumerate(grants):
            try:
                self._rank(rank).call(Release(grant.lease))
            except SluiceError:
                pass  # the rank is gone; so is its lease

    def _verify(self, plan: Plan, grants: list[Granted]) -> dict[int, Checksums]:
        return {r: self._rank(r).call(Verify(g.lease, plan.reads(r)), timeout=self.timeout * 4) for r, g in enumerate(grants) if plan.reads(r)}

    # -- map mode (shm): apply straight from the publishers' slots ------------------------

    def _poll_mapped(self, timeout: float) -> int | None:
        offer: Offer = self._coordinator.call(Latest(self.version, True, timeout), timeout=timeout + self.timeout)
        if offer.version <= self.version:
            return None
        grants = self._lease_all(offer.version)
        try:
            plan = self._plan(tuple(g.manifest for g in grants))
            sources = {}
            for rank, grant in enumerate(grants):
                job = self._job(rank, offer.version, grant, plan, None)
                sources[rank] = self._transport.receive(job)
            checksums = self._verify(plan, grants) if self.validate else {}
            self._apply(offer.version, plan, lambda c: c.read.view(sources[c.rank], c.dtype), checksums)
        finally:
            self._release(grants)
        return offer.version

    def _job(self, rank: int, version: int, grant: Granted | None, plan: Plan, slot) -> Job:  # noqa: ANN001
        start = plan.regions[rank][0]
        copies = [c for c in plan.copies if c.rank == rank]
        buffer = self._recv

        def into(nbytes: int) -> torch.Tensor:
            return slot.segment.tensor[start : start + nbytes]

        def progress(nbytes: int) -> None:
            buffer.advance(slot, start + nbytes)

        return Job(
            rank=rank,
            version=version,
            manifest=grant.manifest if grant is not None else 0,
            endpoint=self._ranks[rank].data[self._transport.name],
            grant=grant,
            reads=[c.read for c in copies],
            offsets=[c.recv - start for c in copies],
            digest=self._signature,
            into=into,
            progress=progress if slot is not None else (lambda n: None),
            timeout=self.timeout,
        )

    # -- background modes: receive, then apply on poll ----------------------------------

    def _receive_loop(self, endpoint: str) -> None:
        self._coordinator = RpcClient(endpoint, timeout=self.timeout)
        while not self._closed:
            try:
                if self._transport.mode == "image":
                    self._receive_image()
                else:
                    self._receive_reads()
            except Exception as exc:  # noqa: BLE001 - whatever failed, the transfer is discarded
                if not isinstance(exc, SluiceError):
                    log.exception("weight transfer failed")
                with self._cond:
                    if self._closed:
                        return
                    self._error = exc if isinstance(exc, WeightSyncError) else WeightSyncError(f"weight transfer failed: {exc!r}")
                    self._cond.notify_all()
                    self._cond.wait(_RETRY_SECONDS)

    def _await_free_buffer(self) -> bool:
        """With one buffer, wait until the version in it was applied; False once closed."""
        with self._cond:
            while len(self._recv.slots) == 1 and self._received is not None and self._received.version > self.version:
                if self._closed:
                    return False
                self._cond.wait(1.0)
            return not self._closed

    def _receive_reads(self) -> None:
        if not self._await_free_buffer():
            return
        after = max(self._fetched, self.version)
        try:
            offer: Offer = self._coordinator.call(Latest(after, not self._pipelined, 1.0), timeout=1.0 + self.timeout)
        except TimeoutError:
            return
        if offer.version <= after:
            return
        version = offer.version
        grants = self._lease_all(version)
        slot = None
        try:
            plan = self._plan(tuple(g.manifest for g in grants))
            slot = self._recv.claim(version, plan.nbytes, self.timeout)
            with self._cond:
                self._holding = (version, plan)
                self._cond.notify_all()
            buffer = slot.segment.tensor
            sources = [self._pull(r, version, g, plan, slot) if plan.reads(r) else "" for r, g in enumerate(grants)]
            if not offer.complete:
                self._coordinator.call(Confirm(version, self.timeout), timeout=self.timeout * 2)
            checksums = self._verify(plan, grants) if self.validate else {}
        except BaseException:
            if slot is not None:
                self._recv.fail(slot)
            raise
        finally:
            self._release(grants)
        self.last_sources = sources
        self._ready(version, plan, slot, {r: buffer for r in range(len(grants))}, checksums)

    def _pull(self, rank: int, version: int, grant: Granted, plan: Plan, slot) -> str:  # noqa: ANN001
        """Receive rank `rank`'s reads; if a relay fails, once more straight from the rank.
        Returns where they came from ("" for the rank itself)."""
        try:
            self._transport.receive(self._job(rank, version, grant, plan, slot))
            return grant.source
        except WeightSyncError as exc:
            if not grant.source:
                raise
            log.info("relay %s failed (%s); pulling from rank %d directly", grant.source, exc, rank)
            direct = self._rank(rank).call(Lease(version, self._transport.name, self._signature, direct=True, timeout=self.timeout))
            try:
                self._transport.receive(self._job(rank, version, direct, plan, slot))
            finally:
                self._release_one(rank, direct)
            return ""

    def _release_one(self, rank: int, grant: Granted) -> None:
        try:
            self._rank(rank).call(Release(grant.lease))
        except SluiceError:
            pass

    def _receive_image(self) -> None:
        if not self._await_free_buffer():
            return
        slot = None

        def into(nbytes: int) -> torch.Tensor:
            nonlocal slot
            slot = self._recv.claim(job.version, nbytes, self.timeout)
            return slot.segment.tensor

        job = Job(0, max(self._fetched, self.version) + 1, 0, self._ranks[0].data[self._transport.name], None, [], [], 0, into, lambda n: None, self.timeout)
        try:
            image = self._transport.receive(job)
            plan = self._plan((job.manifest,))
            self._coordinator.call(Confirm(job.version, self.timeout), timeout=self.timeout * 2)
            checksums = {}
            if self.validate:
                grants = self._lease_all(job.version)
                try:
                    checksums = self._verify(plan, grants)
                finally:
                    self._release(grants)
        except BaseException:
            if slot is not None:
                self._recv.fail(slot)
            raise
        self._ready(job.version, plan, slot, {0: image}, checksums)

    def _ready(self, version: int, plan: Plan, slot, sources, checksums) -> None:  # noqa: ANN001
        """Mark `version` whole in `slot`; it stays pinned until applied or superseded."""
        self._fetched = version
        self._recv.advance(slot, plan.nbytes if self._transport.mode == "reads" else slot.size, complete=True)
        lease, _ = self._recv.lease(version)
        with self._cond:
            old, self._received = self._received, _Received(version, plan, sources, lease, checksums)
            self._error = None
            self._cond.notify_all()
        if old is not None:
            self._recv.release(old.lease)

    def _apply_received(self) -> int | None:
        with self._cond:
            received, error = self._received, self._error
            self._error = None
        if error is not None and (received is None or received.version <= self.version):
            raise error
        if received is None or received.version <= self.version:
            return None
        got = self._recv.lease(received.version)
        if got is None:
            return None
        lease, _ = got
        try:
            if self._transport.mode == "image":
                source = lambda c: c.read.view(received.sources[c.rank], c.dtype)  # noqa: E731
            else:
                buffer = received.sources[0]
                source = lambda c: buffer[c.recv : c.recv + c.read.nbytes].view(c.dtype).view(c.read.box_shape)  # noqa: E731
            self._apply(received.version, received.plan, source, received.checksums)
        except WeightSyncError:
            with self._cond:  # checksums disagree: discard this copy, wait for the next version
                if self._received is received:
                    self._received = None
            raise
        finally:
            self._recv.release(lease)
            with self._cond:
                if self._received is None or self.version >= received.version:
                    self._recv.release(received.lease)  # applied or discarded: the buffer may be reused
                    self._cond.notify_all()
        return received.version

    # -- apply ------------------------------------------------------------------------------

    def _apply(self, version: int, plan: Plan, source: Callable[[Copy], torch.Tensor], checksums: dict[int, Checksums]) -> None:
        """Copy every planned read into the tensors, then check checksums if validating.

        A source tensor the publisher found changed since staging stops the apply before any
        copy; a slice that differs after the copy is reported by name. Either way the version
        is not marked applied (a background receiver drops it and waits for the next one)."""
        corrupt = sorted({name for c in checksums.values() for name in c.corrupt})
        if corrupt:
            raise WeightSyncError(f"version {version} changed in the publisher's staging after its checksums were taken: {', '.join(corrupt)}")
        start = time.perf_counter()
        with torch.no_grad():
            for copy in plan.copies:
                copy.dst.copy_(source(copy))
        self.last_apply_seconds = time.perf_counter() - start
        if checksums:
            compare(plan, checksums)
        self.version = version


class _RelaySource(Source):
    """Serves `RelayPull`s from this subscriber's receive buffer, as its bytes arrive."""

    def __init__(self, subscriber: WeightSubscriber):
        self.sub = subscriber

    def open(self, request: Pull | RelayPull):  # noqa: ANN201
        sub = self.sub
        if not isinstance(request, RelayPull) or request.plan != sub._signature:
            raise WeightSyncError("this relay serves only subscribers with the same plan")
        with sub._cond:  # the downstream may ask before this relay has started on the version
            sub._cond.wait_for(lambda: sub._closed or (sub._holding is not None and sub._holding[0] >= request.version), sub.timeout)
            holding = sub._holding
        if holding is None or holding[0] != request.version:
            raise WeightSyncError(f"this relay does not hold version {request.version}")
        got = sub._recv.lease(request.version)
        if got is None:
            raise WeightSyncError(f"this relay moved past version {request.version}")
        lease, slot = got
        copies = [c for c in holding[1].copies if c.rank == request.rank]

        def views():  # noqa: ANN202
            buffer = slot.segment.tensor
            for c in copies:
                slot.wait_filled(c.recv + c.read.nbytes, request.version, sub.timeout)
                position = c.recv
                for lo, hi in read_chunks(c.read):
                    n = c.read.itemsize * numel(lo, hi)
                    yield memoryview(buffer[position : position + n].numpy()).cast("B")
                    position += n

        return views(), lambda ok: sub._recv.release(lease)


def _tensors(model_or_tensors: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(model_or_tensors, torch.nn.Module):
        return dict(model_or_tensors.state_dict())
    return dict(model_or_tensors)


def _signature(targets: Mapping[str, torch.Tensor], shard: TPShard, mapping: NameMapping) -> int:
    """Identifies what this subscriber needs: equal signatures mean equal plans (relays)."""
    needs = [[n, list(t.shape), str(t.dtype)] for n, t in targets.items()]
    return xxhash.xxh3_64_intdigest(
        msgspec.msgpack.encode([needs, shard.rank, shard.size, sorted(shard.dims.items()), sorted(mapping.fuse.items()), mapping.rename.__qualname__])
    )
