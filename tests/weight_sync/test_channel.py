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


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tensors_that_do_not_fit_what_is_published_get_a_schema_error_every_time(transport):
    """A subscriber holding a tensor of another dtype, or a name nothing published maps to,
    gets `SchemaError` naming it from `wait` and from every `poll` after, its tensors untouched,
    over any transport (over tcp it came back wrapped as `WeightSyncError` once, then `poll`
    said None as if nothing were wrong). A subscriber that fits takes the version meanwhile."""
    import torch

    from transfer_queue import SchemaError
    from weight_sync import WeightSubscriber

    from .workers import zeros

    wrong_dtype = {n: t.float() if i == 0 else t for i, (n, t) in enumerate(zeros().items())}
    wrong_name = {f"{n}.renamed" if i == 0 else n: t for i, (n, t) in enumerate(zeros().items())}
    with WeightPublisher(None, transport=transport, bucket_bytes=BUCKET) as pub:
        pub.publish(weights(1), 1)
        for mine, why in ((wrong_dtype, "held as torch.float32"), (wrong_name, "no published tensor maps to")):
            with WeightSubscriber(None, mine, transport=transport, publisher=pub.endpoint) as sub:
                with pytest.raises(SchemaError, match=why):
                    sub.wait(1, timeout=30)
                for _ in range(3):
                    with pytest.raises(SchemaError, match=why):
                        sub.poll()
                assert sub.version == -1 and all(not t.any() for t in mine.values())
        with WeightSubscriber(None, fits := zeros(), transport=transport, publisher=pub.endpoint) as sub:
            assert sub.wait(1, timeout=30) == 1
        assert all(torch.equal(fits[n], t) for n, t in weights(1).items())


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


def test_a_version_the_trainer_moved_past_before_its_lease_is_no_error(monkeypatch):
    """A tcp subscriber is offered version 1, and before it leases it the trainer publishes 2
    and 3, whose staging takes 1's slot: the refused lease is no failure of the transfer (a
    trainer that publishes faster than a subscriber pulls does this), so `wait` raises nothing
    and the subscriber takes version 3, exact."""
    import torch

    from weight_sync import WeightSubscriber
    from weight_sync.ranks import PublisherRanks

    from .workers import zeros

    real = PublisherRanks.lease_all
    raced: list[int] = []

    def leased_late(self, version, first=None):  # noqa: ANN001, ANN202
        if not raced:
            raced.append(version)
            for newer in (version + 1, version + 2):
                pub.publish(weights(newer), newer)
        return real(self, version, first)

    monkeypatch.setattr(PublisherRanks, "lease_all", leased_late)
    with WeightPublisher(None, transport="tcp", bucket_bytes=BUCKET, delta=False) as pub:
        pub.publish(weights(1), 1)
        mine = zeros()
        with WeightSubscriber(None, mine, transport="tcp", publisher=pub.endpoint) as sub:
            assert sub.wait(3, timeout=30) == 3
        assert raced == [1]
        assert all(torch.equal(mine[n], t) for n, t in weights(3).items())


@pytest.mark.parametrize("slots", [1, 2], ids=["slot-staged-again", "slot-kept"])
def test_copies_that_outlast_their_lease(monkeypatch, slots):
    """An shm subscriber stalls in its copies past its lease (60 s by default: a process stopped
    or swapped out) while the trainer publishes version 2. With one slot, version 2 is staged in
    the slot being read: when the subscriber releases its lease the rank says so, and the apply,
    which may have copied part of version 2, is not taken for version 1 (`wait` raises,
    `version` is -1); the next apply brings version 2 whole. With two, version 1's slot stays as
    it was: a lease only pins a slot, so the slow apply is version 1, whole."""
    import time

    import torch

    from transfer_queue import WeightSyncError
    from weight_sync import WeightSubscriber, receivers

    from .workers import zeros

    real = receivers.copy_each
    stalled: list[int] = []

    def stalled_copies(dsts, srcs, non_blocking=False):  # noqa: ANN001, ANN202
        if not stalled:
            stalled.append(len(dsts))
            pub.publish(weights(2), 2)  # one slot: it waits for this copy's lease to expire
            expired = lambda: not any(s.busy(time.monotonic()) for s in pub._table.slots)  # noqa: E731
            eventually(expired, 10, "this copy's lease expired")
        return real(dsts, srcs, non_blocking=non_blocking)

    monkeypatch.setattr(receivers, "copy_each", stalled_copies)
    with WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=slots, lease_timeout=0.5) as pub:
        pub.publish(weights(1), 1)
        mine = zeros()
        with WeightSubscriber(None, mine, transport="shm", publisher=pub.endpoint) as sub:
            if slots == 1:
                with pytest.raises(WeightSyncError, match="staged again under it"):
                    sub.wait(1, timeout=30)
                assert sub.version == -1
            else:
                assert sub.wait(1, timeout=30) == 1
                assert all(torch.equal(mine[n], t) for n, t in weights(1).items())
            assert stalled and sub.wait(2, timeout=30) == 2
        assert all(torch.equal(mine[n], t) for n, t in weights(2).items())


def test_a_mapping_subscriber_that_asks_while_the_only_slot_is_staged_again_takes_the_next_version(monkeypatch):
    """With one slot, the trainer stages version 2 over version 1 while an shm subscriber asks
    for the newest version. Version 1 can no longer be leased, so it is not offered: `poll`
    finds nothing new, and `wait` waits for version 2 and applies it whole (the lease on
    version 1 was refused with `WeightSyncError` before, ending the wait)."""
    import threading

    import torch

    from weight_sync import WeightSubscriber, publisher

    from .workers import zeros

    real = publisher.pack
    packed: list[int] = []
    gate = threading.Event()

    def held(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        packed.append(1)
        if len(packed) == 2:  # version 2's staging, its slot claimed: held until the subscriber waits
            assert gate.wait(30)
        return real(*args, **kwargs)

    def let_go() -> None:
        try:
            eventually(lambda: pub._coordinator.waiters, 30, "the subscriber's request parked")
        finally:
            gate.set()

    monkeypatch.setattr(publisher, "pack", held)
    with WeightPublisher(None, transport="shm", bucket_bytes=BUCKET, slots=1) as pub:
        pub.publish(weights(1), 1)
        staging = threading.Thread(target=pub.publish, args=(weights(2), 2), daemon=True)
        staging.start()
        eventually(lambda: pub._table.newest() == 2, 10, "version 2's slot claimed")
        mine = zeros()
        with WeightSubscriber(None, mine, transport="shm", publisher=pub.endpoint) as sub:
            assert sub.poll() is None and sub.version == -1
            threading.Thread(target=let_go, daemon=True).start()
            assert sub.wait(1, timeout=30) == 2
        staging.join(30)
        assert gate.is_set() and not staging.is_alive()
    assert all(torch.equal(mine[n], t) for n, t in weights(2).items())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_wait_without_a_deadline_waits_and_leaves_the_channel_serving(transport):
    """`wait(v, timeout=math.inf)` parks its request at rank 0 with no deadline. It waits
    until the version comes (a deadline beyond what the control server's poll can take in
    milliseconds once killed that server, and with it the channel for every subscriber), and
    others are served meanwhile. A NaN timeout is refused."""
    import math
    import threading

    from transfer_queue import SchemaError
    from weight_sync import WeightSubscriber

    from .workers import zeros

    with WeightPublisher(None, transport=transport, bucket_bytes=BUCKET) as pub:
        patient = WeightSubscriber(None, zeros(), transport=transport, publisher=pub.endpoint)
        got: list[int] = []
        waiting = threading.Thread(target=lambda: got.append(patient.wait(1, timeout=math.inf)), daemon=True)
        waiting.start()
        eventually(lambda: pub._coordinator.waiters, 30, "the request parked at rank 0")
        with pytest.raises(SchemaError, match="NaN"):
            WeightSubscriber(None, zeros(), transport=transport, publisher=pub.endpoint).wait(1, timeout=math.nan)
        pub.publish(weights(1), 1)
        waiting.join(30)
        assert got == [1]
        with WeightSubscriber(None, zeros(), transport=transport, publisher=pub.endpoint) as other:
            pub.publish(weights(2), 2)
            assert other.wait(2, timeout=30) == 2 and patient.wait(2, timeout=30) == 2
        patient.close()


def test_a_stream_that_stalls_past_its_lease_breaks_off(monkeypatch, caplog):
    """A tcp stream's lease lasts while it makes progress (each piece renews it). One that
    stalls past it in its last piece (its reader stopped reading), while the trainer's next
    version takes the only slot, breaks off instead of sending that piece from a slot that now
    holds version 2: the subscriber discards the version with `WeightSyncError`, its tensors
    untouched, and then takes version 2 whole. The publisher says why in a warning."""
    import threading

    from weight_sync import publisher

    real_open, real_gather = publisher._SlotSource.open, publisher.gather
    pieces: list[int] = []  # version 1's stream: [its pieces, pieces gathered so far]
    replaced = threading.Event()
    made: dict = {}

    def counted(self, request):  # noqa: ANN001, ANN202
        if request.version == 1:
            pieces[:] = [sum(len(publisher.read_chunks(read)) for read in request.reads), 0]
        return real_open(self, request)

    def stalled_last(slot, read, box, scratch):  # noqa: ANN001, ANN202
        if not replaced.is_set():  # version 1's one stream
            pieces[1] += 1
            if pieces[1] == 1:  # the trainer publishes version 2: it waits for this stream's lease
                publish = lambda: (made["pub"].publish(weights(2), 2), replaced.set())  # noqa: E731
                threading.Thread(target=publish, daemon=True).start()
            if pieces[1] == pieces[0]:  # the last piece stalls until the slot holds version 2
                assert replaced.wait(30)
        return real_gather(slot, read, box, scratch)

    monkeypatch.setattr(publisher._SlotSource, "open", counted)
    monkeypatch.setattr(publisher, "gather", stalled_last)
    _never_version_1("tcp", "closed the stream early", made)
    assert pieces[0] > 1 and "on version 1 ended while it was sent" in caplog.text


@pytest.mark.skipif(not NixlTransport.is_available(), reason="nixl is not installed")
def test_reads_that_outlast_their_lease_are_not_taken_for_a_version(monkeypatch):
    """A nixl subscriber READs the publisher's slot with no server on the other side to notice
    a stall. Its READ starts only after its lease expired and the trainer's next version took
    the only slot: when it releases the lease, the rank says the slot was staged again under
    it, so the bytes are discarded (the tensors untouched) and version 2 is pulled whole."""
    real = NixlTransport.receive
    stalled: list[int] = []
    made: dict = {}

    def late_read(self, job):  # noqa: ANN001, ANN202
        if not stalled:
            stalled.append(job.version)
            made["pub"].publish(weights(2), 2)  # the only slot, leased to this read: reused once the lease expires
        return real(self, job)

    monkeypatch.setattr(NixlTransport, "receive", late_read)
    _never_version_1("nixl", "staged again under it", made)
    assert stalled == [1]


def _never_version_1(transport: str, why: str, made: dict) -> None:
    """Publish version 1 over `transport` with one slot and a 0.5 s lease, for one subscriber
    (the test's hooks reach the publisher as `made["pub"]`, and publish version 2 into that slot
    while version 1 is read from it). Version 1 is never applied: `wait(1)` raises (`why`) with
    the tensors untouched, or, where the receiver's retry already pulled version 2 whole before
    the caller looked (the error is then moot), returns 2. Version 2 is then applied whole."""
    import torch

    from transfer_queue import WeightSyncError
    from weight_sync import WeightSubscriber

    from .workers import zeros

    with WeightPublisher(
        None, transport=transport, bucket_bytes=BUCKET, slots=1, lease_timeout=0.5, delta=False
    ) as pub:
        made["pub"] = pub
        pub.publish(weights(1), 1)
        mine = zeros()
        with WeightSubscriber(None, mine, transport=transport, publisher=pub.endpoint) as sub:
            try:
                got = sub.wait(1, timeout=30)
            except WeightSyncError as exc:
                assert why in str(exc)
                assert sub.version == -1 and all(not t.any() for t in mine.values())
            else:
                assert got == 2, "version 1 was applied from a slot that held version 2"
            assert sub.wait(2, timeout=30) == 2
        assert all(torch.equal(mine[n], t) for n, t in weights(2).items())
