"""The nixl transport's own promises: a read's contiguous runs are exactly its box's bytes (on
CPU, without NIXL), and through real processes two subscribers READ identical exact weights out
of the publisher's registered staging, the slot's address and the agent's metadata reaching
them only in their grants."""

from __future__ import annotations

import msgspec
import pytest
import torch

from weight_sync import NixlTransport, WeightPublisher
from weight_sync.plan import Read
from weight_sync.transports.nixl import NixlSlot, runs

from .harness import Subscribers, check
from .workers import BUCKET, weights


@pytest.mark.parametrize(
    "shape,lo,hi",
    [
        ((8, 6), (0, 0), (8, 6)),  # whole: one run
        ((8, 6), (2, 0), (5, 6)),  # whole rows: one run
        ((8, 6), (0, 3), (8, 6)),  # a column shard: one run per row
        ((4, 6, 5), (1, 2, 0), (3, 5, 5)),  # rows of whole inner rows
        ((4, 6, 5), (1, 2, 1), (3, 5, 4)),  # strided in every dim
        ((10,), (3,), (7,)),
    ],
)
def test_runs_are_the_box_bytes_in_order(shape, lo, hi):
    slot = torch.randint(0, 255, (64 + 4 * 6 * 5 * 2,), dtype=torch.uint8)
    read = Read(offset=64, shape=shape, lo=lo, hi=hi, itemsize=2)
    want = read.view(slot, torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
    spans = runs(read)
    got = torch.cat([slot[o : o + n] for o, n in spans.tolist()])
    assert torch.equal(got, want)
    assert spans[:, 1].sum() == read.nbytes


def test_slot_handles_are_msgpack_structs():
    handle = msgspec.msgpack.encode(NixlSlot("sluice-1-0-ab", b"\x00md", 1 << 40))
    assert msgspec.msgpack.decode(handle, type=NixlSlot) == NixlSlot("sluice-1-0-ab", b"\x00md", 1 << 40, 0)


@pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
def test_two_subscribers_read_identical_exact_weights():
    served = NixlTransport()
    pub = WeightPublisher(None, transport=served, bucket_bytes=BUCKET, slots=2)
    subs = Subscribers(2, pub.endpoint, "nixl")
    try:
        for version in (1, 2, 3):
            pub.publish(weights(version), version)
            subs.wait_applied(version)
        assert sorted(served._slots) == [0, 1], "each slot registered once"
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()
    assert served._agent is None and not served._slots, "closing deregistered the slots"
