"""Starting a cluster: the embedded default runs the controller and each storage unit as a local
process (`python -m controllers`, `python -m storage`); nothing is imported across services.
`backend="ray"` (`_ray_backend`) starts the same command lines, built here, inside Ray actors.
"""

from __future__ import annotations

import atexit
import ctypes
import glob
import os
import secrets
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from ._auth import CREDENTIALS_ENV, Credentials, is_loopback
from ._errors import ServiceError, SchemaError
from ._messages import ClusterConfig
from ._sizes import parse_bytes
from ._staleness import StalenessConfig

if TYPE_CHECKING:  # imported on use: launching services (also from Ray actors) needs no torch
    from ._client import Client

__all__ = ["Cluster", "init", "connect", "parse_bytes", "SECRET_ENV"]

SECRET_ENV = "SLUICE_SECRET"
"""Environment variable that hands the cluster secret to service processes (never argv: `ps` shows it)."""

_START_TIMEOUT = 60.0
_ROOT = str(Path(__file__).resolve().parent.parent)


def _find_prctl() -> Any:
    """libc's `prctl`, or None where there is no glibc."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()
"""Looked up before any fork: dlopen/dlsym in the child of a threaded parent (a Ray worker) can deadlock."""


def _die_with_parent() -> None:
    """Child processes end when the process that started them dies (Linux prctl)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Cluster:
    """A running set of Sluice services. `address` is the controller's ZeroMQ endpoint."""

    def __init__(
        self, address: str, config: ClusterConfig, cluster_id: str, procs: list[subprocess.Popen], secret: str = "",
        credentials: Credentials | None = None,
    ):
        self.address = address
        self.config = config
        self.cluster_id = cluster_id
        self.secret = secret
        """What a storage unit must show to register (set `SLUICE_SECRET` to it for a unit you restart)."""
        self.credentials = credentials
        """The services' CurveZMQ keys when bound beyond loopback (else None); give workers
        `client_credentials`."""
        self._procs = procs
        atexit.register(self.shutdown)

    @property
    def client_credentials(self) -> Credentials | None:
        """What workers need to connect (set `SLUICE_CREDENTIALS` to its `token()`), or None on loopback."""
        return None if self.credentials is None else self.credentials.for_clients()

    def connect(self, use_shm: bool | None = None) -> Client:
        """A new blocking client of this cluster (with its client credentials, if it has any)."""
        from ._client import Client

        return Client(self.address, use_shm, self.client_credentials)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every service and remove its shared memory; safe to call twice."""
        procs, self._procs = self._procs, []
        _stop_processes(procs, timeout)
        _remove_shm(self.cluster_id)
        atexit.unregister(self.shutdown)

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    @property
    def controller_alive(self) -> bool:
        return bool(self._procs) and self._procs[0].poll() is None

    def restart_controller(self) -> None:
        """Start the controller again on its port after its process died; it replays the
        cluster's journal, and the storage units (still serving) are its units again.

        Raises `SchemaError` without a journal (a fresh controller would know no sample) or
        while the controller still runs; `ServiceError` if it does not start."""
        if not self.config.journal:
            raise SchemaError("restart_controller needs a cluster started with journal=PATH")
        if self.controller_alive:
            raise SchemaError("the controller is still running; restart it only after it died")
        old = self._procs[0]
        if old.stdout is not None:
            old.stdout.close()
        port = int(self.address.rsplit(":", 1)[1])
        token = "" if self.credentials is None else self.credentials.token()
        ctl = _spawn(_controller_command(self.config, self.cluster_id, port), self.secret, token)
        self._procs[0] = ctl
        _address_of(ctl, "SLUICE_CONTROLLER")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every service, wait up to `timeout` in all, then SIGKILL the ones still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _remove_shm(cluster_id: str) -> None:
    """Unlink this machine's leftover shared-memory files of `cluster_id` (units killed mid-way)."""
    for path in glob.glob(f"/dev/shm/sluice-{cluster_id}-*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _controller_command(config: ClusterConfig, cluster_id: str, port: int) -> list[str]:
    """Arguments of `python` that run the controller; every backend starts it this way."""
    return ["-m", "controllers", "--config", msgspec.json.encode(config).decode(),
            "--cluster-id", cluster_id, "--port", str(port)]


def _storage_command(unit_id: int, capacity: int, cluster_id: str, controller: str, host: str) -> list[str]:
    """Arguments of `python` that run storage unit `unit_id`, registering with `controller`."""
    return ["-m", "storage", "--unit-id", str(unit_id), "--capacity", str(capacity),
            "--cluster-id", cluster_id, "--controller", controller, "--host", host]


def _spawn(args: list[str], secret: str, credentials: str = "") -> subprocess.Popen:
    """Start `python args...` with the cluster secret and credentials (a token) in its environment."""
    env = dict(os.environ)
    env[SECRET_ENV] = secret
    env.pop(CREDENTIALS_ENV, None)
    if credentials:
        env[CREDENTIALS_ENV] = credentials
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, env.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, env=env, preexec_fn=_die_with_parent, text=True
    )


def _address_of(proc: subprocess.Popen, tag: str) -> str:
    """Wait for the `TAG address` line a service prints once it serves."""
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(tag + " "):
                return line.split(None, 1)[1].strip()
            if not line:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise ServiceError(f"`{' '.join(proc.args[1:4])} ...` did not start (exit code {proc.poll()}); see its stderr")


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
    `staleness` instead. Services bind to `host` (loopback by default).

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
    if num_storage_units <= 0:
        raise SchemaError(f"num_storage_units must be > 0, got {num_storage_units}")
    config = ClusterConfig(
        num_storage_units=num_storage_units,
        storage_capacity=parse_bytes(storage_capacity),
        max_staleness=staleness.max_staleness,
        consumer_batch_size=staleness.consumer_batch_size,
        budget_staleness=staleness.budget_staleness,
        partial_rollout=staleness.partial_rollout,
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
    token = "" if credentials is None else credentials.token()
    if backend == "ray":
        from ._ray_backend import start_ray_cluster

        return _restored(start_ray_cluster(config, cluster_id, port, ray_address, secret, credentials), restore)
    procs: list[subprocess.Popen] = []
    try:
        ctl = _spawn(_controller_command(config, cluster_id, port), secret, token)
        procs.append(ctl)
        address = _address_of(ctl, "SLUICE_CONTROLLER")
        per_unit = config.storage_capacity // num_storage_units
        units = [
            _spawn(_storage_command(unit_id, per_unit, cluster_id, address, host), secret, token)
            for unit_id in range(num_storage_units)
        ]
        procs.extend(units)
        for unit in units:
            _address_of(unit, "SLUICE_STORAGE")
    except BaseException:
        Cluster("", config, cluster_id, procs).shutdown()
        raise
    return _restored(Cluster(address, config, cluster_id, procs, secret, credentials), restore)


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
