"""The cuda_ipc transport. On CPU: its slot handles are msgspec structs that round trip field by
field and refuse anything else, a publisher refuses to validate GPU staging, serves it beside
host staging with no GPU memory taken before a lease over it (and a typed refusal without
CUDA), "auto" offers it only where CUDA exists, and host tensors take it last; a subscriber
that offered host transports too reads host staging once GPU staging cannot start, one that
offered only cuda_ipc gets the reason. Marked `cuda`:
versions staged on the GPU reach subscriber processes whole and exact (GPU and CPU targets,
with resharding reads), auto picks it (also beside host staging, from one publisher), slots
are reused only after their readers release them and freed when the publisher closes
(once their readers let go) however many processes opened them, a dead publisher leaves the
subscriber's version in place, and GPU staging out of memory gives its memory back while its
"auto" readers go on over host staging."""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import torch

import transfer_queue as tq
from transfer_queue import GpuStagingStoppedError, WeightSyncError
from transfer_queue.host import host_id
from transfer_queue.wire.rpc import DEAD_AFTER
from weight_sync import CudaIpcTransport, WeightPublisher, WeightSubscriber
from weight_sync.protocol import Granted, Lease, RankInfo, RpcClient, SlotInfo
from weight_sync.transports import resolve
from weight_sync.transports.cuda_ipc import IpcSlot, decode_slot, encode_slot

from .harness import CTX, Subscribers, check, publisher_transport
from .workers import BUCKET, kill, publisher, weights, zeros

FIELDS = (1, b"\x01" * 64, 1 << 30, 4096, b"\x02" * 64, True)


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


def test_validate_needs_host_staging():
    with pytest.raises(ValueError, match="validate"):
        WeightPublisher(None, transport=CudaIpcTransport(), validate=True)


def test_cuda_ipc_beside_shm_takes_no_gpu_memory_until_leased_over():
    """What "auto" serves where CUDA is: host staging for shm readers, and GPU slots only once
    a subscriber leases over cuda_ipc; a process without CUDA refuses that lease, typed."""
    with WeightPublisher(None, transport=[CudaIpcTransport(), "shm"], bucket_bytes=BUCKET, timeout=30) as pub:
        mine = zeros()
        with WeightSubscriber(None, mine, transport="auto", publisher=pub.endpoint) as sub:
            pub.publish(weights(1), 1)
            assert sub.wait(1, timeout=30) == 1
            assert sub._ranks is not None and sub._ranks.transport.name == "shm"
            assert all(torch.equal(mine[n], t) for n, t in weights(1).items())
        assert pub._mirror is not None and all(s.segment is None for s in pub._mirror.table.slots)
        if not torch.cuda.is_available():
            client = RpcClient(pub.endpoint, timeout=10.0)
            try:
                with pytest.raises(WeightSyncError, match="no CUDA"):
                    client.call(Lease(1, "cuda_ipc"))
                assert isinstance(client.call(Lease(1, "shm")), Granted)  # host staging goes on
            finally:
                client.close()


def test_host_tensors_take_cuda_ipc_only_when_nothing_else_is_served():
    """A subscriber's tensors on the host read host staging where it is offered, so that the
    publisher takes no GPU memory for them; GPU tensors prefer cuda_ipc."""
    ranks = [RankInfo(0, 1, host_id(), "tcp://127.0.0.1:1", {"cuda_ipc": "cuda", "shm": "", "tcp": "tcp://x"})]
    with WeightSubscriber(
        None, zeros(), transport=[CudaIpcTransport(), "tcp", "shm"], publisher="tcp://127.0.0.1:1"
    ) as sub:
        assert sub._choose(ranks).name == "shm"
    gpu_only = [msgspec.structs.replace(ranks[0], data={"cuda_ipc": "cuda"})]
    with WeightSubscriber(None, zeros(), transport=[CudaIpcTransport(), "shm"], publisher="tcp://127.0.0.1:1") as sub:
        assert sub._choose(gpu_only).name == "cuda_ipc"


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU staging starts where CUDA is")
def test_without_cuda_a_subscriber_that_offered_host_transports_reads_host_staging(caplog):
    """GPU staging cannot start in a publisher's process without CUDA. A subscriber that chose
    cuda_ipc (as one with GPU tensors would: this box has none, so it is told to prefer it)
    and offered shm too is refused its first lease, says why once, and applies that version
    whole over shm, and the next ones; a new one connects over shm at once, since the
    publisher's description says GPU staging stopped; one that offered only cuda_ipc gets
    the reason."""
    offered = [CudaIpcTransport(), "shm"]
    with WeightPublisher(None, transport=[CudaIpcTransport(), "shm"], bucket_bytes=BUCKET, timeout=30) as pub:
        mine = zeros()
        with WeightSubscriber(None, mine, transport=offered, publisher=pub.endpoint, timeout=10) as sub:
            sub._gpu_targets = True  # stands in for the CUDA tensors this box cannot make
            assert sub.poll() is None  # connected; nothing published yet
            assert sub._ranks is not None and sub._ranks.transport.name == "cuda_ipc"
            pub.publish(weights(1), 1)
            with caplog.at_level(logging.WARNING, logger="sluice.weight_sync"):
                assert sub.wait(1, timeout=30) == 1
                pub.publish(weights(2), 2)
                assert sub.wait(2, timeout=30) == 2
            assert sub._ranks.transport.name == "shm"
            assert all(torch.equal(mine[n], t) for n, t in weights(2).items())
            said = [r.getMessage() for r in caplog.records if "GPU staging stopped" in r.getMessage()]
            assert len(said) == 1 and "no CUDA" in said[0], said
        with WeightSubscriber(None, zeros(), transport=offered, publisher=pub.endpoint, timeout=10) as new:
            new._gpu_targets = True  # as above
            assert new.wait(2, timeout=30) == 2
            assert new._ranks is not None and new._ranks.transport.name == "shm"
        named = zeros()
        with WeightSubscriber(None, named, transport=CudaIpcTransport(), publisher=pub.endpoint, timeout=10) as sub:
            with pytest.raises(GpuStagingStoppedError, match="no CUDA"):
                sub.wait(2, timeout=30)
            assert sub.version == -1 and all(not t.any() for t in named.values())


def test_a_dead_publisher_is_reported_as_fast_with_a_spare_host_transport_as_without():
    """A subscriber on cuda_ipc that keeps shm spare falls back only when a rank refuses its
    lease because GPU staging stopped: a killed publisher is a lost connection, reported at
    once, not after asking the dead rank again (which would take the connect timeout,
    `DEAD_AFTER`); so both subscribers report it well within that."""
    commands, out = CTX.Queue(), CTX.Queue()
    offered = [("cuda_ipc", {}), "shm"]
    proc = CTX.Process(target=publisher, args=(out, commands, None, offered, {"bucket_bytes": BUCKET}), daemon=True)
    proc.start()
    endpoint = out.get(timeout=60)[1]
    with (
        WeightSubscriber(None, zeros(), transport=CudaIpcTransport(), publisher=endpoint, timeout=30) as alone,
        WeightSubscriber(None, zeros(), transport=[CudaIpcTransport(), "shm"], publisher=endpoint, timeout=30) as spare,
    ):
        for sub in (alone, spare):
            sub._gpu_targets = True  # stands in for the CUDA tensors this box cannot make
            assert sub.poll() is None  # connected; nothing published yet
            assert sub._ranks is not None and sub._ranks.transport.name == "cuda_ipc"
        kill(proc)
        for sub in (alone, spare):
            started = time.monotonic()
            with pytest.raises(WeightSyncError) as raised:
                sub.wait(1, timeout=30)
            took = time.monotonic() - started
            assert not isinstance(raised.value, GpuStagingStoppedError)
            assert took < DEAD_AFTER / 2, f"{took:.2f} s to report a dead publisher: {raised.value}"


def test_auto_offers_cuda_ipc_where_cuda_is():
    names = [t.name for t in resolve("auto")]
    assert ("cuda_ipc" in names) == torch.cuda.is_available()
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
def test_a_closed_publisher_gives_back_gpu_slots_that_two_subscriber_processes_opened():
    """Two subscriber processes open each GPU slot's CUDA IPC handle and drop it when they
    close; the publisher's close then gives the slots' memory back to PyTorch's allocator.
    Had the handles carried PyTorch's cross-process count (one per share, lowered by each
    opener), two openers would have taken it below zero and held the memory back until the
    publisher's process exits."""
    import gc
    import weakref

    pub = WeightPublisher(None, transport="cuda_ipc", bucket_bytes=BUCKET, model=_gpu(weights(0)))
    try:
        subs = Subscribers(2, pub.endpoint, "auto", device="cuda")
        for version in (1, 2, 3):
            pub.publish(_gpu(weights(version)), version)
            subs.wait_applied(version)
        for summary in subs.finish().values():
            check(summary, 3)
            assert summary["transport"] == "cuda_ipc"
        staged = sum(s.size for s in pub._table.slots if s.segment is not None)
        slot_tensors = [weakref.ref(s.segment.tensor) for s in pub._table.slots if s.segment is not None]
        allocated = torch.cuda.memory_allocated()
    finally:
        pub.close()
    gc.collect()
    torch.cuda.ipc_collect()
    assert slot_tensors and all(ref() is None for ref in slot_tensors), "a GPU slot's tensor outlived its publisher"
    freed = allocated - torch.cuda.memory_allocated()
    assert staged > 0 and freed >= staged, f"{freed} bytes freed of GPU staging's {staged}"


@pytest.mark.cuda
def test_closing_waits_for_the_readers_of_gpu_staging():
    """A closing publisher frees a GPU slot only once the reader holding it released its lease
    (the slot's memory is the trainer's again at once), and grants no lease meanwhile."""
    import threading

    pub = WeightPublisher(None, transport="cuda_ipc", bucket_bytes=BUCKET, model=_gpu(weights(0)))
    pub.publish(_gpu(weights(1)), 1)
    got = pub._table.lease(1)
    assert got is not None
    closed = threading.Event()
    closer = threading.Thread(target=lambda: (pub.close(), closed.set()))
    closer.start()
    try:
        deadline = time.monotonic() + 30
        while not pub._table._retired:  # close has begun waiting for its readers
            assert time.monotonic() < deadline, "close never retired GPU staging"
            time.sleep(0.01)
        assert not closed.is_set(), "the publisher closed under a reader"
        assert got[1].segment is not None and pub._table.lease(1) is None
    finally:
        pub._table.release(got[0])
    assert closed.wait(30)
    closer.join()
    assert got[1].segment is None


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


@pytest.mark.cuda
@pytest.mark.parametrize("weights_on", ["cuda", "cpu"])
def test_gpu_staging_beside_host_staging_serves_gpu_and_host_tensors(weights_on):
    """One publisher serving cuda_ipc beside shm: "auto" with `model=` of CUDA weights (the
    version staged before the first cuda_ipc lease copied to the GPU then, the next ones packed
    there by `publish`), or both named with CPU weights (each version copied to the GPU at its
    first lease). Two subscriber processes with GPU tensors read GPU staging, one with host
    tensors reads host staging, and all hold every version whole."""
    if weights_on == "cuda":
        place, transport = _gpu, "auto"
    else:
        place, transport = dict, [CudaIpcTransport(), "shm"]
    pub = WeightPublisher(None, transport=transport, bucket_bytes=BUCKET, timeout=30, model=place(weights(0)))
    try:
        pub.publish(place(weights(1)), 1)
        on_gpu = Subscribers(2, pub.endpoint, "auto", device="cuda")
        on_host = Subscribers(1, pub.endpoint, "auto", first_id=2)
        for version in range(1, 6):
            if version > 1:
                pub.publish(place(weights(version)), version)
            on_gpu.wait_applied(version)
            on_host.wait_applied(version)
        for subs, picked in ((on_gpu, "cuda_ipc"), (on_host, "shm")):
            for summary in subs.finish().values():
                check(summary, 5)
                assert summary["transport"] == picked
        assert pub._mirror is not None and pub._mirror.on and not pub._mirror.error
        assert all(s.segment is None or s.segment.tensor.is_cuda for s in pub._mirror.table.slots)
        assert all(not s.segment.tensor.is_cuda for s in pub._table.slots if s.segment is not None)
    finally:
        pub.close()


@pytest.mark.cuda
def test_without_gpu_memory_gpu_staging_stops_and_host_staging_goes_on(monkeypatch):
    """Packing a version into GPU staging finds no memory (here: the pack raises as an
    allocation would): the version still reaches host staging's readers, an "auto" reader of
    GPU staging applies it whole from host staging, one that named cuda_ipc is told why it
    gets no more versions, a new "auto" reader with GPU tensors connects over shm, and GPU
    staging lets go of its slots once nothing holds them (no tensor of theirs is left alive).
    Their memory is back in PyTorch's allocator once the readers closed (`memory_allocated`
    drops by the slots' bytes), though each slot was shared over CUDA IPC: the readers here are
    in the publisher's process and never opened the handle, which left PyTorch's own
    cross-process count above zero when it was handed on (`transfer_queue.cuda.ipc_share`)."""
    import gc
    import weakref

    from weight_sync import publisher as publisher_module

    pub = WeightPublisher(None, transport="auto", bucket_bytes=BUCKET, timeout=30, model=_gpu(weights(0)))
    on_gpu = {n: t.cuda() for n, t in zeros().items()}
    named = {n: t.cuda() for n, t in zeros().items()}
    on_host = zeros()
    try:
        with (
            WeightSubscriber(None, on_gpu, publisher=pub.endpoint, timeout=10) as gpu_sub,
            WeightSubscriber(None, named, transport="cuda_ipc", publisher=pub.endpoint, timeout=10) as named_sub,
            WeightSubscriber(None, on_host, publisher=pub.endpoint, timeout=10) as host_sub,
        ):
            pub.publish(_gpu(weights(1)), 1)
            assert gpu_sub.wait(1, timeout=30) == 1 and host_sub.wait(1, timeout=30) == 1
            assert named_sub.wait(1, timeout=30) == 1
            assert gpu_sub._ranks is not None and gpu_sub._ranks.transport.name == "cuda_ipc"
            pack = publisher_module.pack

            def no_memory(manifest, tensors, slot, *args):  # noqa: ANN001, ANN002
                if slot.is_cuda:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
                return pack(manifest, tensors, slot, *args)

            monkeypatch.setattr(publisher_module, "pack", no_memory)
            assert pub._mirror is not None
            staged = sum(s.size for s in pub._mirror.table.slots)
            slot_tensors = [weakref.ref(s.segment.tensor) for s in pub._mirror.table.slots if s.segment is not None]
            allocated = torch.cuda.memory_allocated()
            pub.publish(_gpu(weights(2)), 2)
            assert host_sub.wait(2, timeout=30) == 2
            assert all(torch.equal(on_host[n], t) for n, t in weights(2).items())
            assert gpu_sub.wait(2, timeout=30) == 2  # from host staging
            assert gpu_sub._ranks.transport.name == "shm"
            assert all(torch.equal(on_gpu[n].cpu(), t) for n, t in weights(2).items())
            with pytest.raises(GpuStagingStoppedError, match="no GPU memory"):
                named_sub.wait(2, timeout=30)
            assert all(torch.equal(named[n].cpu(), t) for n, t in weights(1).items())
            assert all(s.segment is None for s in pub._mirror.table.slots)
            before_new = torch.cuda.memory_allocated()
            new = {n: t.cuda() for n, t in zeros().items()}
            kept = torch.cuda.memory_allocated() - before_new  # the new reader's tensors, alive below
            with WeightSubscriber(None, new, publisher=pub.endpoint, timeout=10) as new_sub:
                assert new_sub.wait(2, timeout=30) == 2
                assert new_sub._ranks is not None and new_sub._ranks.transport.name == "shm"
                assert all(torch.equal(new[n].cpu(), t) for n, t in weights(2).items())
        gc.collect()
        torch.cuda.ipc_collect()
        assert slot_tensors and all(ref() is None for ref in slot_tensors), "a GPU slot's tensor outlived its slot"
        freed = allocated - torch.cuda.memory_allocated() + kept
        assert staged > 0
        assert freed >= staged, f"{freed} bytes freed of GPU staging's {staged}"
    finally:
        pub.close()
