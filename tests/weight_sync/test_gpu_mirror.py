"""GPU staging beside host staging (`gpu_mirror.GpuMirror`): its catch-up rules, run here with
the mirror's slots on the CPU (the same code; only the copy's stream is CUDA's on a GPU). A
catch-up waits for its host bytes and leaves a complete copy, never evicts a newer version, and
one that fails leaves its reason for the version's leases instead of copying again; a version
host staging does not hold starts nothing; `publish` never waits for GPU readers; no memory for a
slot (a slot larger than the device can allocate) stops GPU staging, which frees each slot once
nothing reads or writes it, says why (out of memory or not) and is never marked complete again.
The GPU run is `test_cuda_ipc.py`'s."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from transfer_queue import GpuStagingStoppedError
from weight_sync import CudaIpcTransport, WeightPublisher
from weight_sync.buckets import layout_buckets
from weight_sync.gpu_mirror import GpuMirror
from weight_sync.layout import Layout
from weight_sync.staging import SlotTable

NBYTES = 1 << 16
MANIFEST = layout_buckets([("w", torch.uint8, Layout.full((NBYTES,)))], 1 << 14)
TOO_LARGE = layout_buckets([("w", torch.uint8, Layout.full((1 << 50,)))], 1 << 30)
"""A model no device can allocate a slot for (a petabyte: past any address space)."""


@pytest.fixture
def tables():
    ids = itertools.count(1)
    host = SlotTable(2, shared=False, lease_timeout=30, ids=ids)
    mirror = GpuMirror(2, lease_timeout=30, ids=ids, timeout=5)
    mirror.table.device = torch.device("cpu")  # where a GPU's slots would be
    mirror.on = True  # as `turn_on` sets it where CUDA is
    yield host, mirror
    mirror.close()
    host.close()


def _stage(host: SlotTable, version: int, fill: int, complete: bool = True):  # noqa: ANN202 - a Slot
    slot = host.claim(version, NBYTES, 5)
    slot.manifest = MANIFEST
    slot.mapped.tensor.fill_(fill)
    if complete:
        host.advance(slot, NBYTES, complete=True)
    return slot


def _catch_up(mirror: GpuMirror, host: SlotTable, version: int) -> threading.Event:
    done = threading.Event()
    mirror.catch_up(host, version, None, done.set)
    return done


def test_a_catch_up_waits_for_the_host_bytes_and_leaves_a_complete_copy(tables):
    host, mirror = tables
    slot = _stage(host, 1, 7, complete=False)
    done = _catch_up(mirror, host, 1)
    assert mirror.on_its_way(1) and not done.is_set()  # its host bytes are still being staged
    host.advance(slot, NBYTES, complete=True)
    assert done.wait(10)
    mirror.finished(1)
    assert not mirror.on_its_way(1) and mirror.why(1) == ""
    got = mirror.table.lease(1)
    assert got is not None and got[1].complete and got[1].manifest is MANIFEST
    assert torch.equal(got[1].mapped.tensor[:NBYTES], torch.full((NBYTES,), 7, dtype=torch.uint8))
    assert not slot.leases  # the host slot's lease was released


def test_a_catch_up_never_evicts_a_newer_version(tables):
    """An older version is copied into a slot holding nothing newer; with only newer versions
    there, its copy fails at once with that reason (not retried: its leases are told)."""
    host, mirror = tables
    _stage(host, 1, 1)
    _stage(host, 2, 2)
    assert _catch_up(mirror, host, 2).wait(10)
    mirror.finished(2)
    assert _catch_up(mirror, host, 1).wait(10)  # the other slot is free: nothing newer evicted
    mirror.finished(1)
    assert mirror.table.find(1) is not None and mirror.table.find(2) is not None
    _stage(host, 3, 3)  # host staging's slot of version 1 is reused for 3
    assert _catch_up(mirror, host, 3).wait(10)  # evicts 1, the older
    mirror.finished(3)
    assert mirror.table.find(1) is None and {2, 3} == {s.version for s in mirror.table.slots}
    older = SlotTable(2, shared=False, lease_timeout=30)
    slot = older.claim(0, NBYTES, 5)
    slot.manifest = MANIFEST
    older.advance(slot, NBYTES, complete=True)
    assert _catch_up(mirror, older, 0).wait(10)
    mirror.finished(0)
    assert "only newer versions" in mirror.why(0)
    assert {2, 3} == {s.version for s in mirror.table.slots}
    older.close()


def test_a_failed_catch_up_leaves_its_reason_and_is_not_retried(tables):
    host, mirror = tables
    _stage(host, 1, 1)
    mirror.timeout = 0.2
    for version in (5, 6):  # readers pin both GPU slots (versions still staging: not newer ones held)
        slot = mirror.table.claim(version, NBYTES, 1)
        mirror.table.advance(slot, NBYTES, complete=False)
        assert mirror.table.lease(version) is not None
    assert _catch_up(mirror, host, 1).wait(10)
    mirror.finished(1)
    assert "copying it to GPU staging failed" in mirror.why(1)
    again = _catch_up(mirror, host, 1)
    assert not mirror.on_its_way(1) and not again.is_set()  # nothing started: its leases fail with `why`
    assert mirror.error == ""  # not for lack of memory: later versions are copied


def test_a_version_host_staging_does_not_hold_starts_nothing(tables):
    host, mirror = tables
    _stage(host, 1, 1)
    done = _catch_up(mirror, host, 9)
    assert not mirror.on_its_way(9) and not done.is_set()  # a copy started would be on its way


def test_publish_never_waits_for_gpu_readers(tables):
    """With readers on every GPU slot, `publish`'s claim gets none at once (the version is staged
    on the host alone; a catch-up brings it over later) rather than holding host staging's
    readers up behind them."""
    _, mirror = tables
    for version in (1, 2):
        slot = mirror.claim(version, MANIFEST)
        assert slot is not None
        mirror.table.advance(slot, NBYTES, complete=True)
        assert mirror.table.lease(version) is not None
    assert mirror.claim(3, MANIFEST) is None


def test_no_memory_for_a_slot_stops_gpu_staging_and_frees_each_slot_once_let_go():
    """The allocator refuses a GPU slot: GPU staging stops with the reason; the slot no one
    holds is freed at once, the one a reader leased once it is released (its reader reads it
    whole until then), and the one a pack is still writing once its publisher marks it; no
    slot is allocated or claimed again, and no catch-up starts."""
    host = SlotTable(1, shared=False, lease_timeout=30)
    mirror = GpuMirror(4, lease_timeout=30, ids=itertools.count(1), timeout=5)
    mirror.table.device = torch.device("cpu")  # where a GPU's slots would be
    mirror.on = True  # as `turn_on` sets it where CUDA is
    try:
        read, idle, packing = (mirror.claim(version, MANIFEST) for version in (1, 2, 3))
        assert read is not None and idle is not None and packing is not None
        for slot, fill in ((read, 1), (idle, 2)):
            slot.mapped.tensor.fill_(fill)
            mirror.table.advance(slot, NBYTES, complete=True)
        mirror.table.advance(packing, NBYTES // 2)  # a pack still writing its second half
        lease = mirror.table.lease(1)
        assert lease is not None
        assert mirror.claim(4, TOO_LARGE) is None
        # the CPU allocator's refusal is a RuntimeError, not torch.OutOfMemoryError
        assert mirror.error.startswith("allocating GPU staging on cpu failed: "), mirror.error
        assert idle.segment is None and mirror.table.find(2) is None
        assert read.segment is not None and packing.segment is not None
        assert torch.equal(read.mapped.tensor, torch.full((NBYTES,), 1, dtype=torch.uint8))
        mirror.table.release(lease[0])
        assert read.segment is None
        mirror.table.advance(packing, NBYTES, complete=True)
        assert packing.segment is None
        assert all(s.segment is None for s in mirror.table.slots)
        assert mirror.claim(5, MANIFEST) is None
        mirror.table.prepare(NBYTES)
        assert all(s.segment is None for s in mirror.table.slots)
        _stage(host, 5, 5)
        done = _catch_up(mirror, host, 5)
        assert not mirror.on_its_way(5) and not done.is_set()
    finally:
        mirror.close()
        host.close()


def test_gpu_staging_stopped_for_lack_of_memory_says_so(tables):
    """Only the allocator's out-of-memory error reads as "no GPU memory"; leases are refused
    with `GpuStagingStoppedError` and the reason."""
    _, mirror = tables
    mirror.stop(torch.OutOfMemoryError("CUDA out of memory (test)"))
    assert mirror.error.startswith("no GPU memory to stage versions on cpu: "), mirror.error
    with pytest.raises(GpuStagingStoppedError, match="no GPU memory"):
        mirror.turn_on()


def test_a_version_whose_gpu_pack_found_no_memory_is_not_marked_complete_in_its_freed_gpu_slot():
    """`publish` fails the GPU slot of a version whose pack found no memory (`_stage`), which
    frees it: GPU staging stopped. The finisher then completes the version in host staging
    alone, and leaves the freed GPU slot empty rather than mark it complete."""
    with WeightPublisher(None, transport=[CudaIpcTransport(), "shm"], bucket_bytes=1 << 14, timeout=30) as pub:
        mirror = pub._mirror
        assert mirror is not None
        mirror.table.device = torch.device("cpu")  # where a GPU's slots would be
        mirror.on = True  # as `turn_on` sets it where CUDA is
        gpu = mirror.claim(1, MANIFEST)
        assert gpu is not None
        mirror.stop(torch.OutOfMemoryError("CUDA out of memory (test)"))  # as `_stage` does
        mirror.table.fail(gpu)
        assert gpu.segment is None
        host = pub._table.claim(1, NBYTES, 5)
        host.manifest = MANIFEST
        pub._finish(host, 1, True, None, gpu)
        assert host.complete and host.version == 1
        assert not gpu.complete and gpu.version == -1 and gpu.segment is None


def test_a_catch_up_that_finds_no_memory_stops_gpu_staging_and_frees_its_slots(tables):
    """The copier thread's claim is refused memory: the version's leases are told why, and
    the slot holding an earlier copy is freed."""
    host, mirror = tables
    _stage(host, 1, 1)
    assert _catch_up(mirror, host, 1).wait(10)
    mirror.finished(1)
    big = host.claim(2, NBYTES, 5)
    big.manifest = TOO_LARGE  # a version no device has room for: the copy's claim is refused
    host.advance(big, TOO_LARGE.nbytes, complete=True)
    assert _catch_up(mirror, host, 2).wait(10)
    mirror.finished(2)
    assert "allocating GPU staging" in mirror.why(2) and "allocating GPU staging" in mirror.error
    assert all(s.segment is None for s in mirror.table.slots)
