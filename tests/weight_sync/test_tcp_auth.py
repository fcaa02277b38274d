"""The tcp transport's data endpoint admits only holders of the cluster's credentials (both ways),
and refuses to bind beyond loopback without them."""

from __future__ import annotations

import socket

import pytest
import torch

from tests.helpers import eventually
from transfer_queue._auth import CREDENTIALS_ENV, Credentials
from transfer_queue._errors import SchemaError, WeightSyncError
from weight_sync import TcpTransport, WeightPublisher, WeightSubscriber

from .workers import BUCKET, SHAPES, weights


def _zeros() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch):
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)


def test_only_holders_of_the_credentials_pull_weights():
    creds = Credentials.generate().for_clients()
    tcp = TcpTransport(credentials=creds)
    with WeightPublisher(None, transport=tcp, bucket_bytes=BUCKET) as pub:
        pub.publish(weights(1), 1)
        model = _zeros()
        with WeightSubscriber(None, model, transport=TcpTransport(credentials=creds), publisher=pub.endpoint) as sub:
            sub.wait(1, timeout=30)
            assert all(torch.equal(model[k], v) for k, v in weights(1).items())
        for intruder in (TcpTransport(), TcpTransport(credentials=Credentials.generate().for_clients())):
            with WeightSubscriber(None, _zeros(), transport=intruder, publisher=pub.endpoint, timeout=10) as sub:
                with pytest.raises(WeightSyncError, match=r"admits only holders|refused this subscriber's credentials"):
                    sub.wait(1, timeout=10)
                assert sub.version == -1
        # a raw client that skips the handshake and asks straight away is cut off and counted
        before = tcp.auth_refused
        host, port = tcp._listener.getsockname()
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.recv(64)
            raw.sendall(b"\x10\x00\x00\x00" + b"x" * 60)
            assert raw.recv(64) == b"", "the server closed the connection"
        eventually(lambda: tcp.auth_refused > before, 10, "the refusal counted")


def test_serving_beyond_loopback_needs_credentials():
    with pytest.raises(SchemaError, match="without the cluster's credentials"):
        WeightPublisher(None, transport=TcpTransport(host="0.0.0.0"), bucket_bytes=BUCKET)
