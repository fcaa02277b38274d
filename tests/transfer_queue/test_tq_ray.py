"""TransferQueue's face under Ray, as verl runs it: `tq.init(conf)` inside a task-runner actor on
a two-node local Ray cluster (`ray.cluster_utils.Cluster`, one CPU per node, both CPUs held by
actors), storage units spread over the nodes, and workers on either node attaching by name."""

from __future__ import annotations

import sys

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CONF = {"backend": {"SimpleStorage": {"num_data_storage_units": 4}}, "sluice": {"storage_capacity": "64MiB"}}


class TaskRunner:
    """Stands in for verl's `TaskRunnerV1`: it holds a whole CPU and calls `tq.init(conf)`."""

    def start(self) -> tuple[str, list[str]]:
        import torch
        from tensordict import TensorDict

        import transfer_queue as tq
        from transfer_queue.compat import face

        conf = tq.init(CONF)
        tq.kv_batch_put(
            ["k0", "k1"],
            "train",
            TensorDict({"x": torch.arange(6).view(2, 3)}, batch_size=[2]),
            tags=[{"status": "finished"}, {"status": "finished"}],
        )
        nodes = [s["node_id"] for s in face._FACE.cluster.services if s["service"].startswith("storage")]
        return conf["sluice"]["address"], nodes

    def stop(self) -> None:
        import transfer_queue as tq

        tq.close()


def read_by_name() -> tuple[str, list[list[int]]]:
    """A Ray task somewhere in the cluster: attach with TransferQueue's `init()`, read, write."""
    import transfer_queue as tq

    assert tq.init() is None
    data = tq.kv_batch_get(["k0", "k1"], "train")
    tq.kv_put("from-worker", "train", tag={"node": ray.get_runtime_context().get_node_id()})
    return tq.get_client().address, data["x"].to_padded_tensor(0).tolist()  # jagged, as TransferQueue reads


@pytest.fixture(scope="module")
def two_nodes():
    if ray.is_initialized():
        pytest.skip("another Ray session is already running in this process")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 2**20},
    )
    cluster.add_node(num_cpus=1, object_store_memory=100 * 2**20)
    ray.init(address=cluster.address)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import tests/
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_tq_init_under_ray_spreads_units_and_is_found_by_name(two_nodes):
    import transfer_queue as tq

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    runner = ray.remote(num_cpus=1)(TaskRunner).remote()
    blocker = ray.remote(num_cpus=1)(TaskRunner).remote()  # the other CPU is taken too, as in verl
    try:
        address, unit_nodes = ray.get(runner.start.remote(), timeout=180)
        assert set(unit_nodes) == set(nodes), "storage units spread over both nodes"
        for node in nodes:  # a worker on each node finds the cluster by name
            strategy = NodeAffinitySchedulingStrategy(node, soft=False)
            task = ray.remote(num_cpus=0, scheduling_strategy=strategy)(read_by_name)
            got_address, x = ray.get(task.remote(), timeout=120)
            assert got_address == address and x == [[0, 1, 2], [3, 4, 5]]
        assert tq.init() is None  # and so does the driver
        try:
            listed = tq.kv_list("train")["train"]
            assert listed["k0"] == {"status": "finished"} and listed["from-worker"]["node"] in nodes
        finally:
            tq.close()
    finally:
        ray.get(runner.stop.remote(), timeout=120)
        ray.kill(runner)
        ray.kill(blocker)
    with pytest.raises(ValueError):
        ray.get_actor("sluice-transfer-queue", namespace="transfer_queue")
