"""The blocking client: every operation written out, each driving one `ClientCore` flow over
blocking `rpc.Channel`s (one DEALER per service; replies matched by id, so a request may stay
in flight, e.g. the next batch of a stream, while another completes)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ._client_core import ClientCore, Grant
from ._control_client import ControlClient
from ._drivers import SyncDriver
from .wire.messages import ClusterConfig, UnitInfo
from .wire.meta import BatchMeta
from .wire.rpc import Credentials

__all__ = ["Client"]


class Client(ControlClient):
    """Blocking Sluice client. Use `tq.connect(address)`; close it (or use `with`) when done.

    Every call raises `ServiceError` when a service it needs died or stays silent (the message
    names it; a `put` or `get_data` that failed on a storage unit that restarted since is tried
    once more at its new address), `ClosedError` after `close()`, and `SchemaError` for
    arguments that cannot be sent; the calls below list what else they raise.

    Threads: a client is not thread-safe for concurrent calls (its sockets and its streams'
    prefetch serve one call at a time): give each thread a client of its own, or serialize
    the calls. `close()` alone may come from any thread at any
    time: a call in flight then (even one waiting at the controller for samples) is woken and
    raises `ClosedError` promptly, and the sockets are closed once it has stopped.
    """

    _core: ClientCore

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        SyncDriver.__init__(self, ClientCore(address, use_shm, credentials))  # a ControlClient on a fuller core
        try:
            self._run(self._core.hello())
        except BaseException:
            self.close()
            raise

    # -- the cluster -------------------------------------------------------------------

    @property
    def config(self) -> ClusterConfig:
        """The cluster's settings (staleness bound, lease timeout, capacity...)."""
        assert self._core.config is not None
        return self._core.config

    @property
    def cluster_id(self) -> str:
        return self._core.cluster_id

    @property
    def units(self) -> dict[int, UnitInfo]:
        """The storage units, by unit id."""
        return self._core.units

    @property
    def mapped_units(self) -> set[int]:
        """Units whose shared-memory arena this client maps (co-located: data moves by memcpy)."""
        return set(self._core._arenas)

    # -- producers ---------------------------------------------------------------------

    def put(
        self,
        data: TensorDict | Mapping[str, torch.Tensor],
        partition: str = "train",
        *,
        meta: BatchMeta | None = None,
        policy_version: int | tuple[int, int] | Sequence[int] | None = None,
        groups: Sequence[int] | None = None,
        grant: Grant | None = None,
        source: BatchMeta | None = None,
        timeout: float = 30.0,
    ) -> BatchMeta:
        """Store a batch: new samples by default; with `meta=`, new columns for those samples.

        `policy_version` is the version that generated the samples: one int, a (first, last)
        span for a partial rollout resumed under newer weights, or one int per sample (default:
        the grant's version; with neither, the samples carry no version, e.g. prompts: they
        read as version 0 and are never too stale). `groups` are GRPO group ids (default: one
        group per sample). `source` is the prompt batch the samples came from (needed by the
        `requeue` stale policy). `grant` defaults to the oldest of this client's open grants
        with slots left for the whole batch (see `Grant`). On any error nothing of the batch
        becomes visible.

        Raises:
            CapacityError: storage stayed full for `timeout` seconds.
            SchemaError: the data contradicts the partition's fields, an argument is invalid, or
                without `grant=` no open grant of this client has slots left for the batch.
            SealedError: the partition was sealed.
        """
        return self._run(
            self._core.put(
                data,
                partition,
                meta=meta,
                policy_version=policy_version,
                groups=groups,
                grant=grant,
                source=source,
                timeout=timeout,
            )
        )

    def acquire(self, n: int, timeout: float = 30.0) -> Grant:
        """Wait (without polling) for `n` generation slots inside the staleness budget; the
        `Grant` says which policy version to generate with.

        Raises:
            TimeoutError: the budget did not open within `timeout` seconds.
        """
        grant = self._run(self._core.acquire(n, timeout))
        grant._client = self
        return grant

    def release(self, grant: Grant) -> None:
        """Return a grant's unused slots."""
        self._run(self._core.release(grant))

    # -- consumers ---------------------------------------------------------------------

    def get_meta(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str = "train",
        *,
        sampler: str = "fifo",
        max_staleness: int | None = None,
        timeout: float = 30.0,
        allow_partial: bool = False,
        lease_timeout: float | None = None,
        **sampler_options: int | float | str,
    ) -> BatchMeta:
        """Lease `batch_size` samples whose `fields` are ready and that `task` has not consumed.

        A sealed, drained partition returns the remainder at once (an empty batch when nothing
        is left). Samples staler than `max_staleness` (default: the cluster's) are never served.
        The lease lasts `lease_timeout` seconds (default: the cluster's); unacked samples then
        return to the pool. Extra keyword arguments go to the sampler (`group_size=` for
        `grpo_group`, `dp_size=` for `seqlen_balanced`).

        Raises:
            TimeoutError: fewer than `batch_size` were ready within `timeout` seconds (with
                `allow_partial=True`, what is ready is returned instead, possibly nothing).
            SchemaError: an unknown sampler or field, or an invalid argument.
        """
        return self._run(
            self._core.get_meta(
                fields,
                batch_size,
                task,
                partition,
                sampler=sampler,
                max_staleness=max_staleness,
                timeout=timeout,
                allow_partial=allow_partial,
                lease_timeout=lease_timeout,
                **sampler_options,
            )
        )

    def get_data(
        self, meta: BatchMeta, fields: Sequence[str] | None = None, device: str | torch.device | None = None
    ) -> TensorDict:
        """Read the batch's fields (default: all) from every unit holding it, in parallel; rows
        in meta order. Uniform fields come back dense, ragged ones as jagged nested tensors.

        With `device` (e.g. "cuda:0"), tensor fields come back on that device, copied host to
        device straight from the mapped arena or the received frames (non-tensor fields stay on
        the CPU); the copies are complete when the call returns.

        Raises:
            SchemaError: a field the batch lacks was asked for, or `device` is not the CPU or a
                CUDA device this process has.
        """
        return self._run(self._core.get_data(meta, fields, device))

    def ack(self, meta: BatchMeta) -> None:
        """Mark the batch consumed by its task (exactly-once effect per task), ending its lease.

        Raises:
            LeaseExpiredError: the lease had expired and some samples were leased again to another
                consumer of the task meanwhile; those are left to it, the rest are acked.
        """
        self._run(self._core.ack(meta))

    def nack(self, meta: BatchMeta) -> None:
        """Give the batch back unconsumed: its samples are ready for the task again (after its
        lease expired, only those nobody leased since: the others stay with their consumer)."""
        self._run(self._core.nack(meta))

    def clear(self, meta: BatchMeta) -> None:
        """Delete the batch's samples from the controller and the storage units."""
        self._run(self._core.clear(meta))

    def clear_partition(self, partition: str = "train") -> None:
        """Delete every sample of `partition` (the name may then be reused, unsealed)."""
        self._run(self._core.clear_partition(partition))

    def stream(
        self,
        fields: Sequence[str],
        batch_size: int,
        task: str,
        partition: str = "train",
        *,
        timeout: float | None = None,
        device: str | torch.device | None = None,
        **get_meta_options: Any,
    ) -> Iterator[tuple[TensorDict, BatchMeta]]:
        """Yield `(batch, meta)` micro-batches until the sealed partition is drained.

        While you work on a batch, the next one is already on its way: its lease is requested
        when this one is handed to you, and its data as soon as the lease comes back while this
        client is busy anyway (your own calls meanwhile, say a `clear` or a `put`, or taking the
        batch: there is no background thread). The same prefetch as
        `AsyncClient.stream`'s, whose next batch advances whenever you await. Taking the next
        batch acks the previous one (sent then; its answer is collected when the batch after is
        taken, costing no round trip). Leaving the loop early nacks the batch in hand (ack it
        yourself first if you finished it) and gives back the one prefetched. `timeout=None`
        waits indefinitely. Batches come on `device` (see `get_data`). With `allow_partial=True`
        a batch may be short (what was ready within `timeout`); the stream still ends only once
        the sealed partition is drained for `task`.

        Raises:
            TimeoutError: (from the iterator) no batch within `timeout` seconds; with
                `allow_partial=True`, no sample (the message names fields no put has brought).
            SchemaError: `device` is not the CPU or a CUDA device this process has.
            LeaseExpiredError: (from the iterator) a batch's lease expired before its ack and some
                of its samples went to another consumer of the task (raised a batch later).
        """
        return self._iterate(self._core.stream(fields, batch_size, task, partition, timeout, get_meta_options, device))

    # -- the controller-only calls: written once in `ControlClient`, named here -------------

    status = ControlClient.status
    version = ControlClient.version
    get_version = ControlClient.get_version
    set_version = ControlClient.set_version
    wait_version = ControlClient.wait_version
    versions = ControlClient.versions
    announce = ControlClient.announce
    lookup = ControlClient.lookup
    seal = ControlClient.seal

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike) -> int:
        """Write the cluster's samples and consumer progress to the directory `path`; returns the
        number of samples.

        Saves the version, every partition's committed samples (all their ready fields) and,
        per consumer task, which samples it consumed; leased samples count as not consumed, so
        they are delivered again after a restore. Run it while producers and consumers pause.
        Restore with `tq.init(restore=path)` or `restore_checkpoint`.
        """
        return self._run(self._core.save_checkpoint(path))

    def restore_checkpoint(self, path: str | os.PathLike) -> int:
        """Put a checkpoint's samples into this (empty) cluster with their versions and groups,
        mark what each task had consumed, seal what was sealed, set the version; returns the
        number of samples (they get new indexes).

        Raises:
            SchemaError: `path` holds no checkpoint.
        """
        return self._run(self._core.restore_checkpoint(path))

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close sockets and unmap arenas; the client cannot be used afterwards (`ClosedError`).
        It may be called from another thread while a call runs: that call raises `ClosedError`
        (see the class docstring)."""
        super().close()

    def _free(self) -> None:
        try:
            super()._free()
        finally:
            self._core.close_arenas()  # once no call copies through them

    def __enter__(self) -> Client:
        return self
