"""Sluice's public face: start or reach a cluster, put and stream samples, control staleness.

Layout: `_cluster` starts the services (controller, storage units) as local processes;
`_client_core` holds every client operation as a socket-free flow, driven by `_client`
(blocking) and `_async_client` (asyncio); `_messages` and `_wire` are the wire protocol
(msgspec messages, raw tensor frames); `_tensors` slices and assembles batches; `_meta` is
`BatchMeta`; `_staleness` the staleness settings; `_errors` the exception tree; `_service` the
asyncio loop the services share.

Names are imported on first use, so the services (which need only the wire protocol) start
without loading torch and tensordict.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._errors import (
    CapacityError,
    ClosedError,
    ProtocolError,
    SchemaError,
    SealedError,
    ServiceError,
    SluiceError,
    StaleError,
    TimeoutError,
    VersionError,
    WeightSyncError,
)
from ._meta import RAGGED, BatchMeta, FieldSpec

_LAZY = {
    "init": "_cluster",
    "connect": "_cluster",
    "Cluster": "_cluster",
    "parse_bytes": "_cluster",
    "Client": "_client",
    "AsyncClient": "_async_client",
    "connect_async": "_async_client",
    "Grant": "_client_core",
    "ClusterConfig": "_messages",
    "StalenessConfig": "_staleness",
}

if TYPE_CHECKING:
    from ._async_client import AsyncClient, connect_async
    from ._client import Client
    from ._client_core import Grant
    from ._cluster import Cluster, connect, init, parse_bytes
    from ._messages import ClusterConfig
    from ._staleness import StalenessConfig

__all__ = [
    "init",
    "connect",
    "connect_async",
    "Cluster",
    "Client",
    "AsyncClient",
    "Grant",
    "BatchMeta",
    "FieldSpec",
    "RAGGED",
    "ClusterConfig",
    "StalenessConfig",
    "parse_bytes",
    "SluiceError",
    "TimeoutError",
    "CapacityError",
    "SchemaError",
    "ProtocolError",
    "SealedError",
    "StaleError",
    "VersionError",
    "WeightSyncError",
    "ServiceError",
    "ClosedError",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'transfer_queue' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
