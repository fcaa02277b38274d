"""Sluice's public face: start or reach a cluster, put and stream samples, control staleness.

Layout: `rpc` (public) is the request/reply kernel every Sluice process uses: message base,
framing and limits, error replies, the asyncio and thread service loops, blocking and asyncio
channels. `_cluster` starts the services (controller, storage units) through a backend: local
processes (`_launch`) or Ray actors (`_ray_backend`); `host` (public, torch-free) names and maps
shared-memory files for every part. `_control` (torch-free) and `_client_core` hold every client
operation as a socket-free flow, `_drivers` drives flows over blocking or asyncio channels, under
the faces `_client` (`Client`), `_async_client` (`AsyncClient`) and `_control`'s `ControlClient`
(controller-only calls, no torch); `_messages` are the wire messages; `_tensors` slices and
assembles batches; `_meta` is `BatchMeta`; `_staleness` the staleness settings; `_errors` the
exception tree; `_objects` carries non-tensor fields as msgpack.

TransferQueue 0.1.11's API lives beside Sluice's (so verl runs unchanged): `_tq_face` holds its
module functions (`init(conf)`, `kv_*` and their `async_` twins, `get_client`, `close`, ...) and
the one `init` that dispatches between the two; `_tq_client` its `TransferQueueClient`;
`_kv_meta` its `KVBatchMeta`; `_tq_checkpoint` its checkpoints. `BatchMeta` is one class for
both: Sluice's struct, which also answers TransferQueue's `BatchMeta` operations.

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
    "init": "_tq_face",
    "connect": "_cluster",
    "Cluster": "_cluster",
    "parse_bytes": "_cluster",
    "Client": "_client",
    "AsyncClient": "_async_client",
    "ControlClient": "_control",
    "connect_async": "_async_client",
    "Grant": "_client_core",
    "ClusterConfig": "_messages",
    "StalenessConfig": "_staleness",
    # TransferQueue 0.1.11's API
    "close": "_tq_face",
    "get_client": "_tq_face",
    "get_metrics_endpoint": "_tq_face",
    "kv_put": "_tq_face",
    "kv_batch_put": "_tq_face",
    "kv_batch_get": "_tq_face",
    "kv_batch_get_by_meta": "_tq_face",
    "kv_list": "_tq_face",
    "kv_clear": "_tq_face",
    "async_kv_put": "_tq_face",
    "async_kv_batch_put": "_tq_face",
    "async_kv_batch_get": "_tq_face",
    "async_kv_batch_get_by_meta": "_tq_face",
    "async_kv_list": "_tq_face",
    "async_kv_clear": "_tq_face",
    "save_checkpoint": "_tq_checkpoint",
    "load_checkpoint": "_tq_checkpoint",
    "KVBatchMeta": "_kv_meta",
    "TransferQueueClient": "_tq_client",
}

if TYPE_CHECKING:
    from ._async_client import AsyncClient, connect_async
    from ._client import Client
    from ._client_core import Grant
    from ._cluster import Cluster, connect, parse_bytes
    from ._control import ControlClient
    from ._kv_meta import KVBatchMeta
    from ._messages import ClusterConfig
    from ._staleness import StalenessConfig
    from ._tq_checkpoint import load_checkpoint, save_checkpoint
    from ._tq_client import TransferQueueClient
    from ._tq_face import (
        async_kv_batch_get,
        async_kv_batch_get_by_meta,
        async_kv_batch_put,
        async_kv_clear,
        async_kv_list,
        async_kv_put,
        close,
        get_client,
        get_metrics_endpoint,
        init,
        kv_batch_get,
        kv_batch_get_by_meta,
        kv_batch_put,
        kv_clear,
        kv_list,
        kv_put,
    )

__all__ = [
    "init",
    "connect",
    "connect_async",
    "Cluster",
    "Client",
    "AsyncClient",
    "ControlClient",
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
    # TransferQueue 0.1.11's API
    "close",
    "get_client",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "save_checkpoint",
    "load_checkpoint",
    "KVBatchMeta",
    "TransferQueueClient",
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
