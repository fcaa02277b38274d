"""The weight transports' data endpoints (tcp, ucx) admit only holders of the cluster's
credentials (both ways), and refuse to serve beyond loopback without them."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.helpers import eventually
from transfer_queue import SchemaError, WeightSyncError
from transfer_queue.wire.rpc import CREDENTIALS_ENV, Credentials
from weight_sync import TcpTransport, UcxTransport, WeightPublisher, WeightSubscriber

from .workers import BUCKET, weights, zeros

TRANSPORTS = [
    TcpTransport,
    pytest.param(UcxTransport, marks=pytest.mark.skipif(not UcxTransport.is_available(), reason="ucxx not installed")),
]


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch):
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_only_holders_of_the_credentials_pull_weights(kind):
    creds = Credentials.generate().for_clients()
    served = kind(credentials=creds)
    with WeightPublisher(None, transport=served, bucket_bytes=BUCKET) as pub:
        pub.publish(weights(1), 1)
        model = zeros()
        with WeightSubscriber(None, model, transport=kind(credentials=creds), publisher=pub.endpoint) as sub:
            sub.wait(1, timeout=30)
            assert all(torch.equal(model[k], v) for k, v in weights(1).items())
        for intruder in (kind(), kind(credentials=Credentials.generate().for_clients())):
            with WeightSubscriber(None, zeros(), transport=intruder, publisher=pub.endpoint, timeout=10) as sub:
                with pytest.raises(WeightSyncError, match=r"admits only holders|refused this subscriber's credentials"):
                    sub.wait(1, timeout=10)
                assert sub.version == -1
        eventually(lambda: served.auth_refused >= 1, 10, "the refusal counted")  # the wrong key's


def test_a_raw_tcp_client_that_skips_the_handshake_is_cut_off():
    tcp = TcpTransport(credentials=Credentials.generate().for_clients())
    with WeightPublisher(None, transport=tcp, bucket_bytes=BUCKET) as pub:
        pub.publish(weights(1), 1)
        host, port = tcp._listener.getsockname()
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.recv(64)
            raw.sendall(b"\x10\x00\x00\x00" + b"x" * 60)
            assert raw.recv(64) == b"", "the server closed the connection"
        eventually(lambda: tcp.auth_refused >= 1, 10, "the refusal counted")


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_serving_beyond_loopback_needs_credentials(kind):
    with pytest.raises(SchemaError, match="without the cluster's credentials"):
        WeightPublisher(None, transport=kind(host="0.0.0.0"), bucket_bytes=BUCKET)
