"""`WeightSubscriber`: the rollout worker's side of the weight channel.

It updates the worker's own tensors in place (same storage, no reallocation), only ever with a
whole version: `poll()` and `wait()` apply in the caller's thread, at a point the caller
chose, so the model never holds a mix of versions.

The subscriber finds the publisher ranks (through the controller, or a given endpoint), picks
the first transport every rank serves, and from then on leaves the work to two parts: the
per-rank calls (`ranks.PublisherRanks`) and the receiver strategy for the transport's mode
(`receivers`: copy straight from mapped slots at apply time; `background`: receive in a
thread ahead of it). A transfer that fails is discarded with `WeightSyncError` (raised by the next
`poll`/`wait`); the tensors keep the version they had, except after copies straight from a
publisher's slot that cannot be vouched for (they outlasted their lease, and the slot was
staged again or its rank is gone): `version` is then -1 until the next apply brings the newest
version whole.

A GPU-staging transport (cuda_ipc) chosen where host-staging ones were offered too ("auto", or
a list naming both) is given up for the best of those if the publisher's GPU staging stops or
cannot start (no CUDA in its process, no GPU memory: `gpu_mirror`): on connecting, if a rank's
description of its slots says so, or when a rank refuses a lease with `GpuStagingStoppedError`
(no other error: a dead publisher is reported at once). The refused version is applied whole
from host staging in the same call; a subscriber that offered only GPU-staging transports gets
the `GpuStagingStoppedError` with the reason.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping

import msgspec
import torch
import xxhash

import transfer_queue as tq
from transfer_queue import GpuStagingStoppedError, SchemaError, TimeoutError, WeightSyncError
from transfer_queue.host import host_id
from transfer_queue.wire.rpc import DEAD_AFTER, Credentials, check, credentials_from_env

from .background import ImageReceiver, ReadsReceiver
from .delta import threads
from .mapping import NameMapping, TPShard
from .protocol import Latest, Offer, RankInfo, RpcClient, directory_key
from .ranks import PublisherRanks
from .receivers import MappedReceiver, Receiver, ReceiveSettings, Targets
from .transports import AUTO_ORDER, Transport, resolve

__all__ = ["WeightSubscriber"]

log = logging.getLogger("sluice.weight_sync")

_RETRY_SECONDS = 0.2
"""Pause before looking for the publishers again when they are not all there yet."""

_FIRST_CONTACT = 2.0
"""How long a `poll` waits for a connection to rank 0 while it looks for the publishers: a
busy publisher's handshake may take longer (docs/reliability.md, Liveness), and the next
`poll` tries again; a `wait` gives it up to `DEAD_AFTER` within its deadline."""

_RECEIVERS: dict[str, type[Receiver]] = {r.mode: r for r in (MappedReceiver, ReadsReceiver, ImageReceiver)}
"""The receiver strategy for each transport mode (`transports.base.Mode`)."""


class WeightSubscriber:
    """Keeps `model_or_tensors` at the newest weights published on channel `name`.

    Args:
        address: the controller's address, or None to use `publisher` directly.
        model_or_tensors: an `nn.Module` (its state dict) or a dict of tensors, updated in place.
        transport: "auto" (when co-located: cuda_ipc for tensors on a GPU, else shm; across
            hosts ucx when installed, else tcp), a name, a `Transport` instance, or a list; the
            first one every publisher rank can serve wins. A GPU-staging one (cuda_ipc) whose
            staging the publisher stopped (no GPU memory) or cannot start (no CUDA) is given
            up for the first host-staging one offered here that every rank serves, if any.
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
        credentials: the cluster's CurveZMQ keys for the controller and the publishers'
            control endpoints (default: `SLUICE_CREDENTIALS`), as the publisher's
            `credentials=`; transports given by name read `SLUICE_CREDENTIALS`, instances take
            their own (`TcpTransport(credentials=...)`).

    Raises:
        SchemaError: `SLUICE_DELTA_THREADS` is malformed (read here when a transport offered
            takes deltas; `delta.threads`).
        ValueError: neither `address` nor `publisher` is given.
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
        credentials: Credentials | None = None,
    ):
        if address is None and publisher is None:
            raise ValueError("give the controller's address or the publisher's endpoint")
        self.name = name
        self.targets = _tensors(model_or_tensors)
        self.shard = shard or TPShard()
        self.mapping = mapping or NameMapping()
        self.validate = validate
        self.timeout = timeout
        self._offered = resolve(transport)
        self._gpu_targets = any(t.is_cuda for t in self.targets.values()) and not validate
        """Whether GPU-staging transports are preferred (`_choose`): tensors on a GPU, and no
        checksums to compare (they cover host staging)."""
        self._spare: list[Transport] = []
        """Offered host-staging transports every rank serves, kept unused while a GPU-staging
        one is chosen: where this subscriber goes if the publisher's GPU staging stops."""
        self._coordinator = ""
        """Rank 0's control endpoint, once found."""
        # read once, here, so that a bad SLUICE_DELTA_THREADS fails the construction, not a pull
        delta_threads = threads() if any(t.deltas for t in self._offered) else 1
        self._settings = ReceiveSettings(validate, relay, pipelined, buffers, delta_threads)
        self.credentials = credentials if credentials is not None else credentials_from_env()
        self._client = tq.ControlClient(address, self.credentials) if address is not None else None
        self._publisher = publisher
        self._held = Targets()
        self._signature = _signature(self.targets, self.shard, self.mapping)
        self._ranks: PublisherRanks | None = None
        self._receiver: Receiver | None = None
        self._unreached = ""
        """Why the publishers were last not reached (`_start`), for `wait`'s `TimeoutError`."""
        self._closed = False

    @property
    def version(self) -> int:
        """The version the tensors hold (-1: none applied yet)."""
        return self._held.version

    @property
    def last_apply_seconds(self) -> float:
        """How long the last apply (the copy into the tensors) took."""
        return self._held.apply_seconds

    @property
    def last_sources(self) -> list[str]:
        """Per publisher rank, where the last received version came from: "" for the rank
        itself, else the endpoint of the subscriber that relayed it."""
        return [] if self._receiver is None else self._receiver.last_sources

    @property
    def last_received(self) -> list[int]:
        """Per publisher rank, the bytes its stream carried for the last received version:
        delta frames, or the whole reads (0 where the transport does not stream)."""
        return [] if self._receiver is None else self._receiver.last_received

    # -- public ---------------------------------------------------------------------------

    def poll(self) -> int | None:
        """Apply the newest complete version if it is newer than `version`.

        The first call that finds the publishers connects: it picks the transport and, on the
        publishers' host, opens their staging slots, so a rollout worker that polls once at
        start-up does not pay for that in its first version. Returns the version applied, or None.
        It waits for no version: a publisher not reached yet costs it at most `_FIRST_CONTACT`
        (2 s), one that stops answering once connected is reported within 5 s (`DEAD_AFTER`).

        Raises:
            WeightSyncError: a transfer failed since the last call (the tensors keep their
                version; copies from a slot that cannot be vouched for leave `version` at -1),
                or checksums disagree; `GpuStagingStoppedError` (one) when only
                GPU-staging transports were offered and the publisher's GPU staging stopped.
            SchemaError: the tensors do not fit what is published (a name, dtype or shape the
                mapping cannot reconcile), on every call until the published tensors change;
                nothing is applied.
            tq.ClosedError: the subscriber was closed.
        """
        self._check_open()
        if self._receiver is None and not self._start(timeout=0.0):
            return None
        return self._receive(time.monotonic())

    def wait(self, version: int, timeout: float = 30.0) -> int:
        """Block until a version >= `version` is applied; returns the version applied.
        `timeout=math.inf` waits for as long as the publishers live.

        Raises:
            tq.TimeoutError: no such version was applied within `timeout` seconds.
            WeightSyncError: a transfer failed (`GpuStagingStoppedError`: as in `poll`).
            SchemaError: `timeout` is NaN, or the tensors do not fit what is published (as in `poll`).
            tq.ClosedError: the subscriber was closed.
        """
        self._check_open()
        if math.isnan(timeout):
            raise SchemaError("wait's timeout must be a number of seconds (math.inf: no limit), not NaN")
        deadline = time.monotonic() + timeout
        while self.version < version:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f": the publishers were not reached ({self._unreached})" if self._receiver is None else ""
                raise TimeoutError(
                    f"version {version} was not applied within {timeout} s (holding {self.version}){why}"
                )
            if self._receiver is None and not self._start(timeout=left):
                continue
            self._receive(deadline)
        return self.version

    def _receive(self, deadline: float) -> int | None:
        """The receiver's `poll`, waiting until `deadline` (monotonic) for a version; if a rank
        refused its lease because its GPU staging stopped and a host-staging transport is
        spare, fall back to that (`_fall_back`) and poll it, so the version is applied from
        there now."""
        assert self._receiver is not None  # _start made it
        try:
            return self._receiver.poll(timeout=max(0.0, deadline - time.monotonic()))
        except GpuStagingStoppedError as exc:
            if not self._spare:
                raise
            why = str(exc)
        self._fall_back(why)
        assert self._receiver is not None  # _fall_back made it
        return self._receiver.poll(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop receiving and relaying; the tensors keep the version they hold. A subscriber
        is used from one thread at a time (never concurrently), `close` included."""
        if self._closed:
            return
        self._closed = True
        if self._receiver is not None:
            self._receiver.close()  # closes the chosen transport
        else:
            for transport in self._offered:
                transport.close()
        for transport in self._spare:
            transport.close()
        if self._ranks is not None:
            self._ranks.close()
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
        """Find the publishers, pick a transport and start its receiver; False if the
        publishers are not all there yet."""
        deadline = time.monotonic() + timeout
        endpoint = self._publisher
        if endpoint is None:
            assert self._client is not None  # __init__ requires an address or a publisher endpoint
            # in steps of at most `timeout` (the controller bounds a lookup's); `wait` asks again
            raw = self._client.lookup(directory_key(self.name), timeout=min(timeout, self.timeout))
            if raw is None:
                self._unreached = f"nothing announced channel {self.name!r} to the controller"
                return False
            endpoint = msgspec.msgpack.decode(raw, type=RankInfo).control
        began = time.monotonic()
        if timeout <= 0:  # a poll: a publisher not reached yet costs it `_FIRST_CONTACT` at most
            connect, answer = _FIRST_CONTACT, self.timeout
        else:  # a wait: the connection and the answer within what is left of its deadline
            left = deadline - began
            if left <= 0:
                return False
            connect, answer = min(DEAD_AFTER, left), min(self.timeout, left)
        coordinator = RpcClient(endpoint, timeout=self.timeout, connect_timeout=connect, credentials=self.credentials)
        try:
            rid = coordinator.send(Latest(after=-1, complete=True, timeout=0.0))
            offer = check(coordinator.reply(rid, answer, since=began, what="Latest")[0], Offer)
        except WeightSyncError as exc:
            self._unreached = str(exc)
            offer = None
        finally:
            coordinator.close()  # each receiver opens its own, in the thread that uses it
        if offer is not None and not offer.ranks:
            self._unreached = "not every publisher rank has joined rank 0 yet"
        if offer is None or not offer.ranks:  # not started yet, or some trainer ranks have not joined
            left = deadline - time.monotonic()
            if left > 0:
                time.sleep(min(left, _RETRY_SECONDS))
            return False
        self._coordinator = endpoint
        self._connect(offer.ranks)
        return True

    def _connect(self, ranks: list[RankInfo]) -> None:
        """Pick the transport and start its receiver; a GPU-staging one a rank says it stopped
        serving is given up at once for a spare host one (`_fall_back`)."""
        transport = self._choose(ranks)
        self._ranks = PublisherRanks(
            ranks, transport, self.targets, self.shard, self.mapping, self._signature, self.timeout, self.credentials
        )
        stopped = self._ranks.open_slots()
        if stopped and self._spare:
            self._fall_back(stopped)
            return
        settings = self._settings if transport.pipelined else dataclasses.replace(self._settings, pipelined=False)
        self._receiver = _RECEIVERS[transport.mode](self._ranks, self._held, self._coordinator, settings)

    def _fall_back(self, why: str) -> None:
        """The publisher stopped the GPU staging the chosen transport reads (`why`): close it
        and connect over the spare host-staging transports (once: none are spare then)."""
        assert self._ranks is not None  # connected
        log.warning(
            "weight channel %r: the publisher's GPU staging stopped (%s); reading its host staging from now on",
            self.name,
            why,
        )
        if self._receiver is not None:
            self._receiver.close()  # closes the chosen transport
            self._receiver = None
        else:
            self._ranks.transport.close()
        ranks = self._ranks.info
        self._ranks.close()
        self._ranks = None
        self._offered, self._spare = self._spare, []
        self._connect(ranks)

    def _choose(self, ranks: list[RankInfo]) -> Transport:
        """The first offered transport that every rank serves ("map" ones only on this host),
        in `AUTO_ORDER`, except that GPU-staging ones come last for tensors on the host (the
        publisher would take GPU memory for staging that host staging serves as fast) and with
        `validate` (checksums cover host staging). For a GPU-staging one, the host-staging
        ones every rank serves are kept spare (`_fall_back`); the others are closed."""
        here = host_id()

        def rank(t: Transport) -> int:
            if t.staging == "cuda" and not self._gpu_targets:
                return len(AUTO_ORDER) + 1
            return AUTO_ORDER.index(t.name) if t.name in AUTO_ORDER else len(AUTO_ORDER)

        def served(t: Transport) -> bool:
            return all(t.name in r.data and (t.mode != "map" or r.host == here) for r in ranks)

        order = sorted(self._offered, key=rank)
        for transport in order:
            if served(transport):
                for other in order:
                    if other is transport:
                        continue
                    if transport.staging == "cuda" and other.staging == "host" and served(other):
                        self._spare.append(other)
                    else:
                        other.close()
                self._offered = [transport]
                return transport
        raise WeightSyncError(
            f"no common transport: this side has {[t.name for t in self._offered]}, the publishers serve {sorted(ranks[0].data)}"
        )


def _tensors(model_or_tensors: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(model_or_tensors, torch.nn.Module):
        return dict(model_or_tensors.state_dict())
    return dict(model_or_tensors)


def _signature(targets: Mapping[str, torch.Tensor], shard: TPShard, mapping: NameMapping) -> int:
    """Identifies what this subscriber needs: equal signatures mean equal plans (relays)."""
    needs = [[n, list(t.shape), str(t.dtype)] for n, t in targets.items()]
    return xxhash.xxh3_64_intdigest(
        msgspec.msgpack.encode(
            [
                needs,
                shard.rank,
                shard.size,
                sorted(shard.dims.items()),
                sorted((k, list(v)) for k, v in shard.parts.items()),
                sorted(mapping.fuse.items()),
                mapping.rename.__qualname__,
            ]
        )
    )
