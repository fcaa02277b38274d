"""`tq.init(backend="ray")`: the same services, started from Ray actors spread over a Ray cluster.

`RayActors` is the `Backend` a `Cluster` holds then. Each service (the controller, every storage
unit) gets one `ServiceActor`. The actor runs on some node and starts there the very process the
embedded backend starts locally (the command lines and the launch helpers live in `_launch`), reads its `SLUICE_* address` line and hands
the address back. From then on Ray is out of the data path: clients on any node talk to the
services over Sluice's own ZeroMQ wire protocol, exactly as with the embedded backend. Only
strings and ints cross Ray's actor calls; nothing of Sluice's is pickled onto its sockets.

Placement: the controller actor goes where Ray's default policy puts it (usually the driver's
node); storage-unit actors go round-robin over the nodes alive at `init`, one per unit, pinned
by node affinity (Ray's "SPREAD" strategy, and soft affinity, left actors that reserve no
resources on one node of a two-node cluster). Actors reserve
no CPUs (`num_cpus=0`): they only hold a process handle, and the services are I/O processes
outside Ray's accounting, so a cluster fits even on a 2-core node.

Lifetime: the actors are owned by the process that called `init`; `Cluster.shutdown()` stops
each service (SIGTERM, then SIGKILL), sweeps leftover `/dev/shm/sluice-<id>-*` files on every
node it used (through a one-off task pinned to the node where an actor has died) and kills the
actors. A service never outlives its actor: the launcher sets PR_SET_PDEATHSIG, and Ray kills
a dead worker's children.

Addresses: services bind `host`. The default, loopback, only serves clients on the same node;
for several nodes pass `host="auto"`, which each actor resolves to its node's IP
(`ray.util.get_node_ip_address()`), or an address every node can reach. `"0.0.0.0"` binds all
interfaces but is then advertised as `tcp://0.0.0.0:PORT`, which other nodes cannot dial.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ._launch import (
    ROOT,
    START_TIMEOUT,
    Backend,
    address_of,
    controller_command,
    remove_shm,
    spawn,
    storage_command,
)
from .host import stop_processes
from .wire.errors import ServiceError
from .wire.messages import ClusterConfig

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["RayActors", "ServiceActor"]

_CALL_GRACE = 30.0
"""Seconds added to a service's own start/stop limit for Ray to place the actor and answer."""


def _ray() -> ModuleType:
    """The `ray` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            'tq.init(backend="ray") needs Ray: pip install "sluice-rl[ray]" (or "ray[default]>=2.9")'
        ) from exc
    return ray


def _node_host(host: str) -> str:
    """`host`, with "auto" replaced by the IP of the node this runs on."""
    return _ray().util.get_node_ip_address() if host == "auto" else host


class ServiceActor:
    """Runs one Sluice service process on the node Ray placed this actor on.

    A plain class, made a Ray actor by `_actor_class()`; its methods take and return only
    strings and ints. Ray runs a default actor's methods on the worker's main thread, the one
    that spawns the process, so the process's parent-death signal fires when the actor dies.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def start_controller(self, config_json: str, cluster_id: str, port: int, secret: str, credentials: str) -> str:
        """Start the controller with `config_json` (a `ClusterConfig`); return its address."""
        config = msgspec.json.decode(config_json, type=ClusterConfig)
        config = msgspec.structs.replace(config, host=_node_host(config.host))
        return self._start(controller_command(config, cluster_id, port), "SLUICE_CONTROLLER", secret, credentials)

    def start_storage(
        self, unit_id: int, capacity: int, cluster_id: str, controller: str, host: str, secret: str, credentials: str
    ) -> str:
        """Start storage unit `unit_id`, registered with `controller`; return its address."""
        return self._start(
            storage_command(unit_id, capacity, cluster_id, controller, _node_host(host)),
            "SLUICE_STORAGE",
            secret,
            credentials,
        )

    def _start(self, args: list[str], tag: str, secret: str, credentials: str) -> str:
        if self._proc is not None:
            raise ServiceError("this actor already runs a service; start one actor per service")
        self._proc = spawn(args, secret, credentials)
        return address_of(self._proc, tag)

    def where(self) -> dict[str, Any]:
        """`{"node_id": str, "node_ip": str, "pid": int}`: where the service runs (pid 0 once stopped)."""
        ray = _ray()
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "pid": self._proc.pid if self._proc else 0,
        }

    def alive(self) -> bool:
        """Whether the service process is still running."""
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout: float) -> None:
        """SIGTERM the service, SIGKILL it after `timeout` seconds; safe to call twice."""
        proc, self._proc = self._proc, None
        if proc is not None:
            stop_processes([proc], timeout)

    def sweep(self, cluster_id: str) -> None:
        """Remove `cluster_id`'s leftover shared-memory files on this node."""
        remove_shm(cluster_id)


def _runtime_env() -> dict[str, Any] | None:
    """What Ray's workers need to import Sluice: nothing when it is installed (`pip install`,
    also `-e`); run from an uninstalled checkout, that checkout on PYTHONPATH, as `_spawn` gives
    the services. (A runtime_env costs a fresh worker per actor, ~2 s more per start here.)"""
    try:
        importlib.metadata.distribution("sluice-rl")
    except importlib.metadata.PackageNotFoundError:
        return {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}}
    return None


@functools.cache
def _actor_class() -> Any:
    """`ServiceActor` as a Ray actor class, made once per process (Ray exports each class once)."""
    return _ray().remote(num_cpus=0, max_restarts=0, runtime_env=_runtime_env())(ServiceActor)


def _gather(ray: ModuleType, refs: list[Any], timeout: float) -> list[Any]:
    """`ray.get(refs)`, with Ray's errors turned into `ServiceError`."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.RayError as exc:
        raise ServiceError(
            f"a Sluice service under Ray failed: {exc} (its stderr is in the Ray worker logs, "
            "e.g. /tmp/ray/session_latest/logs on its node)"
        ) from exc


def _answered(ray: ModuleType, refs: list[Any], timeout: float) -> list[bool]:
    """Per call, whether it returned within `timeout` seconds in all (its actor may have died)."""
    deadline = time.monotonic() + timeout
    answered = []
    for ref in refs:
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            answered.append(True)
        except ray.exceptions.RayError:
            answered.append(False)
    return answered


def _node_task(ray: ModuleType, fn: Any, node_id: str) -> Any:
    """`fn` as a Ray task that runs only on node `node_id`."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return ray.remote(fn).options(num_cpus=0, scheduling_strategy=strategy, runtime_env=_runtime_env())


def _round_robin(ray: ModuleType, n: int) -> list[Any]:
    """One node-affinity strategy per unit, cycling over the alive nodes in a fixed order."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))
    if not nodes:
        return ["SPREAD"] * n
    return [NodeAffinitySchedulingStrategy(nodes[k % len(nodes)], soft=False) for k in range(n)]


class RayActors(Backend):
    """Services run by Ray actors: the controller's where Ray's default policy puts it, storage
    units round-robin over the nodes alive at start. `services` entries add `node_id` and `node_ip`."""

    def __init__(self, ray_address: str | None = None) -> None:
        self.ray_address = ray_address
        self.actors: list[Any] = []
        self.services = []
        self.cluster_id = ""
        self._owns_ray = False

    def start(self, config: ClusterConfig, cluster_id: str, port: int, secret: str, credentials: str) -> str:
        """Start the controller, then the storage units, each from its own Ray actor.

        Joins the Ray session this process already has; otherwise calls `ray.init(address=ray_address)`
        (None: a new local Ray, or the one `RAY_ADDRESS` names) and shuts it down again in `stop`.
        """
        ray = _ray()
        self.cluster_id = cluster_id
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=self.ray_address)
        actor_class = _actor_class()
        try:
            controller = actor_class.options(name=f"sluice-{cluster_id}-controller").remote()
            self.actors.append(controller)
            ref = controller.start_controller.remote(
                msgspec.json.encode(config).decode(), cluster_id, port, secret, credentials
            )
            address = _gather(ray, [ref], START_TIMEOUT + _CALL_GRACE)[0]
            per_unit = config.storage_capacity // config.num_storage_units
            units = [
                actor_class.options(name=f"sluice-{cluster_id}-unit-{k}", scheduling_strategy=strategy).remote()
                for k, strategy in enumerate(_round_robin(ray, config.num_storage_units))
            ]
            self.actors.extend(units)
            refs = [
                u.start_storage.remote(k, per_unit, cluster_id, address, config.host, secret, credentials)
                for k, u in enumerate(units)
            ]
            addresses = [address, *_gather(ray, refs, START_TIMEOUT + _CALL_GRACE)]
            places = _gather(ray, [a.where.remote() for a in self.actors], _CALL_GRACE)
        except BaseException:
            self.stop(10.0)
            raise
        names = ["controller", *(f"storage-{k}" for k in range(config.num_storage_units))]
        self.services = [{"service": n, "address": a, **p} for n, a, p in zip(names, addresses, places)]
        return address

    def alive(self) -> bool:
        """Whether every service process is still running (asks each actor)."""
        ray = _ray()
        if not self.actors or not ray.is_initialized():
            return False
        try:
            return all(_gather(ray, [a.alive.remote() for a in self.actors], _CALL_GRACE))
        except ServiceError:
            return False

    def stop(self, timeout: float) -> None:
        """Stop every service, sweep its nodes' shared memory, kill the actors; safe to call twice.

        Calls `ray.shutdown()` only when `start` started Ray itself.
        """
        actors, self.actors = self.actors, []
        ray = _ray()
        if actors and ray.is_initialized():
            stopped = _answered(ray, [a.stop.remote(timeout) for a in actors], timeout + _CALL_GRACE)
            refs = [a.sweep.remote(self.cluster_id) for a, ok in zip(actors, stopped) if ok]
            nodes = [s["node_id"] for s in self.services]
            orphans = {n for n, ok in zip(nodes, stopped) if not ok} - {n for n, ok in zip(nodes, stopped) if ok}
            refs += [_node_task(ray, remove_shm, n).remote(self.cluster_id) for n in orphans]
            _answered(ray, refs, _CALL_GRACE)
            for actor in actors:
                ray.kill(actor)
        if self._owns_ray and ray.is_initialized():
            self._owns_ray = False
            ray.shutdown()
