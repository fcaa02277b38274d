"""A subscriber's calls to the publisher ranks, whatever the transport.

One control client per rank; each rank's manifests fetched once and each set of manifests
planned once; leases on one version across every rank (none left held if one fails);
checksums for validation; and the `Job` a transport is handed for one rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.cuda import copies, is_cuda
from transfer_queue.wire.rpc import Credentials, Message, Ping, check

from .manifest import Manifest
from .mapping import NameMapping, TPShard
from .plan import Plan, build_plan
from .protocol import (
    Checksums,
    Describe,
    Granted,
    Lease,
    LocalClient,
    Ok,
    RankInfo,
    Release,
    RpcClient,
    SlotList,
    Slots,
    Verify,
)
from .staging import Slot, SlotTable
from .transports import Job, MapTransport, Transport

__all__ = ["PublisherRanks", "close_after_posts"]


_SURE = 0.99
"""The share of a rank's `lease_timeout` within which a reader needs no word from it that its
lease held (the two processes' clocks may tick at rates a few parts per million apart)."""

_FLUSH_SECONDS = 2.0
"""How long `close_after_posts` waits for a rank to take the releases posted to it."""


def close_after_posts(client: RpcClient | LocalClient, posted: bool) -> None:
    """Close a control client; one that was `posted` releases is pinged first (a rank serves a
    connection's requests in order): a socket closed at once would drop an unsent release, and
    the slot would stay pinned until its lease expired or the rank saw the connection close."""
    if posted:
        with contextlib.suppress(SluiceError):
            client.call(Ping(), timeout=_FLUSH_SECONDS)
    client.close()


class PublisherRanks:
    """The publisher ranks of one channel as one subscriber talks to them, from one thread at a
    time (the caller's for "map" transports, the receiver thread's for the others)."""

    def __init__(
        self,
        ranks: list[RankInfo],
        transport: Transport,
        targets: Mapping[str, torch.Tensor],
        shard: TPShard,
        mapping: NameMapping,
        signature: int,
        timeout: float,
        credentials: Credentials | None = None,
    ):
        self.info = ranks
        self.credentials = credentials
        """The cluster's keys for the ranks' control servers (None: `SLUICE_CREDENTIALS`)."""
        self.transport = transport
        self.signature = signature
        """Identifies what this subscriber needs: equal signatures mean equal plans (relays)."""
        self.relay_endpoint = ""
        """Where this subscriber re-serves what it received (set once it relays)."""
        self.timeout = timeout
        self._targets = targets
        self._shard = shard
        self._mapping = mapping
        self._clients: dict[int, RpcClient] = {}
        self._posted: set[int] = set()
        """Ranks posted a `Release` since: `close` makes sure it arrived before the socket goes."""
        self._manifests: dict[int, Manifest] = {}
        self._plans: dict[tuple[int, ...], Plan] = {}

    def call(self, rank: int, msg: Message, timeout: float | None = None) -> Any:
        """Send `msg` to rank `rank`'s control server and return its reply (of the type `msg` asks for).

        Raises:
            WeightSyncError: the rank is gone or did not answer in time.
            SluiceError: the rank refused (the error it named).
        """
        return self._client(rank).call(msg, timeout=timeout)

    def _client(self, rank: int) -> RpcClient:
        client = self._clients.get(rank)
        if client is None:
            client = self._clients[rank] = RpcClient(
                self.info[rank].control, timeout=self.timeout, credentials=self.credentials
            )
        return client

    def plan(self, ids: tuple[int, ...]) -> Plan:
        """The plan for the ranks' manifests `ids` (fetched once per id, planned once per set)."""
        plan = self._plans.get(ids)
        if plan is None:
            for rank, mid in enumerate(ids):
                if mid not in self._manifests:
                    self._manifests[mid] = self.call(rank, Describe(mid)).manifest
            manifests = [self._manifests[mid] for mid in ids]
            layouts = {e.name: e.layout for m in manifests for e in m.entries}
            bindings = self._mapping.bind(layouts, self._targets, self._shard)
            plan = self._plans[ids] = build_plan(manifests, bindings, first=self._shard.rank)
        return plan

    def open_slots(self) -> str:
        """For "map" transports: open every rank's staging slots made so far, plan the reads of
        the manifest they were made for and start the copy stream, so the first version
        applies as fast as the next (a rank that does not answer is left for the first lease
        to report). Returns "" once that is done; if a rank says it stopped serving the
        transport, returns its reason instead and opens no slot."""
        if not isinstance(self.transport, MapTransport):
            return ""
        replies: list[SlotList] = []
        for rank in range(len(self.info)):
            try:
                reply = self.call(rank, Slots(self.transport.name))
            except SluiceError:
                return ""
            if reply.stopped:
                return reply.stopped
            replies.append(reply)
        manifests = []
        for rank, reply in enumerate(replies):
            for slot in reply.slots:
                self.transport.open_ahead(rank, slot)
            manifests.append(reply.manifest)
        if all(manifests):
            with contextlib.suppress(SluiceError):
                self.plan(tuple(manifests))
        with copies(next((t.device for t in self._targets.values() if is_cuda(t)), None)):
            pass  # the copy stream exists before the first version needs it
        return ""

    def lease(self, rank: int, version: int, *, direct: bool = False) -> Granted:
        """Pin `version`'s slot on rank `rank`, offering this subscriber as a relay; `direct`
        asks for the rank itself, not a relay (and offers nothing: its relay just failed)."""
        return self.call(rank, self._lease(version, direct), timeout=self.timeout + 5)

    def _lease(self, version: int, direct: bool = False) -> Lease:
        relay = "" if direct else self.relay_endpoint
        return Lease(version, self.transport.name, self.signature, relay, direct=direct, timeout=self.timeout)

    def lease_all(self, version: int, first: Granted | None = None) -> list[Granted]:
        """Leases on `version` from every rank (rank 0's is `first` when its offer carried
        it), asked of all ranks at once and then awaited: one round trip, not one per rank.
        None are left held if one fails.

        Raises:
            WeightSyncError: a rank is gone or did not answer in time.
            SluiceError: a rank refused (the error it named).
        """
        grants: dict[int, Granted] = {} if first is None else {0: first}
        asked: dict[int, tuple[RpcClient | LocalClient, int]] = {}
        error: SluiceError | None = None
        for rank in range(len(grants), len(self.info)):
            try:
                asked[rank] = self._client(rank), self._client(rank).send(self._lease(version))
            except SluiceError as exc:
                error = exc
                break
        # every answer is awaited, so no grant is left behind (a late one is dropped: the rank's lease timer frees it)
        answers, error = self._answers(asked, Granted, "Lease", error)
        grants.update(answers)
        if error is not None:
            for rank, grant in grants.items():
                self.release_one(rank, grant)
            raise error
        return [grants[rank] for rank in range(len(self.info))]

    def release(
        self,
        grants: list[Granted],
        read: Collection[int] = (),
        since: float = 0.0,
        first: RpcClient | LocalClient | None = None,
    ) -> None:
        """Release `grants` (one per rank, in rank order; rank 0's over `first` when given: the
        connection that holds it). `read`: the ranks whose slots this subscriber read, having
        asked for their leases at `since` (`time.monotonic()`). A lease runs out no sooner than
        the rank's `lease_timeout` after that, and until it does nothing stages the slot again;
        so a rank of `read` is asked to vouch for its reads only once that time may have passed
        (or the rank did not tell it): those are asked at once and then awaited, one round trip
        in all, each answering whether its lease still pinned its slot, so that reads which
        outlasted their lease (the slot staged again under them) are not taken for a whole
        version. The other releases are posted.

        Raises:
            WeightSyncError: a rank's slot was staged again under its lease, or a rank asked to
                vouch is gone or did not answer in time (its reads cannot be vouched for).
        """
        took = time.monotonic() - since
        checked = {r for r in read if took >= _SURE * self.info[r].lease_timeout}
        asked: dict[int, tuple[RpcClient | LocalClient, int]] = {}
        error: SluiceError | None = None
        for rank, grant in enumerate(grants):
            via = first if rank == 0 else None
            if rank not in checked:
                self.release_one(rank, grant, via)
                continue
            client = via or self._client(rank)
            try:
                asked[rank] = client, client.send(Release(grant.lease))
            except SluiceError as exc:
                error = error or exc
        _, error = self._answers(asked, Ok, "Release", error)
        if error is not None:
            raise WeightSyncError(f"a rank did not vouch for version {grants[0].version}'s reads: {error}") from error

    def _answers(
        self,
        asked: dict[int, tuple[RpcClient | LocalClient, int]],
        expected: type,
        what: str,
        error: SluiceError | None,
    ) -> tuple[dict[int, Any], SluiceError | None]:
        """Await every answer to requests sent to several ranks at once (rank -> (client,
        request id)): the `expected` replies by rank, and `error` or else the first failure
        (a refusal, a rank gone or silent; its request is forgotten, a late answer dropped)."""
        answers: dict[int, Any] = {}
        for rank, (client, rid) in asked.items():
            try:
                answers[rank] = check(client.reply(rid, self.timeout + 5, what=what)[0], expected)
            except SluiceError as exc:
                client.forget(rid)
                error = error or exc
        return answers, error

    def release_one(self, rank: int, grant: Granted, via: RpcClient | LocalClient | None = None) -> None:
        """Release one rank's lease without waiting for its answer: the reads are done, and
        each lease has its own id, so nothing later depends on this one (its `Ok` is dropped
        on arrival). `via`: the connection to post it over (its owner flushes it before it
        closes), instead of this subscriber's own to the rank."""
        try:
            if via is not None:
                via.post(Release(grant.lease))
                return
            self._client(rank).post(Release(grant.lease))
            self._posted.add(rank)
        except SluiceError:
            pass  # the rank is gone; so is its lease

    def verify(self, plan: Plan, grants: list[Granted]) -> dict[int, Checksums]:
        """The ranks' checksums of what `plan` reads from each (validation mode)."""
        return {
            r: self.call(r, Verify(g.lease, plan.reads(r)), timeout=self.timeout * 4)
            for r, g in enumerate(grants)
            if plan.reads(r)
        }

    def job(
        self,
        rank: int,
        version: int,
        grant: Granted,
        plan: Plan,
        slot: Slot | None = None,
        table: SlotTable | None = None,
    ) -> Job:
        """What the transport needs to bring in rank `rank`'s reads of `plan`, into `slot` of
        `table` (receive buffers) or, with no slot, straight from the rank's memory ("map")."""
        start = plan.regions[rank][0]
        copies = [c for c in plan.copies if c.rank == rank]

        def into(nbytes: int) -> torch.Tensor:
            assert slot is not None  # without a slot the transport maps the rank's memory and asks for no buffer
            return slot.mapped.tensor[start : start + nbytes]

        def progress(nbytes: int) -> None:
            assert slot is not None and table is not None  # given with a slot only (below), its table with it
            table.advance(slot, start + nbytes)

        return Job(
            rank=rank,
            version=version,
            manifest=grant.manifest,
            endpoint=self.info[rank].data[self.transport.name],
            grant=grant,
            reads=[c.read for c in copies],
            offsets=[c.recv - start for c in copies],
            digest=self.signature,
            into=into,
            progress=progress if slot is not None else (lambda n: None),
            timeout=self.timeout,
        )

    def close(self) -> None:
        """Close the channels, each after the releases posted to it (`close_after_posts`)."""
        for rank, client in self._clients.items():
            close_after_posts(client, rank in self._posted)
        self._posted.clear()
        self._clients.clear()
