"""The channel over real processes and sockets, for every transport: versions arrive whole and
in place, never mixed; late joiners get the newest; a publisher killed mid-transfer leaves
subscribers on the previous version; tcp relays along a chain."""

from __future__ import annotations

import os

import pytest

from tests.helpers import eventually
from weight_sync import NixlTransport, TcpTransport, UcxTransport, WeightPublisher

from .harness import Subscribers, check, no_segments_left, publisher_killed_mid_version, publisher_transport
from .workers import BUCKET, transport_of, weights

TRANSPORTS = [
    pytest.param("shm", id="shm"),
    pytest.param("tcp", id="tcp"),
    pytest.param(
        "ucx", id="ucx", marks=pytest.mark.skipif(not UcxTransport.is_available(), reason="ucxx is not installed")
    ),
    pytest.param(
        "nixl", id="nixl", marks=pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
    ),
    pytest.param("torch", id="torch"),
]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_versions_arrive_whole_and_in_place(transport):
    """Two subscriber processes take v1, then v2, in place and exact; then versions 3..10
    published back to back never show up mixed."""
    pub = WeightPublisher(None, transport=transport_of(publisher_transport(transport, 2)), bucket_bytes=BUCKET)
    subs = Subscribers(2, pub.endpoint, transport)
    try:
        pub.publish(weights(1), 1)
        subs.wait_applied(1)
        pub.publish(weights(2), 2)
        subs.wait_applied(2)
        for version in range(3, 11):
            pub.publish(weights(version), version)
        subs.wait_applied(10)
        for summary in subs.finish().values():
            assert summary["applied"][:2] == [1, 2]
            check(summary, 10)
    finally:
        pub.close()
    no_segments_left()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_late_joiner_gets_the_newest(transport):
    pub = WeightPublisher(None, transport=transport_of(publisher_transport(transport, 1)), bucket_bytes=BUCKET)
    try:
        for version in (1, 2, 3):
            pub.publish(weights(version), version)
        subs = Subscribers(1, pub.endpoint, transport)
        subs.wait_applied(3)
        (summary,) = subs.finish().values()
        assert summary["applied"] == [3]
        check(summary, 3)
    finally:
        pub.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_publisher_killed_mid_transfer_leaves_the_previous_version(transport):
    """The trainer dies while version 2 is half staged (and, for streaming transports, half
    sent): subscribers report `WeightSyncError` and keep version 1, exactly."""
    publisher_killed_mid_version(publisher_transport(transport, 2), {"bucket_bytes": BUCKET}, transport)


def test_tcp_relay_chain():
    """With fanout 1 the second subscriber pulls from the first, which relays as it receives."""
    pub = WeightPublisher(None, transport=TcpTransport(fanout=1), bucket_bytes=BUCKET)
    subs = Subscribers(2, pub.endpoint, "tcp")
    try:
        for version in (1, 2):
            pub.publish(weights(version), version)
            subs.wait_applied(version)
        summaries = subs.finish()
        sources = sorted(s["sources"][0] for s in summaries.values())
        assert sources[0] == "" and sources[1].startswith("127.0.0.1:"), sources
        for summary in summaries.values():
            check(summary, 2)
    finally:
        pub.close()


def test_publisher_cleans_up_its_threads_and_memory():
    # the first publish starts process-wide threads that outlive its publisher (UCX's, torch's
    # CPU pool): start them first
    with WeightPublisher(None, transport="auto", bucket_bytes=BUCKET) as warm:
        warm.publish(weights(0), 0)
    before = {t for t in os.listdir(f"/proc/{os.getpid()}/task")}
    pub = WeightPublisher(None, transport="auto", bucket_bytes=BUCKET)
    pub.publish(weights(1), 1)
    pub.close()
    # the publisher's own threads end (joined by close, or just after); UCX's native worker
    # thread goes later, with its context
    eventually(lambda: len(set(os.listdir(f"/proc/{os.getpid()}/task")) - before) <= 1, 10, "publisher threads gone")
    fds = os.listdir(f"/proc/{os.getpid()}/fd")
    assert not any(
        "sluice-weights" in os.readlink(f"/proc/{os.getpid()}/fd/{fd}")
        for fd in fds
        if os.path.exists(f"/proc/{os.getpid()}/fd/{fd}")
    )
