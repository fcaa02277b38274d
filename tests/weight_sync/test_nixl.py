"""The nixl transport's own promises: a read's contiguous runs are exactly its box's bytes (on
CPU, without NIXL); `memory=` picks host or GPU staging and receive buffers, and refuses
anything else (and CUDA where there is none) with a `SchemaError`; through real processes two
subscribers READ identical exact weights out of the publisher's registered host staging, the
slot's address, memory and the agent's metadata reaching them only in their grants. Marked
`cuda`: the publisher's GPU slots are registered as VRAM and read into subscribers' GPU receive
buffers, every version exact in their CUDA tensors."""

from __future__ import annotations

import msgspec
import pytest
import torch

from transfer_queue import SchemaError, WeightSyncError
from weight_sync import NixlTransport, WeightPublisher
from weight_sync.plan import Read
from weight_sync.transports.nixl import NixlSlot, _register, runs

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
    assert msgspec.msgpack.decode(handle, type=NixlSlot) == NixlSlot("sluice-1-0-ab", b"\x00md", 1 << 40, 0, "DRAM")
    gpu = NixlSlot("sluice-1-0-ab", b"\x00md", 1 << 40, 1, "VRAM")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(gpu), type=NixlSlot) == gpu
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["a", b"", 0, 0, "HBM"]), type=NixlSlot)


def test_memory_picks_where_it_stages_and_receives():
    host = NixlTransport()
    assert host.staging == "host" and host.receive_device is None
    if torch.cuda.is_available():
        gpu = NixlTransport(memory="cuda")
        assert gpu.staging == "cuda" and gpu.receive_device == torch.device("cuda", torch.cuda.current_device())
        assert NixlTransport(memory=torch.device("cuda", 0)).receive_device == torch.device("cuda", 0)
        with pytest.raises(SchemaError, match="sees"):
            NixlTransport(memory=f"cuda:{torch.cuda.device_count()}")
    else:
        for memory in ("cuda", "cuda:0", torch.device("cuda")):
            with pytest.raises(SchemaError, match="no CUDA"):
                NixlTransport(memory=memory)


@pytest.mark.parametrize("memory", ["cpu", "gpu", "DRAM", "meta", "cuda:x", 0, None])
def test_memory_other_than_host_or_cuda_is_refused(memory):
    with pytest.raises(SchemaError, match="'host' or a CUDA device"):
        NixlTransport(memory=memory)


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
        assert all(not s.mapped.tensor.is_cuda for s in pub._table.slots)
        assert {_memory(handle) for _, _, handle in served._slots.values()} == {"DRAM"}
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()
    assert served._agent is None and not served._slots, "closing deregistered the slots"


@pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's UCX reaches GPU memory")
def test_gpu_memory_a_ucx_cannot_reach_is_a_weight_sync_error():
    """Without CUDA, NIXL's UCX takes any memory for host memory and refuses a VRAM registration:
    the error says what GPU memory needs."""
    transport = NixlTransport()
    agent = transport._get_agent()
    host = torch.zeros(4096, dtype=torch.uint8)
    try:
        with pytest.raises(WeightSyncError, match="UCX's CUDA transports"):
            _register(agent, host.data_ptr(), host.numel(), "VRAM", 0, "staging slot 0")
        agent.deregister_memory(_register(agent, host.data_ptr(), host.numel(), "DRAM", 0, "staging slot 0"))
    finally:
        transport.close()


def _memory(handle: bytes) -> str:
    return msgspec.msgpack.decode(handle, type=NixlSlot).memory


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
def test_gpu_slots_are_read_into_gpu_receive_buffers():
    """GPU staging registered as VRAM; subscribers with CUDA targets READ it into a GPU receive
    buffer (GPU to GPU, then a device-to-device apply)."""
    gpu = {n: t.cuda() for n, t in weights(0).items()}
    with pytest.raises(ValueError, match="different memories"):
        WeightPublisher(None, transport=[NixlTransport(memory="cuda"), "shm"])
    served = NixlTransport(memory="cuda")
    pub = WeightPublisher(None, transport=served, bucket_bytes=BUCKET, model=gpu, timeout=30)
    subs = Subscribers(2, pub.endpoint, ("nixl", {"memory": "cuda"}), device="cuda", timeout=30.0)
    try:
        assert all(s.mapped.tensor.is_cuda for s in pub._table.slots), "GPU staging slots"
        for version in (1, 2, 3):
            pub.publish({n: t.cuda() for n, t in weights(version).items()}, version)
            try:
                subs.wait_applied(version, timeout=30)
            except AssertionError as exc:  # say why: the subscribers' errors (NIXL's, UCX's)
                raise AssertionError(f"{exc}; the subscribers saw: {subs.finish(timeout=30)}") from None
        assert {_memory(handle) for _, _, handle in served._slots.values()} == {"VRAM"}
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()
    assert served._agent is None and not served._slots, "closing deregistered the slots"
