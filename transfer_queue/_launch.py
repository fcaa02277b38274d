"""Running services as processes: the command lines every backend starts, spawning one with the
cluster's secret in its environment, reading the address it announces, stopping it, and
sweeping a cluster's shared memory. `Backend` is what a `Cluster` holds to run its services;
`LocalProcesses`, the embedded default, runs them as children of this process (`RayActors`
in `_ray_backend` runs the same command lines from Ray actors).
"""

from __future__ import annotations

import glob
import os
import select
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import msgspec

from .host import die_with_parent, shm_prefix, stop_processes
from .wire.auth import CREDENTIALS_ENV
from .wire.errors import SchemaError, ServiceError
from .wire.messages import ClusterConfig

__all__ = [
    "Backend",
    "LocalProcesses",
    "SECRET_ENV",
    "START_TIMEOUT",
    "ROOT",
    "controller_command",
    "storage_command",
    "spawn",
    "address_of",
    "remove_shm",
]

SECRET_ENV = "SLUICE_SECRET"
"""Environment variable that hands the cluster secret to service processes (never argv: `ps` shows it)."""

START_TIMEOUT = 60.0
"""Seconds a service may take to announce its address."""
ROOT = str(Path(__file__).resolve().parent.parent)
"""The checkout that holds `transfer_queue`, `controllers` and `storage` (put on the services' path)."""


class Backend(ABC):
    """Where a cluster's services run: started once, asked whether they live, stopped once."""

    services: list[dict[str, Any]]
    """Where each service landed: `{"service", "address", "pid", ...}`, the controller first."""

    @abstractmethod
    def start(self, config: ClusterConfig, cluster_id: str, port: int, secret: str, credentials: str) -> str:
        """Start the controller, then `config.num_storage_units` storage units registered with it;
        return the controller's address. Stops what it started before raising.

        Raises:
            ServiceError: a service did not start.
        """

    @abstractmethod
    def alive(self) -> bool:
        """Whether every service is still running."""

    @abstractmethod
    def stop(self, timeout: float) -> None:
        """Stop every service (SIGTERM, SIGKILL after `timeout` seconds); safe to call twice."""

    def controller_alive(self) -> bool:
        """Whether the controller is still running."""
        return self.alive()

    def restart_controller(
        self, config: ClusterConfig, cluster_id: str, port: int, secret: str, credentials: str
    ) -> None:
        """Start the controller again on `port` after it died (it replays `config.journal`).

        Raises:
            SchemaError: this backend cannot restart its controller.
            ServiceError: the controller did not start.
        """
        raise SchemaError(f"{type(self).__name__} cannot restart a controller; the local backend can")


class LocalProcesses(Backend):
    """The embedded backend: every service a child process of this one, ended with it."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.services = []

    def start(self, config: ClusterConfig, cluster_id: str, port: int, secret: str, credentials: str) -> str:
        try:
            ctl = spawn(controller_command(config, cluster_id, port), secret, credentials)
            self.procs.append(ctl)
            address = address_of(ctl, "SLUICE_CONTROLLER")
            per_unit = config.storage_capacity // config.num_storage_units
            units = [
                spawn(storage_command(unit_id, per_unit, cluster_id, address, config.host), secret, credentials)
                for unit_id in range(config.num_storage_units)
            ]
            self.procs.extend(units)
            addresses = [address, *(address_of(unit, "SLUICE_STORAGE") for unit in units)]
        except BaseException:
            self.stop(10.0)
            raise
        names = ["controller", *(f"storage-{k}" for k in range(config.num_storage_units))]
        self.services = [{"service": n, "address": a, "pid": p.pid} for n, a, p in zip(names, addresses, self.procs)]
        return address

    def alive(self) -> bool:
        return bool(self.procs) and all(p.poll() is None for p in self.procs)

    def controller_alive(self) -> bool:
        return bool(self.procs) and self.procs[0].poll() is None

    def restart_controller(
        self, config: ClusterConfig, cluster_id: str, port: int, secret: str, credentials: str
    ) -> None:
        old = self.procs[0]
        if old.stdout is not None:
            old.stdout.close()
        self.procs[0] = spawn(controller_command(config, cluster_id, port), secret, credentials)
        self.services[0]["pid"] = self.procs[0].pid
        address_of(self.procs[0], "SLUICE_CONTROLLER")

    def stop(self, timeout: float) -> None:
        procs, self.procs = self.procs, []
        stop_processes(procs, timeout)


def remove_shm(cluster_id: str) -> None:
    """Unlink this machine's leftover shared-memory files of `cluster_id` (units killed mid-way)."""
    for path in glob.glob(shm_prefix(cluster_id) + "*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def controller_command(config: ClusterConfig, cluster_id: str, port: int) -> list[str]:
    """Arguments of `python` that run the controller; every backend starts it this way."""
    return [
        "-m",
        "controllers",
        "--config",
        msgspec.json.encode(config).decode(),
        "--cluster-id",
        cluster_id,
        "--port",
        str(port),
    ]


def storage_command(unit_id: int, capacity: int, cluster_id: str, controller: str | None, host: str) -> list[str]:
    """Arguments of `python` that run storage unit `unit_id`, registering with `controller` (None:
    with no controller, a unit on its own as the storage tests drive it)."""
    args = ["-m", "storage", "--unit-id", str(unit_id), "--capacity", str(capacity), "--cluster-id", cluster_id]
    if controller is not None:
        args += ["--controller", controller]
    return [*args, "--host", host]


def spawn(args: list[str], secret: str, credentials: str = "") -> subprocess.Popen:
    """Start `python args...` with the cluster secret and credentials (a token) in its environment.

    It runs in a session of its own, so a terminal's Ctrl-C (sent to its whole foreground process
    group) reaches only the process that started it, which stops it (`stop_processes`) once it
    is done with it: its clients still find the services while they close. It ends with that
    process all the same (`host.die_with_parent`)."""
    env = dict(os.environ)
    env[SECRET_ENV] = secret
    env.pop(CREDENTIALS_ENV, None)
    if credentials:
        env[CREDENTIALS_ENV] = credentials
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        env=env,
        preexec_fn=die_with_parent,
        start_new_session=True,
        text=True,
    )


def address_of(proc: subprocess.Popen, tag: str) -> str:
    """Wait for the `TAG address` line a service prints once it serves."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert proc.stdout is not None  # started with stdout=PIPE
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
    command = " ".join(map(str, proc.args[1:4])) if isinstance(proc.args, (list, tuple)) else str(proc.args)
    raise ServiceError(f"`{command} ...` did not start (exit code {proc.poll()}); see its stderr")
