"""TransferQueue 0.1.11's module functions on Sluice, so code written for it (verl) runs unchanged.

`init(conf)` takes TransferQueue's config (an OmegaConf `DictConfig` or a dict) and starts a
Sluice cluster; the state is process-global, as TransferQueue's. The first `init` makes the
cluster findable, and every later `init()` or `init(conf)`, in this process or another, attaches
to it (its `conf` is then ignored, as in TransferQueue):

- under Ray (`ray.is_initialized()` when `init` runs, as in verl's task runner), the services
  run as Ray actors (`backend="ray"`, each binding its node's IP, zero CPUs reserved) and a
  named actor `sluice-transfer-queue` in namespace `transfer_queue` holds the address, so any
  Ray worker or driver of that Ray cluster attaches by name;
- without Ray, the services are local processes and `SLUICE_TQ_ADDRESS` in the environment
  hands the address to child processes.

Config: `backend.storage_backend` must be `SimpleStorage` (Mooncake/Yuanrong do not exist in
Sluice: `SchemaError`); `backend.SimpleStorage.num_data_storage_units` is the number of storage
units; `metrics.enabled`/`metrics.port` start the Prometheus exporter; an optional `sluice:`
section passes any of Sluice's `init` keywords (`storage_capacity`, `max_staleness`,
`consumer_batch_size`, `stale_policy`, ...) and `budget_staleness`/`partial_rollout` (the other
fields of `StalenessConfig`). `total_storage_size` (a sample count) and
`controller.sampler`/`polling_mode` have no Sluice meaning and are ignored: Sluice bounds
storage in bytes (`sluice.storage_capacity`, default 2 GiB as Sluice's `init`; the units
pre-fault their arenas, so size it to the run).

`tq.init` itself dispatches (see `init`): a mapping argument (or `conf=`) is TransferQueue's
call; no arguments attach when a TransferQueue-style cluster is found and otherwise start
Sluice's embedded default; Sluice's own arguments are Sluice's `init`.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from ..wire.auth import Credentials
from ..wire.errors import ClosedError, SchemaError
from ..wire.staleness import StalenessConfig

if TYPE_CHECKING:
    from tensordict import TensorDict

    from .._cluster import Cluster
    from .client import TransferQueueClient
    from .kv_meta import KVBatchMeta

__all__ = [
    "init",
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
]

ENV_ADDRESS = "SLUICE_TQ_ADDRESS"
ENV_CONF = "SLUICE_TQ_CONF"
RAY_NAME = "sluice-transfer-queue"
RAY_NAMESPACE = "transfer_queue"

_DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {
        "storage_backend": "SimpleStorage",
        "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2},
    },
    "sluice": {"storage_capacity": "2GiB"},
}


@dataclass
class _Face:
    """This process's view of the TransferQueue-style cluster."""

    address: str
    conf: dict[str, Any]
    client: TransferQueueClient
    cluster: Cluster | None = None  # set in the process that started the services
    registry: Any = None  # the named Ray actor, in that process
    exported: bool = False  # this process set ENV_ADDRESS


_FACE: _Face | None = None


# -- init / close ------------------------------------------------------------------------


@overload
def init(conf: Mapping[str, Any], /) -> Any: ...


@overload
def init(*, conf: Mapping[str, Any] | None) -> Any: ...


@overload
def init(
    num_storage_units: int = 2,
    storage_capacity: int | str = "2GiB",
    *,
    max_staleness: int | None = None,
    consumer_batch_size: int = 64,
    staleness: StalenessConfig | None = None,
    lease_timeout: float = 300.0,
    grant_timeout: float = 600.0,
    stale_policy: Literal["drop", "keep", "requeue"] = "drop",
    samplers: tuple[str, ...] = (),
    metrics_port: int | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    backend: Literal["local", "ray"] = "local",
    ray_address: str | None = None,
    restore: str | os.PathLike | None = None,
    journal: str | os.PathLike | None = None,
) -> Cluster: ...


def init(*args: Any, **kwargs: Any) -> Any:
    """Start or attach to Sluice: TransferQueue's `init(conf)` and Sluice's `init(...)` in one name.

    Typed as two overloads: Sluice's keyword form (the parameters of `transfer_queue._cluster.init`)
    returns a `Cluster`; TransferQueue's `conf` form returns the merged config.

    - `init(conf)` / `init(conf=...)` with a mapping (TransferQueue's config): TransferQueue's
      semantics; returns the merged config (a `DictConfig` when given one).
    - `init()`: attaches to the TransferQueue-style cluster of this process, of
      `SLUICE_TQ_ADDRESS`, or of the Ray cluster this process is connected to, and returns None;
      when there is none, Sluice's embedded default (`Cluster`).
    - anything else (`num_storage_units=2, ...`): Sluice's `init`, returning a `Cluster`.

    Raises `SchemaError` for a config Sluice cannot serve (another storage backend, unknown
    `sluice:` keys) and whatever Sluice's `init` raises when starting services.
    """
    if "conf" in kwargs or (len(args) == 1 and not kwargs and (args[0] is None or isinstance(args[0], Mapping))):
        conf = kwargs.pop("conf") if "conf" in kwargs else args[0]
        if kwargs or (conf is not None and not isinstance(conf, Mapping)):
            raise SchemaError(
                f"init(conf) takes one mapping (TransferQueue's config), got {type(conf).__name__} and {sorted(kwargs)}"
            )
        return _tq_init(conf)
    if not args and not kwargs and _find() is not None:
        return _tq_init(None)
    from .._cluster import init as sluice_init

    return sluice_init(*args, **kwargs)


def _tq_init(conf: Mapping | None) -> Any:
    global _FACE
    found = _find()
    if found is not None:
        _FACE = found
        return None if conf is None else conf
    merged = _merge(_DEFAULTS, _plain(conf) if conf is not None else {})
    kwargs = _sluice_kwargs(merged)
    under_ray = _ray_connected()
    from .._cluster import init as sluice_init
    from .client import TransferQueueClient

    cluster = sluice_init(**kwargs, backend="ray" if under_ray else "local", host="auto" if under_ray else "127.0.0.1")
    merged["sluice"]["address"] = cluster.address
    if kwargs.get("metrics_port") is not None:
        host = cluster.address.rsplit(":", 1)[0].split("//", 1)[1]
        merged["metrics"]["endpoint"] = f"{host}:{kwargs['metrics_port']}"
    creds = cluster.client_credentials
    face = _Face(
        cluster.address,
        merged,
        TransferQueueClient(cluster.address, f"TransferQueueClient_{os.getpid()}", creds),
        cluster,
    )
    try:
        if under_ray:
            face.registry = _register_with_ray(cluster.address, merged, creds)
            if face.registry is None:  # another process registered first: use its cluster
                face.client.close()
                cluster.shutdown()
                _FACE = _find()
                return None if conf is None else conf
        else:
            os.environ[ENV_ADDRESS] = cluster.address
            os.environ[ENV_CONF] = json.dumps(merged)
            face.exported = True
    except BaseException:
        cluster.shutdown()
        raise
    _FACE = face
    if conf is not None and type(conf).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.create(merged)
    return merged


def close() -> None:
    """Close this process's client; in the process that started the cluster, stop it too."""
    global _FACE
    face, _FACE = _FACE, None
    if face is None:
        return
    face.client.close()
    if face.cluster is not None:
        if face.registry is not None and _ray_connected():
            import ray

            ray.kill(face.registry)
        if face.exported and os.environ.get(ENV_ADDRESS) == face.address:
            os.environ.pop(ENV_ADDRESS, None)
            os.environ.pop(ENV_CONF, None)
        face.cluster.shutdown()


def get_client() -> TransferQueueClient:
    """This process's `TransferQueueClient`, attaching to a running cluster if there is one.

    Raises `ClosedError` when no TransferQueue-style cluster was started or can be found.
    """
    return _face().client


def get_metrics_endpoint() -> str | None:
    """`host:port` of the controller's Prometheus exporter, or None when metrics are off."""
    face = _FACE or _find()
    if face is None:
        return None
    return face.conf.get("metrics", {}).get("endpoint")


def _face() -> _Face:
    global _FACE
    if _FACE is None:
        _FACE = _find()
    if _FACE is None:
        raise ClosedError("TransferQueue is not initialized: call tq.init(conf) first (in any process of the job)")
    return _FACE


# -- discovery ---------------------------------------------------------------------------


def _ray_connected() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


class _Registry:
    """A named Ray actor holding the cluster's address, config and client credentials (strings
    only: the credentials as their token, "" for a loopback cluster)."""

    def __init__(self, address: str, conf_json: str, credentials: str):
        self.address, self.conf_json, self.credentials = address, conf_json, credentials

    def get(self) -> tuple[str, str, str]:
        return self.address, self.conf_json, self.credentials


def _register_with_ray(address: str, conf: dict[str, Any], credentials: Credentials | None) -> Any:
    """The named registry actor for `address`; None if another process holds the name already."""
    import ray

    from .._ray_backend import _runtime_env

    # Ray's stubs type `ray.remote(**options)` as a decorator of functions only, and its
    # runtime_env as never None (Ray takes None for "no runtime_env")
    actor = cast(Any, ray.remote)(num_cpus=0, max_restarts=0, runtime_env=_runtime_env())(_Registry)
    try:
        handle = actor.options(name=RAY_NAME, namespace=RAY_NAMESPACE).remote(
            address, json.dumps(conf), credentials.token() if credentials else ""
        )
    except ValueError:  # "The name ... is already taken"
        return None
    ray.get(handle.get.remote())
    return handle


def _find() -> _Face | None:
    """The cluster to attach to: this process's, the environment's, or the Ray cluster's."""
    if _FACE is not None:
        return _FACE
    found = None
    if os.environ.get(ENV_ADDRESS):  # a local cluster: loopback, no credentials needed
        found = os.environ[ENV_ADDRESS], json.loads(os.environ.get(ENV_CONF) or "{}"), ""
    elif _ray_connected():
        import ray

        try:
            handle = ray.get_actor(RAY_NAME, namespace=RAY_NAMESPACE)
        except ValueError:
            return None
        address, conf_json, token = ray.get(handle.get.remote())
        found = address, json.loads(conf_json), token
    if found is None:
        return None
    from .client import TransferQueueClient

    address, conf, token = found
    creds = Credentials.from_token(token) if token else None
    return _Face(address, conf, TransferQueueClient(address, f"TransferQueueClient_{os.getpid()}", creds))


# -- config ------------------------------------------------------------------------------


def _plain(conf: Mapping) -> dict[Any, Any]:
    """`conf` as plain dicts, keys as the user's config has them (OmegaConf's may be ints or enums)."""
    if type(conf).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        plain = OmegaConf.to_container(conf, resolve=True)
        assert isinstance(plain, dict)  # the container of a mapping config is a dict
        return plain
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in conf.items()}


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: (_merge(v, {}) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


_STALENESS_KEYS = StalenessConfig.__struct_fields__
"""`sluice:` keys that make up a `StalenessConfig` (YAML cannot hold the object itself)."""


def _sluice_kwargs(conf: dict[str, Any]) -> dict[str, Any]:
    """Sluice `init` keywords for a merged TransferQueue config."""
    from .._cluster import init as sluice_init

    backend = conf["backend"]["storage_backend"]
    if backend != "SimpleStorage":
        raise SchemaError(
            f"storage backend {backend!r} is not available on Sluice; it serves TransferQueue's SimpleStorage "
            "(its own storage units). Set transfer_queue.backend.storage_backend=SimpleStorage"
        )
    extra = {k: v for k, v in (conf.get("sluice") or {}).items() if k != "address"}
    allowed = set(inspect.signature(sluice_init).parameters) - {"backend", "host", "ray_address", "staleness"}
    allowed |= set(_STALENESS_KEYS)
    unknown = sorted(set(extra) - allowed)
    if unknown:
        raise SchemaError(
            f"unknown key(s) {unknown} under transfer_queue.sluice; Sluice's init takes {sorted(allowed)}"
        )
    kwargs = {k: v for k, v in extra.items() if k not in _STALENESS_KEYS}
    if any(k in extra for k in _STALENESS_KEYS):
        kwargs["staleness"] = StalenessConfig(**{k: extra[k] for k in _STALENESS_KEYS if k in extra})
    kwargs.setdefault("num_storage_units", int(conf["backend"]["SimpleStorage"].get("num_data_storage_units") or 2))
    metrics = conf.get("metrics") or {}
    if metrics.get("enabled"):
        kwargs["metrics_port"] = int(metrics.get("port") or 0) or _free_port()
    return kwargs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# -- the KV API --------------------------------------------------------------------------


def _one_row(key: str, fields: Any) -> TensorDict:
    """`kv_put`'s fields for one key as a one-sample TensorDict (tensors unsqueezed)."""
    import torch
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    if isinstance(fields, TensorDict):
        return fields
    if not isinstance(fields, Mapping):
        raise SchemaError(
            f"kv_put's fields for key {key!r} must be a dict or a TensorDict, got {type(fields).__name__}"
        )
    batch = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise SchemaError(f"field {name!r} of key {key!r} is a nested tensor; use kv_batch_put for batches")
            batch[name] = value.unsqueeze(0)
        else:
            batch[name] = NonTensorStack(NonTensorData(value), stack_dim=0)
    return TensorDict(batch, batch_size=[1])


def _check_put(keys: Sequence[str], fields: Any, tags: Sequence[dict] | None, data_parser: Any) -> None:
    if fields is None and tags is None:
        raise SchemaError("kv put needs fields or tags (or both)")
    from .client import _no_parser

    _no_parser(data_parser)
    if fields is not None and int(fields.batch_size[0]) != len(keys):
        raise SchemaError(f"{len(keys)} keys for fields of batch size {int(fields.batch_size[0])}")
    if tags is not None and len(tags) != len(keys):
        raise SchemaError(f"{len(keys)} keys for {len(tags)} tags")


@overload
def _listed(value: str | Sequence[str]) -> list[str]: ...
@overload
def _listed(value: None) -> None: ...
@overload
def _listed(value: str | Sequence[str] | None) -> list[str] | None: ...
def _listed(value: str | Sequence[str] | None) -> list[str] | None:
    return [value] if isinstance(value, str) else (None if value is None else list(value))


def _by_meta(meta: KVBatchMeta, select_fields: str | Sequence[str] | None) -> tuple[str, list[str] | None]:
    """The partition and the fields to read of `meta`'s keys."""
    if meta.partition_id is None:
        raise SchemaError("the KVBatchMeta has no partition_id")
    fields = _listed(select_fields)
    if fields is None:
        return meta.partition_id, meta.fields
    if meta.fields is None or any(f not in meta.fields for f in fields):
        raise SchemaError(f"select_fields {fields} are not all among the KVBatchMeta's fields {meta.fields}")
    return meta.partition_id, fields


def kv_put(
    key: str, partition_id: str, fields: Any = None, tag: dict | None = None, data_parser: Any = None
) -> KVBatchMeta:
    """Write one key: `fields` (a dict of per-sample values or a one-row TensorDict) and/or merge
    `tag` into its tags. Returns its `KVBatchMeta`. `SchemaError` when both are None."""
    rows = None if fields is None else _one_row(key, fields)
    return kv_batch_put([key], partition_id, rows, None if tag is None else [tag], data_parser)


def kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """Write `fields` (batch size = len(keys)) for `keys`, creating missing keys, then merge `tags`.

    Tags become visible only after the data is written. Raises `SchemaError` for mismatched
    lengths, both `fields` and `tags` None, or data contradicting the partition's fields.
    """
    _check_put(keys, fields, tags, data_parser)
    return get_client().kv_batch_put(list(keys), partition_id, fields, tags)


def kv_batch_get(keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None) -> TensorDict:
    """The fields of `keys` (all fields ready for every key, or `select_fields`) as a TensorDict.

    A selected field written for none of the keys is left out of the result, as TransferQueue
    does (verl selects its standard fields whether or not this run produces them); Sluice's own
    `get_data` stays strict. Raises `SchemaError` (a `ValueError`) for unknown keys or a field
    written for some of the keys but not all.
    """
    return get_client().kv_batch_get(_listed(keys), partition_id, _listed(select_fields))


def kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> TensorDict:
    """`kv_batch_get` of a `KVBatchMeta`'s keys and fields (`select_fields` must be among them)."""
    return get_client().kv_batch_get(meta.keys, *_by_meta(meta, select_fields))


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    """`{partition: {key: tags}}` for one partition (empty if it has no keys) or all partitions."""
    return get_client().kv_list(partition_id)


def kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """Delete `keys` and their data; unknown keys are ignored."""
    get_client().kv_clear(_listed(keys), partition_id)


async def async_kv_put(
    key: str, partition_id: str, fields: Any = None, tag: dict | None = None, data_parser: Any = None
) -> KVBatchMeta:
    """`kv_put` for asyncio code."""
    rows = None if fields is None else _one_row(key, fields)
    return await async_kv_batch_put([key], partition_id, rows, None if tag is None else [tag], data_parser)


async def async_kv_batch_put(
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict] | None = None,
    data_parser: Any = None,
) -> KVBatchMeta:
    """`kv_batch_put` for asyncio code."""
    _check_put(keys, fields, tags, data_parser)
    return await get_client().async_kv_batch_put(list(keys), partition_id, fields, tags)


async def async_kv_batch_get(
    keys: list[str] | str, partition_id: str, select_fields: list[str] | str | None = None
) -> TensorDict:
    """`kv_batch_get` for asyncio code."""
    return await get_client().async_kv_batch_get(_listed(keys), partition_id, _listed(select_fields))


async def async_kv_batch_get_by_meta(meta: KVBatchMeta, select_fields: list[str] | str | None = None) -> TensorDict:
    """`kv_batch_get_by_meta` for asyncio code."""
    return await get_client().async_kv_batch_get(meta.keys, *_by_meta(meta, select_fields))


async def async_kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict]]:
    """`kv_list` for asyncio code."""
    return await get_client().async_kv_list(partition_id)


async def async_kv_clear(keys: list[str] | str, partition_id: str) -> None:
    """`kv_clear` for asyncio code."""
    await get_client().async_kv_clear(_listed(keys), partition_id)
