"""Sluice's public face: start or reach a cluster, put and stream samples, control staleness.

Layout: `_cluster` starts the services (controller, storage units) as local processes;
`_client_core` holds every client operation as a socket-free flow, driven by `_client`
(blocking) and `_async_client` (asyncio); `_messages` and `_wire` are the wire protocol
(msgspec messages, raw tensor frames); `_tensors` slices and assembles batches; `_meta` is
`BatchMeta`; `_errors` the exception tree; `_service` the asyncio loop the services share.
"""

import warnings as _warnings

from ._async_client import AsyncClient, connect_async
from ._client import Client
from ._client_core import Grant
from ._cluster import Cluster, connect, init, parse_bytes
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
from ._messages import ClusterConfig
from ._staleness import StalenessConfig

# Received frames are read-only buffers; torch warns on viewing them although we only read.
_warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

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
