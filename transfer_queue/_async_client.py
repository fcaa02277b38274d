"""The asyncio client: every operation written out, each driving the same `ClientCore` flow as
`Client` does, over `rpc.AsyncChannel`s. Any number of coroutines may share one client; a
cancelled call is withdrawn at the service (`Cancel`), and a lease or grant it won meanwhile
is given back."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDict

from ._client_core import ClientCore, Grant
from ._drivers import AsyncDriver
from .wire.messages import ClusterConfig, UnitInfo
from .wire.meta import BatchMeta
from .wire.rpc import Credentials

__all__ = ["AsyncClient", "connect_async"]


class AsyncClient(AsyncDriver):
    """Asyncio Sluice client; create with `await tq.connect_async(address)` (or construct it and
    `await client.hello()`). Errors as `Client`'s."""

    _core: ClientCore

    def __init__(self, address: str, use_shm: bool | None = None, credentials: Credentials | None = None):
        super().__init__(ClientCore(address, use_shm, credentials))

    async def hello(self) -> None:
        """Fetch the cluster's configuration and storage units (`connect_async` does it)."""
        await self._run(self._core.hello())

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

    async def put(
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
        return await self._run(
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

    async def acquire(self, n: int, timeout: float = 30.0) -> Grant:
        """Wait (without polling) for `n` generation slots inside the staleness budget; the
        `Grant` says which policy version to generate with.

        Raises:
            TimeoutError: the budget did not open within `timeout` seconds.
        """
        grant = await self._run(self._core.acquire(n, timeout))
        grant._client = self
        return grant

    async def release(self, grant: Grant) -> None:
        """Return a grant's unused slots."""
        await self._run(self._core.release(grant))

    async def seal(self, partition: str = "train") -> None:
        """No more samples will come to `partition`; streams end once it is drained."""
        await self._run(self._core.seal(partition))

    # -- consumers ---------------------------------------------------------------------

    async def get_meta(
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
        return await self._run(
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

    async def get_data(
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
        return await self._run(self._core.get_data(meta, fields, device))

    async def ack(self, meta: BatchMeta) -> None:
        """Mark the batch consumed by its task (exactly-once effect per task), ending its lease.

        Raises:
            LeaseExpiredError: the lease had expired and some samples were leased again to another
                consumer of the task meanwhile; those are left to it, the rest are acked.
        """
        await self._run(self._core.ack(meta))

    async def nack(self, meta: BatchMeta) -> None:
        """Give the batch back unconsumed: its samples are ready for the task again (after its
        lease expired, only those nobody leased since: the others stay with their consumer)."""
        await self._run(self._core.nack(meta))

    async def clear(self, meta: BatchMeta) -> None:
        """Delete the batch's samples from the controller and the storage units."""
        await self._run(self._core.clear(meta))

    async def clear_partition(self, partition: str = "train") -> None:
        """Delete every sample of `partition` (the name may then be reused, unsealed)."""
        await self._run(self._core.clear_partition(partition))

    # -- versions ----------------------------------------------------------------------

    async def set_version(self, version: int) -> int:
        """Record the trainer's new weight version; returns it.

        Raises:
            VersionError: `version` is below the current one (versions are monotone).
        """
        return await self._run(self._core.set_version(version))

    async def get_version(self) -> int:
        """The trainer's current weight version."""
        return await self._run(self._core.get_version())

    async def wait_version(self, version: int, timeout: float = 30.0) -> int:
        """Block until the version is at least `version`; returns the current version.

        Raises:
            TimeoutError: it did not get there within `timeout` seconds.
        """
        return await self._run(self._core.wait_version(version, timeout))

    # -- checkpoints, status, small shared values ----------------------------------------

    async def save_checkpoint(self, path: str | os.PathLike) -> int:
        """Write the cluster's samples and consumer progress to the directory `path`; returns the
        number of samples.

        Saves the version, every partition's committed samples (all their ready fields) and,
        per consumer task, which samples it consumed; leased samples count as not consumed, so
        they are delivered again after a restore. Run it while producers and consumers pause.
        Restore with `tq.init(restore=path)` or `restore_checkpoint`.
        """
        return await self._run(self._core.save_checkpoint(path))

    async def restore_checkpoint(self, path: str | os.PathLike) -> int:
        """Put a checkpoint's samples into this (empty) cluster with their versions and groups,
        mark what each task had consumed, seal what was sealed, set the version; returns the
        number of samples (they get new indexes).

        Raises:
            SchemaError: `path` holds no checkpoint.
        """
        return await self._run(self._core.restore_checkpoint(path))

    async def status(self) -> dict:
        """A dict: partitions with per-task counts, versions, staleness histogram, admission, bytes."""
        return await self._run(self._core.status())

    async def announce(self, key: str, value: bytes) -> None:
        """Publish a small value (≤ 1 MiB) under `key` for other clients to `lookup`.

        Raises:
            SchemaError: `value` is not bytes, or too large.
        """
        await self._run(self._core.announce(key, value))

    async def lookup(self, key: str, timeout: float = 0.0) -> bytes | None:
        """The value announced under `key`, waiting up to `timeout` s for it; None if absent."""
        return await self._run(self._core.lookup(key, timeout))

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
    ) -> AsyncIterator[tuple[TensorDict, BatchMeta]]:
        """Yield `(batch, meta)` until the sealed partition is drained, fetching the next
        micro-batch (its lease, then its data: the same prefetch as `Client.stream`'s) while you
        work on the current one; it advances whenever you await. Batches come on `device` (see
        `get_data`). Taking the next batch acks the
        previous (sent then, its answer collected when the batch after is taken); leaving early
        nacks what is in hand and gives back the one prefetched. With `allow_partial=True` a batch
        may be short; the stream still ends only once the sealed partition is drained for `task`.

        Raises:
            TimeoutError: no batch within `timeout` seconds (None: wait indefinitely); with
                `allow_partial=True`, no sample (the message names fields no put has brought).
            SchemaError: `device` is not the CPU or a CUDA device this process has.
            LeaseExpiredError: (from the iterator) a batch's lease expired before its ack and some
                of its samples went to another consumer of the task (raised a batch later).
        """
        return self._iterate(self._core.stream(fields, batch_size, task, partition, timeout, get_meta_options, device))

    def versions(self, timeout: float = 1e9, after: int | None = None) -> AsyncIterator[int]:
        """Every version the trainer sets after `after`, in order, none skipped. The default is
        the version when iteration starts (an async generator runs nothing before its first
        step): pass `after` to miss nothing set in between.

        Raises:
            TimeoutError: no new version within `timeout` seconds.
        """
        return self._iterate(self._core.versions(after, timeout))

    # -- lifecycle ---------------------------------------------------------------------

    async def close(self) -> None:
        """Close sockets and unmap arenas; the client cannot be used afterwards (`ClosedError`)."""
        await super().close()
        self._core.close_arenas()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def connect_async(
    address: str, use_shm: bool | None = None, credentials: Credentials | None = None
) -> AsyncClient:
    """Connect an `AsyncClient` to the cluster whose controller listens at `address` (with
    `credentials`, default `SLUICE_CREDENTIALS`, when it is bound beyond loopback).

    Raises:
        ServiceError: the controller is down, silent, or refused these credentials.
    """
    client = AsyncClient(address, use_shm, credentials)
    try:
        await client.hello()
    except BaseException:
        await client.close()
        raise
    return client
