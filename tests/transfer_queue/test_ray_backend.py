"""`tq.init(backend="ray")` on a real local Ray cluster: services launched by Ray actors, data
over Sluice's own sockets, and a shutdown that leaves no process, shared memory or actor behind."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import eventually, put_anew
from transfer_queue import _cluster

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ray_session():
    """A small local Ray the test owns (2 CPUs, 200 MB object store, no dashboard)."""
    if ray.is_initialized():
        pytest.skip("another Ray session is already running in this process")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 2**20)
    yield
    ray.shutdown()


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _assert_gone(cluster) -> None:
    assert not cluster.alive
    assert not glob.glob(f"/dev/shm/sluice-{cluster.cluster_id}-*")
    assert not any(_running(s["pid"]) for s in cluster.services)
    for name in ("controller", "unit-0", "unit-1"):
        with pytest.raises(ValueError):
            ray.get_actor(f"sluice-{cluster.cluster_id}-{name}")
    assert ray.is_initialized(), "init joined the test's Ray session, so shutdown must leave it running"


def test_round_trip_through_ray_launched_services(ray_session):
    cluster = tq.init(backend="ray", num_storage_units=2, storage_capacity="64MiB", max_staleness=1)
    try:
        assert isinstance(cluster, tq.Cluster) and cluster.alive
        assert cluster.address.startswith("tcp://127.0.0.1:"), "loopback unless told otherwise"
        assert [s["service"] for s in cluster.services] == ["controller", "storage-0", "storage-1"]
        for service in cluster.services:  # started by the actors' workers, not by this process
            assert _running(service["pid"]) and _parent(service["pid"]) != os.getpid()

        with tq.connect(cluster.address, use_shm=False) as client:
            status = client.status()
            assert sorted(status["units"]) == ["0", "1"]
            assert {u["address"] for u in status["units"].values()} == {s["address"] for s in cluster.services[1:]}
            td = TensorDict({"x": torch.arange(16), "r": torch.randn(16, 3)}, batch_size=[16])
            metas = [client.put(td[:8], partition="train"), put_anew(cluster.address, td[8:], partition="train")]
            assert {m.units[0] for m in metas} == {0, 1}, "puts go to both Ray-launched units"
            got = client.get_meta(["x", "r"], 16, task="check", partition="train", timeout=10)
            batch = client.get_data(got)
            assert batch["x"].tolist() == got.indexes and torch.equal(batch["r"], td["r"][torch.tensor(got.indexes)])
            client.ack(got)

            client.put(TensorDict({"y": torch.arange(12)}, batch_size=[12]), partition="s")
            client.seal("s")
            batches = client.stream(["y"], 4, task="s", partition="s", timeout=10)
            assert sorted(row for b, _ in batches for row in b["y"].tolist()) == list(range(12))
        with tq.connect(cluster.address) as shm_client:  # same node: arenas mapped through /dev/shm
            assert shm_client.mapped_units
            again = shm_client.get_meta(["x"], 16, task="again", partition="train", timeout=10)
            assert sorted(shm_client.get_data(again)["x"].tolist()) == list(range(16))
    finally:
        cluster.shutdown()
    _assert_gone(cluster)
    cluster.shutdown()  # twice is fine


def test_host_auto_advertises_the_node_ip(ray_session):
    node_ip = ray.util.get_node_ip_address()
    with tq.init(backend="ray", num_storage_units=2, storage_capacity="32MiB", host="auto") as cluster:
        assert all(s["address"].startswith(f"tcp://{node_ip}:") for s in cluster.services)
        with cluster.connect(use_shm=False) as client:  # beyond loopback: with the cluster's credentials
            client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
            meta = client.get_meta(["x"], 4, task="t", timeout=10)
            assert sorted(client.get_data(meta)["x"].tolist()) == [0, 1, 2, 3]
    _assert_gone(cluster)


def test_dead_actors_take_their_services_along_and_shutdown_still_cleans(ray_session, monkeypatch):
    cluster = tq.init(backend="ray", num_storage_units=2, storage_capacity="32MiB")
    for actor in cluster.backend.actors:
        ray.kill(actor)
    eventually(lambda: not any(_running(s["pid"]) for s in cluster.services), timeout=10, what="the services' exit")
    # Killed units cannot unlink their arenas; with no actor left on the node, shutdown sweeps it
    # with a task pinned there (the driver's own sweep is switched off to show that).
    monkeypatch.setattr(_cluster, "remove_shm", lambda cluster_id: None)
    cluster.shutdown()
    _assert_gone(cluster)


def test_host_auto_needs_the_ray_backend():
    with pytest.raises(tq.SchemaError, match="backend='ray'"):
        tq.init(num_storage_units=1, host="auto")
    with pytest.raises(tq.SchemaError, match="unknown backend"):
        tq.init(num_storage_units=1, backend="dask")  # type: ignore[arg-type]


def test_missing_ray_says_how_to_install(monkeypatch):
    from transfer_queue import _ray_backend

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "sluice-rl\[ray\]"'):
        _ray_backend.RayActors().start(tq.ClusterConfig(), "x", 0, "secret", "")
