"""Sharded trainers to differently sharded subscribers over real processes, and validation
mode catching a corrupted byte."""

from __future__ import annotations

import re
import time

import pytest
import torch

from transfer_queue.wire.errors import WeightSyncError
from weight_sync import NixlTransport, TcpTransport, UcxTransport, WeightPublisher, WeightSubscriber

from .harness import CTX, Subscribers, check
from .workers import BUCKET, SHAPES, publisher, weights, zeros


@pytest.mark.parametrize(
    "transport",
    [
        "shm",
        "tcp",
        pytest.param("ucx", marks=pytest.mark.skipif(not UcxTransport.is_available(), reason="ucxx is not installed")),
        pytest.param(
            "nixl", marks=pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
        ),
    ],
)
def test_two_trainer_tp_ranks_feed_tp1_and_tp2_subscribers(transport):
    """Trainer TP=2 (HF names, unfused) to inference TP=1 and TP=2 (fused qkv/gate_up): each
    subscriber pulls exactly its slices from both ranks and ends exact (over tcp and ucx, the
    strided slices gathered on the sending side; over nixl, read as their contiguous runs)."""
    commands = [CTX.Queue(), CTX.Queue()]
    outs = [CTX.Queue(), CTX.Queue()]
    kwargs = {"bucket_bytes": BUCKET, "world_size": 2}
    procs = [
        CTX.Process(
            target=publisher,
            args=(outs[0], commands[0], None, transport, {**kwargs, "rank": 0, "tp": (0, 2)}),
            daemon=True,
        )
    ]
    procs[0].start()
    try:
        _, endpoint = outs[0].get(timeout=60)
        procs.append(
            CTX.Process(
                target=publisher,
                args=(
                    outs[1],
                    commands[1],
                    None,
                    transport,
                    {**kwargs, "rank": 1, "tp": (1, 2), "coordinator": endpoint},
                ),
                daemon=True,
            )
        )
        procs[1].start()
        outs[1].get(timeout=60)
        groups = [
            Subscribers(1, endpoint, transport, first_id=i, tp=tp) for i, tp in enumerate([(0, 1), (0, 2), (1, 2)])
        ]
        for version in (1, 2):
            for queue in commands:
                queue.put(("publish", version))
            for group in groups:
                group.wait_applied(version)
        for group in groups:
            for summary in group.finish().values():
                check(summary, 2)
    finally:
        for queue in commands:
            queue.put(("close",))
        for proc in procs:
            proc.join(10)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_validation_names_a_tensor_corrupted_in_staging(transport):
    """A byte flipped in the publisher's staged snapshot is caught before it is applied;
    the next clean version goes through."""
    with WeightPublisher(None, transport=transport, bucket_bytes=BUCKET, validate=True) as pub:
        pub.publish(weights(1), 1)
        slot = _staged(pub, 1)
        entry = next(e for e in slot.manifest.entries if e.name.endswith("down_proj.weight"))
        slot.segment.tensor[slot.manifest.start(entry) + 5] ^= 0xFF
        mine = zeros()
        with WeightSubscriber(None, mine, transport=transport, publisher=pub.endpoint, validate=True) as sub:
            with pytest.raises(WeightSyncError, match=r"down_proj\.weight"):
                sub.wait(1, timeout=10)
            assert sub.version == -1 and all(not t.any() for t in mine.values())
            pub.publish(weights(2), 2)
            _staged(pub, 2)
            assert sub.wait(2, timeout=30) == 2
            assert all(torch.equal(mine[n], t) for n, t in weights(2).items())


def _staged(pub: WeightPublisher, version: int):
    """The publisher's slot holding `version`, once complete."""
    slot = pub._table.find(version)
    deadline = time.monotonic() + 10
    while not slot.complete:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return slot


class _FlippingTcp(TcpTransport):
    """Corrupts one received byte: what a faulty NIC or relay would do."""

    def receive(self, job):  # noqa: ANN001, ANN201
        into = super().receive(job)
        into[7] ^= 0x01
        return into


def test_validation_names_a_tensor_corrupted_in_transit():
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, validate=True) as pub,
        WeightSubscriber(None, zeros(), transport=_FlippingTcp(), publisher=pub.endpoint, validate=True) as sub,
    ):
        pub.publish(weights(1), 1)
        first = next(iter(SHAPES))
        with pytest.raises(WeightSyncError, match=rf"checksum mismatch in what arrived.*{re.escape(first)}"):
            sub.wait(1, timeout=30)
        assert sub.version == -1


def test_a_version_corrupted_in_transit_is_not_applied_and_the_tensors_keep_theirs():
    """Version 1 arrives whole; one byte of version 2 is corrupted on its way. Validation names
    the tensor before anything is applied: `wait` raises, and the tensors hold version 1,
    every byte of it, with `version` 1."""

    class FlippingSecond(TcpTransport):
        def receive(self, job):  # noqa: ANN001, ANN201
            into = super().receive(job)
            if job.version == 2:
                into[7] ^= 0x01
            return into

    mine = zeros()
    with (
        WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, validate=True, delta=False) as pub,
        WeightSubscriber(None, mine, transport=FlippingSecond(), publisher=pub.endpoint, validate=True) as sub,
    ):
        pub.publish(weights(1), 1)
        assert sub.wait(1, timeout=30) == 1
        pub.publish(weights(2), 2)
        with pytest.raises(
            WeightSyncError, match=rf"checksum mismatch in what arrived.*{re.escape(next(iter(SHAPES)))}"
        ):
            sub.wait(2, timeout=30)
        assert sub.version == 1
        assert all(torch.equal(mine[n], t) for n, t in weights(1).items())
