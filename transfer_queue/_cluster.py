"""Starting a cluster: `init` builds the cluster's config and hands it to a backend, the embedded
default (`_launch.LocalProcesses`: the controller and each storage unit a local process,
`python -m controllers`, `python -m storage`) or `backend="ray"` (`_ray_backend.RayActors`: the
same command lines inside Ray actors). `Cluster` holds that backend; nothing is imported across
services.
"""

from __future__ import annotations

import atexit
import os
import secrets
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ._launch import SECRET_ENV, Backend, LocalProcesses, remove_shm
from .wire.auth import Credentials, is_loopback
from .wire.errors import SchemaError
from .wire.messages import ClusterConfig
from .wire.sizes import parse_bytes
from .wire.staleness import StalenessConfig

if TYPE_CHECKING:  # imported on use: launching services (also from Ray actors) needs no torch
    from ._client import Client

__all__ = ["Cluster", "init", "connect", "parse_bytes", "SECRET_ENV"]


class Cluster:
    """A running set of Sluice services. `address` is the controller's ZeroMQ endpoint."""

    def __init__(
        self,
        address: str,
        config: ClusterConfig,
        cluster_id: str,
        backend: Backend,
        secret: str = "",
        credentials: Credentials | None = None,
    ):
        self.address = address
        self.config = config
        self.cluster_id = cluster_id
        self.backend = backend
        """What runs the services: `LocalProcesses` (embedded) or `RayActors` (`backend="ray"`)."""
        self.secret = secret
        """What a storage unit must show to register (set `SLUICE_SECRET` to it for a unit you restart)."""
        self.credentials = credentials
        """The services' CurveZMQ keys when bound beyond loopback (else None); give workers
        `client_credentials`."""
        atexit.register(self.shutdown)

    @property
    def services(self) -> list[dict[str, Any]]:
        """Where each service runs: `{"service", "address", "pid"}` (Ray adds `node_id`,
        `node_ip`), the controller first, then `storage-0`, `storage-1`, ..."""
        return self.backend.services

    @property
    def client_credentials(self) -> Credentials | None:
        """What workers need to connect (set `SLUICE_CREDENTIALS` to its `token()`), or None on loopback."""
        return None if self.credentials is None else self.credentials.for_clients()

    def connect(self, use_shm: bool | None = None) -> Client:
        """A new blocking client of this cluster (with its client credentials, if it has any)."""
        from ._client import Client

        return Client(self.address, use_shm, self.client_credentials)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every service and remove this machine's shared memory of the cluster; safe to call twice."""
        self.backend.stop(timeout)
        remove_shm(self.cluster_id)
        atexit.unregister(self.shutdown)

    @property
    def alive(self) -> bool:
        """Whether every service is still running."""
        return self.backend.alive()

    @property
    def controller_alive(self) -> bool:
        """Whether the controller is still running."""
        return self.backend.controller_alive()

    def restart_controller(self) -> None:
        """Start the controller again on its port after its process died; it replays the
        cluster's journal, and the storage units (still serving) are its units again.

        Raises `SchemaError` without a journal (a fresh controller would know no sample), while
        the controller still runs, or on a backend that cannot restart it (Ray); `ServiceError`
        if it does not start."""
        if not self.config.journal:
            raise SchemaError("restart_controller needs a cluster started with journal=PATH")
        if self.controller_alive:
            raise SchemaError("the controller is still running; restart it only after it died")
        port = int(self.address.rsplit(":", 1)[1])
        token = "" if self.credentials is None else self.credentials.token()
        self.backend.restart_controller(self.config, self.cluster_id, port, self.secret, token)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


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
) -> Cluster:
    """Start a controller and `num_storage_units` storage units as local processes.

    `storage_capacity` is the total across units. `max_staleness` (η) bounds how many versions
    a consumed sample may lag; `consumer_batch_size` is the trainer's samples per step, used by
    admission control; or pass a `StalenessConfig` (e.g. `StalenessConfig.from_verl(...)`) as
    `staleness` instead. Admission's consumer batch grows to what the consumers really take per
    version, so a smaller setting cannot starve them; `StalenessConfig(follow_consumers=False)`
    pins it (see `controllers/admission.py`). Services bind to `host` (loopback by default).

    `backend="ray"` runs the same processes from Ray actors spread over the Ray cluster's nodes
    (it joins the running Ray session, or calls `ray.init(address=ray_address)`); pass
    `host="auto"` so each service binds and advertises its node's IP. See `_ray_backend`.

    `restore` is a directory written by `client.save_checkpoint`: its samples, consumer progress
    and version are put into the new cluster (with any number of storage units) before this
    returns.

    `journal` is a file where the controller records every change before answering it; a
    controller restarted with the same journal (same port and cluster id; the storage units keep
    serving meanwhile) loses no acked put (see `controllers/journal.py`).
    """
    if staleness is None:
        staleness = StalenessConfig(consumer_batch_size, max_staleness)
    if backend not in ("local", "ray"):
        raise SchemaError(f"unknown backend {backend!r}; use 'local' (processes on this machine) or 'ray'")
    if host == "auto" and backend != "ray":
        raise SchemaError("host='auto' (each node's IP) needs backend='ray'; the local backend binds an explicit host")
    config = ClusterConfig(
        **msgspec.structs.asdict(staleness),
        num_storage_units=num_storage_units,
        storage_capacity=parse_bytes(storage_capacity),
        lease_timeout=lease_timeout,
        grant_timeout=grant_timeout,
        stale_policy=stale_policy,
        samplers=tuple(samplers),
        metrics_port=metrics_port,
        host=host,
        journal=None if journal is None else os.path.abspath(journal),
    )
    cluster_id = uuid.uuid4().hex[:12]
    secret = secrets.token_hex(16)
    credentials = None if is_loopback(host) else Credentials.generate()
    if backend == "ray":
        from ._ray_backend import RayActors

        runner: Backend = RayActors(ray_address)
    else:
        runner = LocalProcesses()
    try:
        address = runner.start(config, cluster_id, port, secret, "" if credentials is None else credentials.token())
    except BaseException:
        remove_shm(cluster_id)  # what units stopped mid-start left behind
        raise
    return _restored(Cluster(address, config, cluster_id, runner, secret, credentials), restore)


def _restored(cluster: Cluster, checkpoint: str | os.PathLike | None) -> Cluster:
    """`cluster`, with `checkpoint` restored into it (shut down again if that fails)."""
    if checkpoint is None:
        return cluster
    try:
        with cluster.connect() as client:
            client.restore_checkpoint(checkpoint)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def connect(address: str, use_shm: bool | None = None, credentials: Credentials | None = None) -> Client:
    """A blocking client of the cluster whose controller listens at `address`.

    A cluster bound beyond loopback admits only clients with its `credentials` (default: the
    `SLUICE_CREDENTIALS` environment variable, which `sluice serve` tells you to set).

    `use_shm=None` reads and writes co-located storage units through their shared-memory
    arenas (one memcpy) and the others over TCP; False forces TCP frames everywhere.
    """
    from ._client import Client

    return Client(address, use_shm, credentials)
