"""Beyond loopback, every service is a CurveZMQ server: clients with the cluster's credentials
work, others are refused (and counted); services refuse to bind there without credentials;
units bound to 0.0.0.0 advertise an address others can reach."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from transfer_queue.wire.auth import CREDENTIALS_ENV, Credentials
from transfer_queue.wire.messages import ClusterConfig, ControllerRequest
from transfer_queue.wire.rpc import Codec, Service


def test_a_cluster_on_all_interfaces_admits_only_its_clients(monkeypatch):
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)
    with tq.init(num_storage_units=2, storage_capacity="32MiB", host="0.0.0.0") as cluster:
        assert cluster.credentials is not None and not cluster.client_credentials.server_secret
        host = cluster.address.partition("://")[2].rpartition(":")[0]
        assert host != "0.0.0.0"
        with cluster.connect(use_shm=False) as client:
            assert all("0.0.0.0" not in u.address for u in client.units.values())
            client.put(TensorDict({"x": torch.arange(8)}, batch_size=[8]))
            meta = client.get_meta(["x"], 8, task="t", timeout=10)
            assert sorted(client.get_data(meta)["x"].tolist()) == list(range(8))
            # the token a worker gets from `sluice serve` works the same way
            monkeypatch.setenv(CREDENTIALS_ENV, cluster.client_credentials.token())
            with tq.connect(cluster.address) as worker:
                assert worker.status()["partitions"]["train"]["samples"] == 8
            monkeypatch.delenv(CREDENTIALS_ENV)
            for creds in (None, Credentials.generate().for_clients()):  # no keys; another cluster's keys
                with pytest.raises(tq.ServiceError, match="credentials"):
                    tq.connect(cluster.address, credentials=creds)
            assert client.status()["counters"]["auth_refused"] >= 2


async def test_services_refuse_to_bind_beyond_loopback_without_credentials():
    with pytest.raises(tq.SchemaError, match="without CurveZMQ credentials"):
        Service(Codec(ControllerRequest), "tcp://0.0.0.0:*")
    from controllers.service import Controller

    with pytest.raises(tq.SchemaError, match="without CurveZMQ credentials"):
        Controller(ClusterConfig(host="0.0.0.0"), "tcp://0.0.0.0:*")
