"""The cuda_ipc transport. On CPU: its slot handles are msgspec structs that round trip field by
field and refuse anything else, a publisher refuses to mix GPU and host staging (or to validate
GPU staging), and "auto" offers it only where CUDA exists and never on a publisher's side. Marked
`cuda`: versions staged on the GPU reach subscriber processes whole and exact (GPU and CPU
targets, with resharding reads), auto picks it, slots are reused only after their readers
release them, and a dead publisher leaves the subscriber's version in place."""

from __future__ import annotations

import msgspec
import pytest
import torch

import transfer_queue as tq
from transfer_queue import WeightSyncError
from weight_sync import CudaIpcTransport, WeightPublisher, WeightSubscriber
from weight_sync.protocol import Granted, SlotInfo
from weight_sync.transports import resolve
from weight_sync.transports.cuda_ipc import IpcSlot, decode_slot, encode_slot

from .harness import CTX, Subscribers, check, publisher_transport
from .workers import BUCKET, kill, publisher, weights, zeros

FIELDS = (1, b"\x01" * 64, 1 << 30, 4096, b"/torch_123_456", 7, b"\x02" * 64, True)


def test_slot_handles_round_trip_in_a_grant():
    raw = encode_slot(FIELDS)
    grant = Granted(3, 9, 0x51, SlotInfo(1, 2, 1 << 30, "", raw))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(grant), type=Granted)
    slot = decode_slot(back.slot.handle)
    assert isinstance(slot, IpcSlot) and slot.fields() == FIELDS
    with pytest.raises(WeightSyncError, match="cuda_ipc grant"):
        decode_slot(b"")
    with pytest.raises(WeightSyncError, match="cuda_ipc grant"):
        decode_slot(msgspec.msgpack.encode(["not", "a", "slot"]))


def test_a_publisher_stages_in_one_memory():
    with pytest.raises(ValueError, match="different memories"):
        WeightPublisher(None, transport=[CudaIpcTransport(), "shm"])
    with pytest.raises(ValueError, match="validate"):
        WeightPublisher(None, transport=CudaIpcTransport(), validate=True)


def test_auto_offers_cuda_ipc_only_with_cuda_and_never_on_a_publisher():
    assert "cuda_ipc" not in [t.name for t in resolve("auto", publisher=True)]
    assert ("cuda_ipc" in [t.name for t in resolve("auto")]) == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            resolve("cuda_ipc")


def _gpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.cuda() for n, t in state.items()}


@pytest.mark.cuda
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_gpu_versions_arrive_whole(device):
    pub = WeightPublisher(None, transport="cuda_ipc", bucket_bytes=BUCKET, model=_gpu(weights(0)))
    subs = Subscribers(2, pub.endpoint, "auto", device=device)
    try:
        assert all(s.segment is not None and s.segment.tensor.is_cuda for s in pub._table.slots)
        for version in range(1, 6):
            pub.publish(_gpu(weights(version)), version)
            subs.wait_applied(version)
        for summary in subs.finish().values():
            check(summary, 5)
    finally:
        pub.close()


@pytest.mark.cuda
def test_one_slot_waits_for_its_reader_and_auto_picks_cuda_ipc():
    with WeightPublisher(None, transport="cuda_ipc", slots=1, bucket_bytes=BUCKET, timeout=30) as pub:
        mine = {n: t.cuda() for n, t in zeros().items()}
        with WeightSubscriber(None, mine, publisher=pub.endpoint) as sub:
            pub.publish(_gpu(weights(1)), 1)
            assert sub.wait(1, timeout=30) == 1
            assert sub._ranks.transport.name == "cuda_ipc"
            assert all(torch.equal(mine[n].cpu(), t) for n, t in weights(1).items())
            lease = pub._table.lease(1)
            assert lease is not None
            with pytest.raises(tq.TimeoutError):
                pub._table.claim(2, pub._table.slots[0].size, 0.2)  # held by a reader: not reused
            pub._table.release(lease[0])
            pub.publish(_gpu(weights(2)), 2)
            assert sub.wait(2, timeout=30) == 2


@pytest.mark.cuda
def test_a_dead_publisher_leaves_the_version_in_place():
    commands, out = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(
        target=publisher,
        args=(out, commands, None, publisher_transport("cuda_ipc", 1), {"bucket_bytes": BUCKET}),
        daemon=True,
    )
    proc.start()
    endpoint = out.get(timeout=60)[1]
    mine = {n: t.cuda() for n, t in zeros().items()}
    with WeightSubscriber(None, mine, transport="cuda_ipc", publisher=endpoint, timeout=5) as sub:
        commands.put(("publish", 1))
        assert sub.wait(1, timeout=60) == 1
        kill(proc)
        with pytest.raises(WeightSyncError):
            sub.wait(2, timeout=10)
        assert sub.version == 1
        assert all(torch.equal(mine[n].cpu(), t) for n, t in weights(1).items())
