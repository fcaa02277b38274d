"""What `status()` reports, as typed statistics objects: each part of the controller fills its own.

`Partition.status()` (table.py), `StaleCounters.status()` and `Scheduler.status()`
(scheduling.py), `Admission.status()` (admission.py) and the controller's own counters
(service.py) meet in `ClusterStatus`, which the controller turns into builtins once
(`msgspec.to_builtins`) for the `Status` reply: the dict that `client.status()`, `sluice status`
and the recipes read. The Prometheus endpoint (metrics.py) reads the same objects, typed.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "TaskStatus",
    "FieldStatus",
    "PartitionStatus",
    "UnitStatus",
    "RetiredUnitStatus",
    "StalenessStatus",
    "AdmissionStatus",
    "SchedulerStatus",
    "Counters",
    "ClusterStatus",
]


class TaskStatus(msgspec.Struct):
    """One consumer task's progress through a partition (live samples only)."""

    consumed: int
    """Samples the task acked."""
    leased: int
    """Samples handed out under a lease that is not acked yet."""
    pending: int
    """Committed samples the task has neither consumed nor leased: its queue depth."""


class FieldStatus(msgspec.Struct):
    """A column of a partition."""

    dtype: str
    shape: list[int]
    """Per-sample shape; -1 marks a ragged dimension."""


class PartitionStatus(msgspec.Struct):
    """One partition's samples, columns and consumers."""

    samples: int
    """Live samples (put, not cleared), committed or not."""
    committed: int
    """Live samples whose put completed."""
    sealed: bool
    fields: dict[str, FieldStatus]
    ready: dict[str, int]
    """Per field: live samples that have it."""
    bytes: int
    """Bytes its live samples hold on the storage units."""
    tasks: dict[str, TaskStatus]


class UnitStatus(msgspec.Struct):
    """A registered storage unit."""

    address: str
    capacity: int
    bytes: int
    """Bytes the controller has placed on it and not freed."""
    frames_in_flight: int = 0
    """Bytes of open puts' frames on their way to it, not yet stored (its frame window: `controllers.intake`)."""


class RetiredUnitStatus(msgspec.Struct):
    """A storage unit that stopped answering (until it registers again)."""

    address: str


class StalenessStatus(msgspec.Struct):
    """Staleness of the samples served, and what happened to the too-stale ones."""

    histogram: dict[str, int]
    """Samples served, by staleness (trainer version minus policy version), ascending."""
    dropped: int
    kept: int
    requeued: int


class AdmissionStatus(msgspec.Struct):
    """The producers' generation-slot budget (AReaL's rule)."""

    accepted: int
    """Samples put under a grant, less those dropped or requeued as stale."""
    running: int
    """Slots granted and not yet put."""
    budget: int | None
    """Slots that may be granted now (below zero: overdrawn, see `overdrafts`); None when
    admission is unbounded."""
    open_grants: int
    waiting: int
    """`acquire` calls parked for budget now."""
    waits: int
    """`acquire` calls that had to wait, since start."""
    wait_seconds: float
    expired_grants: int
    consumer_batch_size: int
    """The consumer batch the budget counts with now (see `follows_consumers`)."""
    configured_consumer_batch_size: int
    follows_consumers: bool
    """The budget grows to what the consumers really take per version (False: pinned)."""
    grown_by: str
    """Why `consumer_batch_size` last grew above the configured value ("" if it did not)."""
    overdrafts: int = 0
    """Acquires granted over a leftover smaller than them, because a consumer waited for them
    (`budget` is below zero until the next version pays the overdraft back)."""


class SchedulerStatus(msgspec.Struct):
    """What the consumer-side scheduler has done and holds."""

    served: int
    acked: int
    open_leases: int
    parked: int
    """`get_meta` calls waiting for samples now."""
    ack_refused: int
    """Sample-acks refused, left to another consumer (see `Counters.samples_ack_refused`)."""


class Counters(msgspec.Struct):
    """Counts since the controller started (and a few gauges of what is open now)."""

    samples_put: int
    samples_served: int
    samples_acked: int
    open_leases: int
    parked_get_meta: int
    open_puts: int
    puts_waiting_for_room: int
    """Puts the controller holds until their storage units have room (see `intake`)."""
    puts_expired: int
    """Puts not committed in time (their producer stalled or died); their rows were freed."""
    samples_lost: int
    """Samples whose storage unit died."""
    registrations_refused: int
    reports_refused: int
    """Put-write reports (`WriteLanded`) without the cluster secret."""
    auth_refused: int
    requests_served: int
    requests_rejected: int
    puts_abandoned: int = 0
    """Puts whose producer's connection closed before their commit; ended at once, rows freed."""
    samples_ack_refused: int = 0
    """Sample-acks refused because the ack's lease had expired and the sample was leased again to
    another consumer of the task (the acker got `LeaseExpiredError`): processed twice. A sample
    acked late twice counts twice. Raise `lease_timeout` if it grows."""


class ClusterStatus(msgspec.Struct):
    """The whole picture `status()` returns."""

    cluster_id: str
    uptime_s: float
    version: int
    max_staleness: int | None
    stale_policy: str
    partitions: dict[str, PartitionStatus]
    units: dict[str, UnitStatus]
    retired_units: dict[str, RetiredUnitStatus]
    bytes: int
    """Bytes held by all storage units."""
    staleness: StalenessStatus
    admission: AdmissionStatus
    counters: Counters
    handling_us: dict[str, float] = {}
    """The controller's own time per request over its last 4,096 (`rpc.Service.handling`):
    p50, p99 and max in microseconds."""
