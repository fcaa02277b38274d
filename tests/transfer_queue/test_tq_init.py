"""`tq.init`'s dispatch between Sluice's `init(...)` and TransferQueue's `init(conf)`, with no
TransferQueue-style cluster running yet."""

from __future__ import annotations

import os

import pytest

import transfer_queue as tq
from transfer_queue.compat.face import ENV_ADDRESS

CONF = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}, "sluice": {"storage_capacity": "16MiB"}}


def test_sluice_init_keeps_its_own_semantics():
    with tq.init(num_storage_units=1, storage_capacity="16MiB") as cluster:
        assert isinstance(cluster, tq.Cluster)
    with pytest.raises(tq.SchemaError, match="Mooncake"):
        tq.init({"backend": {"storage_backend": "MooncakeStore"}})
    with pytest.raises(tq.SchemaError, match="unknown key"):
        tq.init({"sluice": {"num_gpus": 3}})


def test_metrics_endpoint():
    conf = tq.init({**CONF, "metrics": {"enabled": True}})
    try:
        endpoint = tq.get_metrics_endpoint()
        assert endpoint == conf["metrics"]["endpoint"] and endpoint.startswith("127.0.0.1:")
    finally:
        tq.close()
    assert ENV_ADDRESS not in os.environ
