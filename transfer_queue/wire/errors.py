"""Sluice's exception hierarchy.

Every error a Sluice service or client raises derives from one root, so callers can catch the
whole family at once::

    SluiceError
     ├── TimeoutError        (also builtins.TimeoutError) not enough samples/budget/space in time
     │   └── LeaseExpiredError  an ack came after its lease expired and the samples were
     │                       leased again to another consumer of the task
     ├── CapacityError       storage stayed full for the whole `timeout` of a put
     ├── SchemaError         (also ValueError) the data contradicts a field's dtype/shape, or
     │   │                   asks for a field that does not exist; your input is wrong
     │   └── UnsatisfiableError  a waiting call that can never be satisfied under the
     │                       cluster's settings (the message names the limit and the fix)
     ├── ProtocolError       a message could not be decoded or is not allowed; the peer is wrong
     ├── SealedError         put into a partition after `seal`
     ├── StaleError          a sample or version breaks the staleness rules
     ├── VersionError        `set_version` tried to go backwards
     ├── WeightSyncError     a weight transfer failed; the previous version stays in place
     │   └── GpuStagingStoppedError  a publisher's GPU staging stopped or cannot start (no
     │                       CUDA, no GPU memory); its host staging goes on
     ├── ServiceError        a service died or stopped answering (the message names it): restart
     │                       it or retry; your request's fate is in the message
     ├── InternalError       Sluice broke its own rules (an unexpected error serving the request,
     │                       a failed invariant): a bug in Sluice, report it with the message
     └── ClosedError         the client or cluster was already closed (your code closed it)

Each class says who should act: the input (`SchemaError`, `SealedError`, `StaleError`,
`VersionError`), the load (`TimeoutError`, `CapacityError`), the deployment (`ServiceError`,
`ProtocolError`, `GpuStagingStoppedError`), your own code (`ClosedError`) or Sluice's developers
(`InternalError`).

Services reply with an `ErrorReply(code, message)`; the client turns `code` back into the class
here, so the error raised in your process is the same one raised in the service.
"""

from __future__ import annotations

import builtins

__all__ = [
    "SluiceError",
    "TimeoutError",
    "LeaseExpiredError",
    "CapacityError",
    "SchemaError",
    "UnsatisfiableError",
    "ProtocolError",
    "SealedError",
    "StaleError",
    "VersionError",
    "WeightSyncError",
    "GpuStagingStoppedError",
    "ServiceError",
    "InternalError",
    "ClosedError",
    "error_code",
    "error_from_code",
]


class SluiceError(Exception):
    """Root of every Sluice error."""

    code = "sluice"


class TimeoutError(SluiceError, builtins.TimeoutError):  # noqa: A001 - the contract's name
    """The request could not be satisfied within its `timeout` (samples, budget or a reply)."""

    code = "timeout"


class LeaseExpiredError(TimeoutError):
    """An `ack` came after its lease expired, and some of its samples had been leased again to
    another consumer of the same task meanwhile (held or already acked by it): those were left
    to that consumer, the rest were acked. Both consumers processed those samples; raise
    `lease_timeout` above the time a batch takes. The message says how many and which task."""

    code = "lease_expired"


class CapacityError(SluiceError):
    """Storage stayed full for the whole `timeout`; clear consumed samples or add capacity."""

    code = "capacity"


class SchemaError(SluiceError, ValueError):
    """The input contradicts the schema: wrong dtype or shape, unknown field, bad batch size."""

    code = "schema"


class UnsatisfiableError(SchemaError):
    """A waiting call can never be satisfied under the cluster's settings, so it fails at once
    instead of waiting out its timeout: a batch larger than the admission budget can ever let
    in, or a request that could only be served by more samples than can ever come. The
    message names the limit that stands in the way and how to change it."""

    code = "unsatisfiable"


class ProtocolError(SluiceError):
    """A message was malformed, oversized, of an unknown type or from another protocol version."""

    code = "protocol"
    request_id: int = 0
    """The id of the request it refuses, once its prefix could be read (0: unknown)."""


class SealedError(SluiceError):
    """The partition was sealed: no more samples may be put into it."""

    code = "sealed"


class StaleError(SluiceError):
    """A sample or grant violates the staleness bound."""

    code = "stale"


class VersionError(SluiceError, ValueError):
    """A weight version went backwards; versions are monotone."""

    code = "version"


class WeightSyncError(SluiceError):
    """A weight transfer failed or was interrupted; the previous version stays in place."""

    code = "weight_sync"


class GpuStagingStoppedError(WeightSyncError):
    """A publisher rank refused a lease over a GPU-staging transport (`cuda_ipc`) because its
    GPU staging beside host staging stopped for good or cannot start: no CUDA in its process,
    or no GPU memory for its slots (the message says which). Its host staging goes on: a
    subscriber that offered a host transport too reads that from then on; one that named only
    GPU-staging transports gets this error on every call, so name a host transport as well."""

    code = "gpu_staging_stopped"


class ServiceError(SluiceError):
    """A service died or hangs: external circumstances, so restart it or retry. The message names
    the service and says what became of your request."""

    code = "service"


class InternalError(SluiceError):
    """A bug in Sluice: a service hit an unexpected error serving the request (the service logged
    its traceback), or Sluice found one of its own invariants broken. Neither your input nor a
    dead peer caused it, so retrying rarely helps: report it with the message."""

    code = "internal"


class ClosedError(SluiceError):
    """The client or cluster was already closed; open a new one."""

    code = "closed"


_BY_CODE: dict[str, type[SluiceError]] = {
    cls.code: cls
    for cls in (
        SluiceError,
        TimeoutError,
        LeaseExpiredError,
        CapacityError,
        SchemaError,
        UnsatisfiableError,
        ProtocolError,
        SealedError,
        StaleError,
        VersionError,
        WeightSyncError,
        GpuStagingStoppedError,
        ServiceError,
        InternalError,
        ClosedError,
    )
}


def error_code(exc: BaseException) -> str:
    """The wire code for `exc`: its Sluice class's code, or `internal` for anything foreign (a
    service that raises something else than a Sluice error has a bug)."""
    return exc.code if isinstance(exc, SluiceError) else InternalError.code


def error_from_code(code: str, message: str) -> SluiceError:
    """Rebuild the exception a service reported; unknown codes become `ServiceError`."""
    return _BY_CODE.get(code, ServiceError)(message)
