"""The weight channel's control plane over the RPC kernel: its server thread never waits on the
controller, and beyond loopback it is a CurveZMQ server like every data-plane service."""

from __future__ import annotations

import threading

import pytest
import torch

import transfer_queue as tq
from transfer_queue.wire.auth import CREDENTIALS_ENV, Credentials
from weight_sync import WeightPublisher
from weight_sync.protocol import Confirm, Granted, Latest, Lease, Offer, Ok, Release, RpcClient


def test_subscribers_are_answered_while_a_version_is_being_recorded(cluster):
    """Recording a complete version in the controller is a round trip of up to seconds; leases,
    releases and `Latest` are served meanwhile, and `Confirm` answers once the record lands."""
    recording, release_record = threading.Event(), threading.Event()
    with WeightPublisher(cluster.address, "tcp") as pub, tq.ControlClient(cluster.address) as control:
        record = pub._coordinator.record

        def held_record(version: int) -> None:
            recording.set()
            assert release_record.wait(60)
            record(version)

        pub._coordinator.record = held_record
        pub.publish({"w": torch.arange(8.0)}, version=1)
        assert recording.wait(30), "the coordinator never started recording version 1"
        client = RpcClient(pub.endpoint, timeout=5.0)
        try:
            offer = client.call(Latest(after=-1, complete=True, timeout=0.0))
            assert isinstance(offer, Offer) and offer.version == -1  # not recorded yet: nobody is told
            grant = client.call(Lease(1, timeout=5.0))
            assert isinstance(grant, Granted) and grant.version == 1
            assert isinstance(client.call(Release(grant.lease)), Ok)
            assert control.version == 0
            release_record.set()
            assert isinstance(client.call(Confirm(1, timeout=30.0), timeout=35.0), Ok)
            assert control.version == 1
            assert client.call(Latest(after=-1, complete=True, timeout=0.0)).version == 1
        finally:
            release_record.set()
            client.close()


def test_the_control_endpoint_admits_only_the_clusters_clients(monkeypatch):
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)
    creds = Credentials.generate()
    with pytest.raises(tq.SchemaError, match="without CurveZMQ credentials"):
        WeightPublisher(None, "tcp", host="0.0.0.0")
    with WeightPublisher(None, "tcp", credentials=creds) as pub:
        pub.publish({"w": torch.ones(4)}, version=1)
        for wrong in (None, Credentials.generate().for_clients()):  # no keys; another cluster's keys
            stranger = RpcClient(pub.endpoint, timeout=2.0, connect_timeout=1.0, credentials=wrong)
            with pytest.raises(tq.WeightSyncError):
                stranger.call(Latest(after=-1, timeout=0.0))
            stranger.close()
        assert pub._server.auth_refused >= 2
        member = RpcClient(pub.endpoint, timeout=5.0, credentials=creds.for_clients())
        assert member.call(Latest(after=-1, timeout=0.0)).version == 1
        member.close()
