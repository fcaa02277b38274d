"""Sluice's public face: start or reach a cluster, put and stream samples, control staleness.

Four floors live here, each imported only from below:

- `wire/` (public, torch-free): what processes agree on: messages, metadata, errors, staleness
  settings, credentials, sizes and the request/reply kernel `wire.rpc`. Services and weight
  transports import it and `host`, nothing else of this package.
- `host` (public, torch-free): what every process needs of its machine.
- The clients, `Client`, `AsyncClient` and the torch-free `ControlClient`: operations written
  once as socket-free flows that drivers run over blocking or asyncio channels; and the
  launchers: `init` starts the services as local processes or Ray actors; `cli` is `sluice`.
- `compat/`: TransferQueue 0.1.11's API (`init(conf)`, `kv_*`, `KVBatchMeta`, ...), so verl runs
  unchanged; `init` dispatches between Sluice's keyword form and TransferQueue's `conf` form.

Names are imported on first use, so the services start without loading torch and tensordict.
One line per module: docs/architecture.md, "The module map".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .wire.errors import (
    CapacityError,
    ClosedError,
    GpuStagingStoppedError,
    InternalError,
    LeaseExpiredError,
    ProtocolError,
    SchemaError,
    SealedError,
    ServiceError,
    SluiceError,
    StaleError,
    TimeoutError,
    UnsatisfiableError,
    VersionError,
    WeightSyncError,
)
from .wire.meta import RAGGED, BatchMeta, FieldSpec

_LAZY = {
    "init": "compat.face",
    "connect": "_cluster",
    "Cluster": "_cluster",
    "parse_bytes": "_cluster",
    "Client": "_client",
    "AsyncClient": "_async_client",
    "ControlClient": "_control_client",
    "connect_async": "_async_client",
    "Grant": "_client_core",
    "ClusterConfig": "wire.messages",
    "StalenessConfig": "wire.staleness",
    "exit_on_signals": "host",
    # TransferQueue 0.1.11's API
    "close": "compat.face",
    "get_client": "compat.face",
    "get_metrics_endpoint": "compat.face",
    "kv_put": "compat.face",
    "kv_batch_put": "compat.face",
    "kv_batch_get": "compat.face",
    "kv_batch_get_by_meta": "compat.face",
    "kv_list": "compat.face",
    "kv_clear": "compat.face",
    "async_kv_put": "compat.face",
    "async_kv_batch_put": "compat.face",
    "async_kv_batch_get": "compat.face",
    "async_kv_batch_get_by_meta": "compat.face",
    "async_kv_list": "compat.face",
    "async_kv_clear": "compat.face",
    "save_checkpoint": "compat.checkpoint",
    "load_checkpoint": "compat.checkpoint",
    "KVBatchMeta": "compat.kv_meta",
    "TransferQueueClient": "compat.client",
}

if TYPE_CHECKING:
    from ._async_client import AsyncClient, connect_async
    from ._client import Client
    from ._client_core import Grant
    from ._cluster import Cluster, connect, parse_bytes
    from ._control_client import ControlClient
    from .compat.checkpoint import load_checkpoint, save_checkpoint
    from .compat.client import TransferQueueClient
    from .compat.face import (
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
    from .compat.kv_meta import KVBatchMeta
    from .host import exit_on_signals
    from .wire.messages import ClusterConfig
    from .wire.staleness import StalenessConfig

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
    "exit_on_signals",
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
