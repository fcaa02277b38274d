"""Staging is allocated when the publisher is built from the model's tensors (or meta tensors of
their shapes), not inside the first `publish`; a version published then arrives whole. Without
the model, the first `publish` allocates its own slot and the others on a thread. A co-located
subscriber's first poll maps those slots and plans its reads, before any version exists. A
preparation that fails hands its error to its owner; registering the slots with CUDA holds up
no lease, and no slot is replaced or unmapped while it is registered. Nor does a claim that
allocates its slot's memory hold up a lease; a close or retire meanwhile frees what it made,
and an allocation that fails leaves the slot free."""

from __future__ import annotations

import threading
import types
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import transfer_queue as tq
import weight_sync.publisher as publisher_module
import weight_sync.staging as staging
from transfer_queue.cuda import HostRegistry
from weight_sync import WeightPublisher, WeightSubscriber
from weight_sync.staging import Segment, SlotTable

from .harness import Subscribers, check, no_segments_left
from .workers import BUCKET, SHAPES, weights


def _segments(pub: WeightPublisher) -> list[tuple[int, int]]:
    """(generation, bytes) of every staging slot."""
    return [(s.generation, s.size) for s in pub._table.slots]


def test_staging_is_allocated_when_the_publisher_is_built():
    meta = {name: torch.empty(shape, dtype=torch.bfloat16, device="meta") for name, shape in SHAPES.items()}
    nbytes = sum(t.numel() * 2 for t in meta.values())
    pub = WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=2, model=meta)
    subs = Subscribers(1, pub.endpoint, "shm")
    try:
        built = _segments(pub)
        assert all(gen == 1 and size >= nbytes for gen, size in built), built
        for version in (1, 2, 3):
            pub.publish(weights(version), version)
        subs.wait_applied(3)
        assert _segments(pub) == built, "publish allocated staging the publisher had prepared"
        (summary,) = subs.finish().values()
        check(summary, 3)
    finally:
        pub.close()
    no_segments_left()


def test_a_subscribers_first_poll_maps_the_prepared_slots():
    model = weights(0)
    mine = {n: torch.zeros_like(t) for n, t in model.items()}
    with (
        WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=2, model=model) as pub,
        WeightSubscriber(None, mine, publisher=pub.endpoint) as sub,
    ):
        assert sub.poll() is None  # no version yet: it connects and maps
        transport = sub._ranks.transport
        assert sorted(transport._maps) == [(0, 0), (0, 1)]
        assert len(sub._ranks._plans) == 1, "the reads of the prepared manifest were not planned ahead"
        mapped = {key: held[2] for key, held in transport._maps.items()}
        for version in (1, 2):
            pub.publish(weights(version), version)
            assert sub.wait(version, timeout=30) == version
            assert all(torch.equal(mine[n], t) for n, t in weights(version).items())
        assert all(transport._maps[key][2] is view for key, view in mapped.items()), "remapped a slot"


def test_a_module_prepares_staging_too():
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with WeightPublisher(None, transport="tcp", slots=1, model=model) as pub:
        (before,) = _segments(pub)
        assert before[0] == 1 and before[1] >= (64 * 32 + 32) * 2
        pub.publish(model.state_dict(), 1)
        assert _segments(pub) == [before]


def test_without_the_model_the_first_publish_allocates():
    with WeightPublisher(None, transport="tcp", slots=1) as pub:
        assert _segments(pub) == [(0, 0)]
        pub.publish(weights(1), 1)
        assert _segments(pub)[0][0] == 1


def test_without_the_model_the_other_slots_are_allocated_in_the_background():
    nbytes = sum(t.numel() * 2 for t in weights(0).values())
    pub = WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=3)
    subs = Subscribers(1, pub.endpoint, "shm")
    try:
        pub.publish(weights(1), 1)
        assert pub._preparing is not None
        pub._preparing.join(timeout=60)
        prepared = _segments(pub)
        assert all(gen == 1 and size >= nbytes for gen, size in prepared), prepared
        for version in (2, 3, 4):
            pub.publish(weights(version), version)
        subs.wait_applied(4)
        assert _segments(pub) == prepared, "a later publish allocated a slot prepared in the background"
        (summary,) = subs.finish().values()
        check(summary, 4)
    finally:
        pub.close()
    no_segments_left()


def test_a_slot_is_not_claimed_again_before_its_version_is_finished():
    """Publish v and at once v+1: v's slot is taken by neither while v's finisher has still to
    mark it complete (it would mark v+1 complete half-staged, a torn version for readers)."""
    two = SlotTable(2, shared=False, lease_timeout=5)
    try:
        first = two.claim(1, 4096, timeout=5)
        assert two.claim(2, 4096, timeout=5) is not first
    finally:
        two.close()
    one = SlotTable(1, shared=False, lease_timeout=5)
    try:
        slot = one.claim(1, 4096, timeout=5)
        with pytest.raises(tq.TimeoutError):
            one.claim(2, 4096, timeout=0.2)
        finished = threading.Thread(target=one.advance, args=(slot, 4096, True))
        finished.start()
        assert one.claim(2, 4096, timeout=30) is slot and slot.version == 2 and not slot.complete
        finished.join()
    finally:
        one.close()


def test_a_replaced_slot_is_read_anew_not_through_views_of_the_old_one():
    """Publisher and subscriber reuse their views into a slot from version to version; once the
    slot grows (a new segment, a new generation, a new manifest) or its manifest changes, both
    make them anew: views of the old mapping or layout would touch stale or unmapped memory."""
    small = {"a": torch.zeros(64, dtype=torch.bfloat16)}
    mine = {"a": torch.zeros(64, dtype=torch.bfloat16)}
    with (
        WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=1, model=small) as pub,
        WeightSubscriber(None, mine, publisher=pub.endpoint) as sub,
    ):
        sub.poll()
        for version, extra in ((1, 0), (2, 0), (3, 1 << 20), (4, 0), (5, 0)):
            tensors = {"a": torch.full((64,), float(version), dtype=torch.bfloat16)}
            if extra:  # a tensor the subscriber does not hold: the slot grows for it
                tensors["b"] = torch.ones(extra, dtype=torch.bfloat16)
            pub.publish(tensors, version)
            assert sub.wait(version, timeout=30) == version
            assert torch.equal(mine["a"], tensors["a"]), f"version {version} applied stale bytes"
        assert pub._table.slots[0].generation == 2, "the slot did not grow: this test tests nothing"
        assert len(sub._receiver._views) == 1, "views of the replaced slot were kept"


def test_a_publish_interrupted_after_its_claim_frees_the_slot(monkeypatch):
    """Whatever stops a publish once its slot is claimed (here an interrupt in the copy) fails
    that version and frees the slot: the next publish into the only slot goes ahead."""
    real = publisher_module.pack

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    mine = {n: torch.zeros_like(t) for n, t in weights(0).items()}
    with WeightPublisher(None, transport="shm", slots=1, bucket_bytes=BUCKET, timeout=5, model=weights(0)) as pub:
        monkeypatch.setattr(publisher_module, "pack", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pub.publish(weights(1), 1)
        monkeypatch.setattr(publisher_module, "pack", real)
        pub.publish(weights(2), 2)
        with WeightSubscriber(None, mine, publisher=pub.endpoint) as sub:
            assert sub.wait(2, timeout=30) == 2
            assert all(torch.equal(mine[n], t) for n, t in weights(2).items())


def test_a_claim_that_keeps_newer_versions_takes_only_an_older_slot():
    """`claim(keep_newer=True)` (a copy of an older version into GPU staging) takes a slot holding
    nothing newer, and refuses at once when every slot holds a newer complete version."""
    table = SlotTable(2, shared=False, lease_timeout=5)
    try:
        for version in (3, 5):
            slot = table.claim(version, 64, 1)
            table.advance(slot, 64, complete=True)
        with pytest.raises(tq.WeightSyncError, match="only newer versions than 2"):
            table.claim(2, 64, 5, keep_newer=True)
        slot = table.claim(4, 64, 1, keep_newer=True)  # 3 is older: its slot is taken, 5 kept
        assert slot.version == 4 and table.find(5) is not None and table.find(3) is None
    finally:
        table.close()


def test_a_preparation_that_fails_hands_its_error_to_its_owner():
    """No memory for the slots (a petabyte each): the thread ends with the error handed to
    `failed`, not escaping it; nothing was allocated."""
    table = SlotTable(2, shared=False, lease_timeout=5)
    failed: list[Exception] = []
    try:
        table.prepare_in_background(1 << 50, failed.append).join(timeout=30)
        assert len(failed) == 1 and isinstance(failed[0], OSError)  # mmap: no memory
        assert all(s.segment is None for s in table.slots)
    finally:
        table.close()


def test_registering_staging_with_cuda_holds_up_no_lease(monkeypatch):
    """`pin_all` registers the slots outside the table's lock: a lease and a release go on
    while it runs, a claim waits for the slot being registered rather than replace its
    segment, and a close during the registration leaves the unmapping of the slots being
    registered to it."""
    table = SlotTable(2, shared=True, lease_timeout=30)
    slot = table.claim(1, 4096, 5)
    table.advance(slot, 4096, complete=True)
    table.prepare(4096)
    registering, registered = threading.Event(), threading.Event()

    def register(self, ptr: int, nbytes: int, read_only: bool = False) -> bool:  # noqa: ARG001
        registering.set()  # cudaHostRegister, which this box has not: as slow as told
        return registered.wait(30)

    monkeypatch.setattr(HostRegistry, "register", register)
    pinning = threading.Thread(target=table.pin_all)
    pinning.start()
    try:
        assert registering.wait(30)
        leased = threading.Event()
        reader = threading.Thread(target=lambda: (table.release(table.lease(1)[0]), leased.set()))
        reader.start()
        assert leased.wait(10), "a lease waited for the registration"
        with pytest.raises(tq.TimeoutError):
            table.claim(2, 4096, 0.2)  # the free slot is being registered: not replaced meanwhile
        table.close()
        assert all(s.segment is not None for s in table.slots), "unmapped while being registered"
    finally:
        registered.set()
        pinning.join(timeout=30)
    assert all(s.segment is None for s in table.slots), "the registration unmaps what close left it"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The staging tables' clock, moved by hand: `clock[0] += seconds`."""
    now = [1000.0]
    monkeypatch.setattr(staging, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_a_retired_slot_whose_lease_expired_unreleased_is_freed_at_the_next_release(clock):
    """A retired table frees a slot still leased once that lease is released; one whose reader
    never releases it (its release lost) is freed at the table's next release of any lease
    after it expired. The clock is the table's, moved by hand."""
    table = SlotTable(2, shared=False, lease_timeout=30)
    try:
        slot = table.claim(1, 4096, 5)
        table.advance(slot, 4096, complete=True)
        got = table.lease(1)
        assert got is not None
        table.retire()
        assert slot.segment is not None  # its reader holds it
        table.release(0)  # no such lease: nothing to free yet, the lease holds
        assert slot.segment is not None
        clock[0] += 31  # the lease expires, unreleased
        table.release(0)  # any release, e.g. another reader's of host staging through the publisher
        assert slot.segment is None
    finally:
        table.close()


def test_a_retired_table_grants_no_lease_and_tells_when_its_readers_let_go(clock):
    """What a closing publisher waits on before GPU staging goes back to the allocator: a
    retired table leases nothing more, and is freed once its last reader releases its lease
    or that lease expires. The clock is the table's, moved by hand."""
    table = SlotTable(2, shared=False, lease_timeout=30)
    try:
        for version in (1, 2):
            table.advance(table.claim(version, 4096, 5), 4096, complete=True)
        first, second = table.lease(1), table.lease(2)
        assert first is not None and second is not None
        table.retire()
        assert table.lease(1) is None and table.lease(2) is None
        assert not table.wait_freed(0)  # both slots are read
        table.release(first[0])
        assert first[1].segment is None and second[1].segment is not None
        assert not table.wait_freed(0)
        clock[0] += 31  # the other reader's lease expires, unreleased
        assert table.wait_freed(0)
        assert second[1].segment is None
    finally:
        table.close()


def test_a_lease_holds_its_slot_while_renewed_and_says_when_it_was_reclaimed(clock):
    """A stream that makes progress renews its lease, so the slot is not reused under it
    however long the whole version takes. A lease that expired while nothing claimed its slot
    still vouches for its reads (renewed, released as held); once the slot is claimed again,
    neither (what was read under it may hold the next version). The clock is the table's,
    moved by hand."""
    table = SlotTable(1, shared=False, lease_timeout=30)
    try:
        table.advance(table.claim(1, 4096, 5), 4096, complete=True)
        first, second = table.lease(1), table.lease(1)
        assert first is not None and second is not None
        lease, slot = first
        for _ in range(3):  # 60 s in all, 20 s between pieces
            clock[0] += 20
            assert table.renew(lease)
        assert slot.busy(clock[0] + 29)  # 30 s from the last renewal, not from the grant
        clock[0] += 31
        assert table.renew(lease)  # expired, but the slot still holds version 1
        assert table.release(lease)
        assert not table.release(lease)  # released already
        clock[0] += 31  # the second lease expires too
        table.advance(table.claim(2, 4096, 5), 4096, complete=True)  # the slot's next version
        assert not table.renew(second[0]) and not table.release(second[0])
    finally:
        table.close()


def test_a_registration_that_fails_hands_every_slot_back(monkeypatch):
    table = SlotTable(2, shared=False, lease_timeout=30)
    try:
        for version in (1, 2):
            table.advance(table.claim(version, 4096, 5), 4096, complete=True)

        def refuse(self: Segment) -> bool:
            raise RuntimeError("cudaHostRegister failed (test)")

        monkeypatch.setattr(Segment, "pin", refuse)
        with pytest.raises(RuntimeError, match="test"):
            table.pin_all()
        assert not table._in_hand
        monkeypatch.undo()
        assert table.claim(3, 4096, 5) is not None  # nothing waits for a slot left in hand
    finally:
        table.close()


class _Making:
    """From now on, `Segment`s the tables make block, once begun, until `go` is set: allocating
    and faulting in a model's size takes seconds. `made` holds the ones made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.begun, self.go = threading.Event(), threading.Event()
        self.made: list[Segment] = []
        making = self

        class Slow(Segment):
            def __init__(self, *args: Any, **kwargs: Any):
                making.begun.set()
                making.go.wait(30)
                super().__init__(*args, **kwargs)
                making.made.append(self)

        monkeypatch.setattr(staging, "Segment", Slow)


def test_a_claim_that_allocates_its_slot_holds_up_no_lease(monkeypatch):
    """A claim makes a new segment outside the table's lock: another reader's lease, look-up and
    release go on meanwhile (the publisher's control thread makes them for its subscribers,
    who would take a publisher that stalls for seconds for a dead one). The slot being made is
    claimed already: no lease is granted on it and another claim takes the other slot."""
    table = SlotTable(2, shared=True, lease_timeout=30)
    try:
        held = table.claim(1, 4096, 5)
        table.advance(held, 4096, complete=True)
        making = _Making(monkeypatch)
        with ThreadPoolExecutor(3) as pool:
            try:
                claim = pool.submit(table.claim, 2, 8192, 5)
                assert making.begun.wait(30)

                def read() -> bool:
                    got = table.lease(1)
                    assert got is not None
                    assert table.leased(got[0]) is held
                    table.release(got[0])
                    return table.lease(2) is None  # being made: not leased before its segment is in

                assert pool.submit(read).result(timeout=10), "a lease was granted on a slot without its segment"
                assert pool.submit(table.claim, 3, 4096, 5).result(timeout=10) is held
            finally:
                making.go.set()
            slot = claim.result(timeout=30)
        assert slot is not held and slot.segment is making.made[-1] and slot.size == 8192
        assert slot.version == 2 and slot.generation == 1 and not table._in_hand
        assert table.lease(2) is not None
    finally:
        table.close()


@pytest.mark.parametrize(("end", "error"), [("close", tq.ClosedError), ("retire", tq.WeightSyncError)])
def test_a_close_or_retire_while_a_claim_allocates_frees_what_it_made(monkeypatch, end, error):
    """The only slot grows (its old segment freed first) while the table is closed or retired:
    that returns at once, the new segment is freed once made, and the claim raises what a claim
    of a closed or retired table raises; no slot is left in hand or holding a version."""
    table = SlotTable(1, shared=True, lease_timeout=30)
    try:
        slot = table.claim(1, 4096, 5)
        table.advance(slot, 4096, complete=True)
        old = slot.segment
        making = _Making(monkeypatch)
        with ThreadPoolExecutor(2) as pool:
            try:
                claim = pool.submit(table.claim, 2, 8192, 5)
                assert making.begun.wait(30)
                pool.submit(getattr(table, end)).result(timeout=10)
            finally:
                making.go.set()
            with pytest.raises(error):
                claim.result(timeout=30)
        new = making.made[-1]
        assert old is not None and old.fd == -1 and not hasattr(old, "tensor"), "the old segment was not freed"
        assert new.fd == -1 and not hasattr(new, "tensor"), "the new segment outlived the table"
        assert slot.segment is None and slot.version == -1 and not table._in_hand
        with pytest.raises(error):
            table.claim(3, 4096, 5)
    finally:
        table.close()


def test_a_claim_whose_allocation_fails_leaves_its_slot_free():
    """No memory for the grown slot (a petabyte): the claim raises the allocator's error; the
    slot's old version is gone (its memory was freed first) and nothing leases it, no slot is
    in hand, and the next claim takes the slot."""
    table = SlotTable(1, shared=False, lease_timeout=30)
    try:
        slot = table.claim(1, 4096, 5)
        table.advance(slot, 4096, complete=True)
        with pytest.raises(OSError):  # mmap: no memory
            table.claim(2, 1 << 50, 5)
        assert slot.segment is None and not table._in_hand
        assert table.find(1) is None and table.find(2) is None and table.lease(1) is None
        assert table.claim(3, 4096, 5) is slot and slot.size == 4096 and slot.version == 3
    finally:
        table.close()
