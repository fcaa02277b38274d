"""CUDA weights through the host-staged transports (marked `cuda`): the publisher's slots are
registered with CUDA when it is built from CUDA tensors, and subscriber processes holding CUDA
tensors take every version exact over shm (a registered mapping) and tcp (registered receive
buffers); with deltas on, versions are packed and compared on the GPU and still land exact.
Without CUDA, registration is never attempted."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from transfer_queue import SchemaError
from transfer_queue.cuda import in_use
from weight_sync import TcpTransport, WeightPublisher
from weight_sync.transports.stream import LANDING_BYTES, Landing

from .harness import Subscribers, check
from .workers import BUCKET, sparse_weights, weights


def test_a_process_without_cuda_registers_nothing():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with WeightPublisher(None, transport="shm", slots=1, model=weights(0)) as pub:
        assert not in_use() and not pub._table.pin
        assert not pub._table.slots[0].segment._pinned._ranges


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_cuda_weights_through_host_staging(transport):
    gpu = {n: t.cuda() for n, t in weights(0).items()}
    # whole versions, copied from the weights on a side stream (with deltas on, CUDA weights
    # are packed on the GPU first: the tests below)
    pub = WeightPublisher(None, transport=transport, bucket_bytes=BUCKET, model=gpu, delta=False)
    subs = Subscribers(2, pub.endpoint, transport, device="cuda")
    try:
        assert pub._table.pin and all(s.segment._pinned._ranges for s in pub._table.slots)
        for version in (1, 2, 3):
            pub.publish({n: t.cuda() for n, t in weights(version).items()}, version)
            subs.wait_applied(version)
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_publish_returns_before_its_copies_and_the_trainer_may_overwrite_at_once(dtype):
    """The copies to host staging run on a side stream: `publish` returns once they are issued,
    and a kernel the trainer issues next (here: zeroing its tensors, as an optimizer step
    changes them) runs only after they read the tensors. Every version arrives exact, with a
    cast from float32 on the GPU too."""
    live = {n: t.to(dtype).cuda() for n, t in weights(0).items()}
    cast = {torch.float32: torch.bfloat16}
    pub = WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, model=live, cast=cast)
    subs = Subscribers(2, pub.endpoint, "shm", device="cuda")
    try:
        for version in (1, 2, 3):
            for name, t in weights(version, torch.float32).items():
                live[name].copy_(t.to(dtype))
            pub.publish(live, version)
            for t in live.values():
                t.zero_()  # on the trainer's stream, ordered after the copies
            subs.wait_applied(version)
        for summary in subs.finish().values():
            check(summary, 3)
    finally:
        pub.close()


@pytest.mark.cuda
@pytest.mark.parametrize("receive", ["host", "cuda"])
def test_deltas_of_cuda_weights_are_compared_on_the_gpu(receive):
    """With deltas on, each version of CUDA weights is packed on the GPU, compared with the
    previous one and encoded there; subscribers (validating) pull deltas and every apply is
    exact. With `receive="cuda"` the subscribers hold CUDA tensors and receive into GPU buffers
    (`TcpTransport(memory="cuda")`): frames are applied there, and each pulls from the rank (a
    GPU buffer serves no relay)."""
    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=True, validate=True)
    on_gpu = receive == "cuda"
    transport = ("tcp", {"memory": "cuda"}) if on_gpu else "tcp"
    subs = Subscribers(2, pub.endpoint, transport, sparse=True, validate=True, device="cuda" if on_gpu else "cpu")
    try:
        for version in range(1, 6):
            pub.publish({n: t.cuda() for n, t in sparse_weights(version).items()}, version)
            subs.wait_applied(version)
        stats = {s.version: s for s in pub.stats()}
        for version in range(2, 6):
            assert stats[version].compared_on.startswith("cuda"), stats[version]
            assert stats[version].delta_pulls == 2 and stats[version].sent * 5 < stats[version].requested
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4, 5]
            if on_gpu:
                assert summary["sources"] and all(source == "" for source in summary["sources"])
            check(summary, 5)
    finally:
        pub.close()


@pytest.mark.cuda
def test_without_gpu_memory_for_the_packs_the_compare_moves_to_the_host(monkeypatch):
    """The GPU has no room for the packed copies (here: the pack raises as an allocation would):
    the version is staged from the weights as without deltas, later versions are compared on
    the host, and every apply is still exact."""
    from weight_sync.device_packs import DevicePacks

    def no_memory(self, version, *args):  # noqa: ANN001, ANN002
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=True, validate=True)
    subs = Subscribers(1, pub.endpoint, "tcp", sparse=True, validate=True)
    try:
        for version in range(1, 5):
            if version == 3:
                monkeypatch.setattr(DevicePacks, "pack", no_memory)
            pub.publish({n: t.cuda() for n, t in sparse_weights(version).items()}, version)
            subs.wait_applied(version)
        stats = {s.version: s for s in pub.stats()}
        assert stats[2].compared_on.startswith("cuda") and stats[4].compared_on == "cpu", stats
        for summary in subs.finish().values():
            assert summary["applied"] == [1, 2, 3, 4]
            check(summary, 4)
    finally:
        pub.close()


@pytest.mark.cuda
def test_with_deltas_the_trainer_may_overwrite_its_weights_right_after_publish():
    """With deltas on, `publish` returns once the GPU pack is issued: the trainer's next kernels
    (here: zeroing its weights) run after the pack has read them, while the copies to the host
    and the compare go on; every version, as a delta, arrives exact."""
    live = {n: t.cuda() for n, t in sparse_weights(0).items()}
    pub = WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=True, validate=True, model=live)
    subs = Subscribers(1, pub.endpoint, "tcp", sparse=True, validate=True)
    try:
        for version in range(1, 6):
            for name, t in sparse_weights(version).items():
                live[name].copy_(t)
            pub.publish(live, version)
            for t in live.values():
                t.zero_()  # on the trainer's stream, ordered after the pack
            subs.wait_applied(version)
        stats = {s.version: s for s in pub.stats()}
        assert all(stats[v].delta_pulls == 1 for v in range(2, 6)), stats
        for summary in subs.finish().values():
            check(summary, 5)
    finally:
        pub.close()


def test_tcp_receive_memory_is_host_or_a_cuda_device_this_process_sees():
    assert TcpTransport().receive_device is None and TcpTransport(memory="host").receive_device is None
    for wrong in ("bogus", "cpu", 0):
        with pytest.raises(SchemaError, match="'host' or a CUDA device"):
            TcpTransport(memory=wrong)
    if torch.cuda.is_available():
        assert TcpTransport(memory="cuda").receive_device == torch.device("cuda", torch.cuda.current_device())
        with pytest.raises(SchemaError, match="sees"):
            TcpTransport(memory=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(SchemaError, match="no CUDA"):
            TcpTransport(memory="cuda")


@pytest.mark.cuda
def test_a_stream_lands_in_gpu_memory_through_pinned_buffers():
    """`Landing` fills a GPU tensor from a socket through its pinned buffers taken in turn:
    more bytes than all of them hold, ending inside one, arrive exact."""
    data = torch.randint(0, 256, (5 * LANDING_BYTES + 12_345,), dtype=torch.uint8)
    ours, theirs = socket.socketpair()
    sender = threading.Thread(target=theirs.sendall, args=(data.numpy().tobytes(),))
    sender.start()
    try:
        target = torch.empty(data.numel(), dtype=torch.uint8, device="cuda")
        landing = Landing(target.device)

        def recv(view: memoryview) -> None:
            got = 0
            while got < len(view):
                n = ours.recv_into(view[got:])
                assert n, "the sender closed early"
                got += n

        landing.receive(recv, target[:LANDING_BYTES])
        landing.receive(recv, target[LANDING_BYTES:])
        assert torch.equal(target.cpu(), data)
    finally:
        sender.join()
        ours.close()
        theirs.close()
