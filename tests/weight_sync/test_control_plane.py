"""The weight channel's control plane over the RPC kernel: its server thread never waits on the
controller, beyond loopback it is a CurveZMQ server like every data-plane service, and a
subscriber's per-version messages take as few round trips as they can without leaving a slot
pinned: rank 0's lease rides on its offer (held by the subscriber's connection, so a subscriber
that dies frees it), the other ranks are leased at once, and a refusal anywhere releases what
the others granted."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
import zmq

import transfer_queue as tq
from transfer_queue.wire.auth import CREDENTIALS_ENV, Credentials
from transfer_queue.wire.rpc import DEAD_AFTER
from weight_sync import NameMapping, ShmTransport, TPShard, WeightPublisher, WeightSubscriber
from weight_sync.protocol import Confirm, Granted, Latest, Lease, Offer, Ok, Release, RpcClient, Slots
from weight_sync.ranks import PublisherRanks
from weight_sync.subscriber import _FIRST_CONTACT

from ..helpers import eventually, free_port
from .harness import CTX
from .workers import kill, waiting_reader


def test_subscribers_are_answered_while_a_version_is_being_recorded(cluster):
    """Recording a complete version in the controller is a round trip of up to seconds; leases,
    releases and `Latest` are served meanwhile, and `Confirm` answers once the record lands."""
    recording, release_record = threading.Event(), threading.Event()
    with WeightPublisher(cluster.address, "tcp") as pub, tq.ControlClient(cluster.address) as control:
        record = pub._coordinator.record

        def held_record(version: int) -> None:
            recording.set()
            assert release_record.wait(60)
            record(version)

        pub._coordinator.record = held_record
        pub.publish({"w": torch.arange(8.0)}, version=1)
        assert recording.wait(30), "the coordinator never started recording version 1"
        client = RpcClient(pub.endpoint, timeout=5.0)
        try:
            offer = client.call(Latest(after=-1, complete=True, timeout=0.0))
            assert isinstance(offer, Offer) and offer.version == -1  # not recorded yet: nobody is told
            grant = client.call(Lease(1, timeout=5.0))
            assert isinstance(grant, Granted) and grant.version == 1
            assert isinstance(client.call(Release(grant.lease)), Ok)
            assert control.version == 0
            release_record.set()
            assert isinstance(client.call(Confirm(1, timeout=30.0), timeout=35.0), Ok)
            assert control.version == 1
            assert client.call(Latest(after=-1, complete=True, timeout=0.0)).version == 1
        finally:
            release_record.set()
            client.close()


def test_the_control_endpoint_admits_only_the_clusters_clients(monkeypatch):
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)
    creds = Credentials.generate()
    with pytest.raises(tq.SchemaError, match="without CurveZMQ credentials"):
        WeightPublisher(None, "tcp", host="0.0.0.0")
    with WeightPublisher(None, "tcp", credentials=creds) as pub:
        pub.publish({"w": torch.ones(4)}, version=1)
        for wrong in (None, Credentials.generate().for_clients()):  # no keys; another cluster's keys
            stranger = RpcClient(pub.endpoint, timeout=2.0, connect_timeout=1.0, credentials=wrong)
            with pytest.raises(tq.WeightSyncError):
                stranger.call(Latest(after=-1, timeout=0.0))
            stranger.close()
        assert pub._server.auth_refused >= 2
        member = RpcClient(pub.endpoint, timeout=5.0, credentials=creds.for_clients())
        assert member.call(Latest(after=-1, timeout=0.0)).version == 1
        member.close()
    monkeypatch.setenv(CREDENTIALS_ENV, creds.for_clients().token())  # the subscriber's keys
    mine = {"w": torch.zeros(4)}
    with (  # a co-located reader too proves it holds the keys: no local lane beside CurveZMQ
        WeightPublisher(None, "shm", credentials=creds, model=mine) as pub,
        WeightSubscriber(None, mine, publisher=pub.endpoint) as sub,
    ):
        assert pub.info.local == ""
        pub.publish({"w": torch.ones(4)}, version=1)
        assert sub.wait(1, timeout=30) == 1 and torch.equal(mine["w"], torch.ones(4))


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_subscriber_given_the_clusters_credentials_is_admitted_and_one_without_is_told_why(monkeypatch, transport):
    """`WeightSubscriber(credentials=...)`, as the publisher's `credentials=`: admitted without
    `SLUICE_CREDENTIALS`. One without them times out saying the publisher was not reached and
    why (before, no such argument existed, and the timeout said nothing of the refusal)."""
    monkeypatch.delenv(CREDENTIALS_ENV, raising=False)
    creds = Credentials.generate()
    with WeightPublisher(None, transport, credentials=creds) as pub:
        pub.publish({"w": torch.ones(4)}, version=1)
        mine = {"w": torch.zeros(4)}
        with WeightSubscriber(
            None, mine, transport=transport, publisher=pub.endpoint, credentials=creds.for_clients()
        ) as sub:
            assert sub.wait(1, timeout=30) == 1 and torch.equal(mine["w"], torch.ones(4))
        with (
            WeightSubscriber(None, {"w": torch.zeros(4)}, transport=transport, publisher=pub.endpoint) as stranger,
            pytest.raises(tq.TimeoutError, match=r"the publishers were not reached.*credentials"),
        ):
            stranger.wait(1, timeout=4)


def _leases(pub: WeightPublisher) -> int:
    return sum(len(slot.leases) for slot in pub._table.slots)


def test_an_offer_carries_rank_0s_lease_when_asked():
    with WeightPublisher(None, "shm") as pub:
        pub.publish({"w": torch.ones(8)}, version=1)
        client = RpcClient(pub.endpoint, timeout=5.0)
        try:
            assert client.call(Latest(after=-1, timeout=0.0)).granted is None  # not asked: nothing pinned
            assert client.call(Latest(after=1, timeout=0.0, lease="shm")).granted is None  # nothing newer
            assert _leases(pub) == 0
            offer = client.call(Latest(after=-1, timeout=0.0, lease="shm"))
            granted = offer.granted
            assert isinstance(granted, Granted) and granted.version == offer.version == 1 and granted.slot.path
            assert pub._table.leased(granted.lease) is not None
            assert isinstance(client.call(Release(granted.lease)), Ok)
            assert _leases(pub) == 0
        finally:
            client.close()


def test_a_parked_offer_carries_a_lease_its_connection_holds():
    """An offer that waited for its version carries rank 0's lease too (no `Lease` round trip
    after it); the lease is the requesting connection's, so closing that connection without a
    `Release` frees the slot at once."""
    with WeightPublisher(None, "shm", slots=1, lease_timeout=600, timeout=30) as pub:
        client = RpcClient(pub.endpoint, timeout=30.0)
        offers: list[Offer] = []
        waiter = threading.Thread(
            target=lambda: offers.append(client.call(Latest(after=-1, timeout=20.0, lease="shm")))
        )
        try:
            waiter.start()
            eventually(lambda: pub._coordinator.waiters, 10, "the Latest parked")
            pub.publish({"w": torch.ones(8)}, version=1)
            waiter.join(30)
            assert offers and offers[0].version == 1 and isinstance(offers[0].granted, Granted)
            assert pub._table.leased(offers[0].granted.lease) is not None
        finally:
            waiter.join(30)
            client.close()
        pub.publish({"w": torch.ones(8)}, version=2)  # the only slot: waits for the close to land


@pytest.mark.parametrize("lane", ["zeromq", "local"])
@pytest.mark.parametrize("die_before_offer", [False, True], ids=["after-offer", "while-parked"])
def test_a_subscriber_that_dies_waiting_never_pins_a_slot(die_before_offer, lane):
    """A rollout worker spends most of its life parked in `Latest`, so that is where it dies.
    Dead before its offer: its parked request is dropped with its connection and no lease is
    granted. Dead after it (between learning of the version and copying it): the lease the offer
    carried is released when its connection closes. Either way the trainer reuses the slot at
    once, not after `lease_timeout`; over ZeroMQ and over the local lane a co-located subscriber
    uses."""
    with WeightPublisher(None, "shm", slots=1, lease_timeout=600, timeout=30) as pub:
        out = CTX.Queue()
        endpoint = pub.info.local if lane == "local" else pub.endpoint
        reader = CTX.Process(target=waiting_reader, args=(out, endpoint, die_before_offer), daemon=True)
        reader.start()
        probe = RpcClient(pub.endpoint, timeout=30.0)
        try:
            if die_before_offer:
                assert out.get(timeout=60) == "asked"
                eventually(lambda: pub._coordinator.waiters, 30, "the Latest parked")
                kill(reader)
                eventually(lambda: all(p.done for _, p in pub._coordinator.waiters), 30, "the dead waiter dropped")
            else:
                eventually(lambda: pub._coordinator.waiters, 60, "the Latest parked")
            pub.publish({"w": torch.ones(8)}, version=1)
            assert probe.call(Latest(after=-1, timeout=0.0)).version == 1  # waiters have been answered
            if die_before_offer:
                assert _leases(pub) == 0, "a lease was granted to a subscriber that had died"
            else:
                offered = out.get(timeout=60)
                assert offered is not None and offered[0] == 1, "a waiting subscriber's offer carries its lease"
                reader.join(30)
            pub.publish({"w": torch.ones(8)}, version=2)  # the only slot: free, or this times out
            assert _leases(pub) == 0
        finally:
            probe.close()
            if reader.is_alive():
                kill(reader)


def test_a_network_readers_lease_outlives_its_connection():
    """A `tcp` reader may be across a network whose connection resets and reconnects under it
    while it still reads: its lease ends only when released or expired, not with the
    connection. A co-located (`shm`) reader's ends as its connection closes."""
    with WeightPublisher(None, ["shm", "tcp"], lease_timeout=600) as pub:
        pub.publish({"w": torch.ones(8)}, version=1)
        remote, local = RpcClient(pub.endpoint, timeout=5.0), RpcClient(pub.endpoint, timeout=5.0)
        network = remote.call(Lease(1, "tcp"))
        mapped = local.call(Lease(1, "shm"))
        remote.close()
        local.close()
        eventually(lambda: pub._table.leased(mapped.lease) is None, 30, "the shm reader's lease released")
        assert pub._table.leased(network.lease) is not None
        with contextlib.closing(RpcClient(pub.endpoint, timeout=5.0)) as again:  # the reader, reconnected
            assert isinstance(again.call(Release(network.lease)), Ok)
        assert _leases(pub) == 0


def test_a_closed_subscriber_leaves_no_lease_behind():
    """Releases are posted, not awaited; closing a subscriber makes sure its last one arrived,
    so the publisher's only slot is free the moment `close` returns."""
    mine = {"w": torch.zeros(8)}
    with WeightPublisher(None, "shm", slots=1, model=mine) as pub:
        for version in range(1, 11):
            with WeightSubscriber(None, mine, publisher=pub.endpoint) as sub:
                pub.publish({"w": torch.full((8,), float(version))}, version)
                assert sub.wait(version, timeout=30) == version
            assert _leases(pub) == 0, f"version {version}'s lease outlived its subscriber"


def test_every_rank_is_leased_at_once_and_a_refusal_releases_the_others():
    p0 = WeightPublisher(None, "shm", world_size=2, timeout=10)
    p1 = WeightPublisher(None, "shm", rank=1, world_size=2, coordinator=p0.endpoint, timeout=10)
    ranks = PublisherRanks([p0.info, p1.info], ShmTransport(), {}, TPShard(), NameMapping(), 0, timeout=0.5)
    try:
        p0.publish({"w": torch.ones(8)}, version=1)  # rank 1 never stages it: its Lease waits, then fails
        with pytest.raises(tq.TimeoutError, match="version 1 was not staged"):
            ranks.lease_all(1)
        ranks.call(0, Slots("shm"))  # served after the release posted to rank 0
        assert _leases(p0) == 0, "rank 0's lease was left pinned when rank 1 refused"
        p1.publish({"w": torch.ones(8)}, version=1)
        grants = ranks.lease_all(1)
        assert [g.version for g in grants] == [1, 1] and _leases(p0) == _leases(p1) == 1
        ranks.release(grants)
        ranks.call(0, Slots("shm"))
        ranks.call(1, Slots("shm"))
        assert _leases(p0) == _leases(p1) == 0
    finally:
        ranks.close()
        p1.close()
        p0.close()


def test_a_rank_that_does_not_fit_the_group_is_refused_and_a_restarted_one_takes_its_place(caplog):
    """Rank 0 refuses a rank that counts another group size (before, it admitted it, and every
    subscriber then got `InternalError: KeyError`), and the refused publisher leaves nothing
    running. A rank that joins where one still connected was (a restart while the old process
    hangs) takes its place, said in the log: the old one's versions no longer count, and the
    channel goes on with the new one. A rank whose connection closed joins again too."""
    threads = threading.active_count()
    mine = {"w": torch.zeros(8)}
    with (
        WeightPublisher(None, "shm", world_size=2, timeout=10) as p0,
        WeightSubscriber(None, mine, publisher=p0.endpoint) as sub,
    ):
        with pytest.raises(tq.SchemaError, match="counts 3 publisher ranks; rank 0 counts 2"):
            WeightPublisher(None, "shm", rank=2, world_size=3, coordinator=p0.endpoint, timeout=10)
        hung = WeightPublisher(None, "shm", rank=1, world_size=2, coordinator=p0.endpoint, timeout=10)
        again = WeightPublisher(None, "shm", rank=1, world_size=2, coordinator=p0.endpoint, timeout=10)
        assert p0._coordinator.ranks[1] == again.info and "is replaced" in caplog.text
        p0.publish({"w": torch.full((8,), 1.0)}, version=1)
        hung.publish({"w": torch.full((8,), 1.0)}, version=1)  # its Staged is refused: not complete
        assert sub.poll() is None
        again.publish({"w": torch.full((8,), 1.0)}, version=1)
        assert sub.wait(1, timeout=30) == 1
        hung.close()
        again.close()
        eventually(lambda: 1 not in p0._coordinator.joined, 10, "rank 1's connection seen closed")
        with (
            WeightPublisher(None, "shm", rank=1, world_size=2, coordinator=p0.endpoint, timeout=10) as third,
            WeightSubscriber(None, mine, publisher=p0.endpoint) as later,  # `sub` knows the rank that left
        ):
            for pub in (p0, third):
                pub.publish({"w": torch.full((8,), 3.0)}, version=2)
            assert later.wait(2, timeout=30) == 2 and torch.equal(mine["w"], torch.full((8,), 3.0))
    eventually(lambda: threading.active_count() <= threads + 1, 10, "the publishers' threads gone")


def test_a_co_located_subscriber_talks_to_rank_0_over_its_local_lane():
    """A publisher serving a "map" transport opens a local lane; a subscriber on its host asks
    for versions and releases rank 0's lease over it (the lane's peers are named
    `local/...`), and every version lands whole."""
    mine = {"w": torch.zeros(8)}
    holders: list[bytes] = []
    with (
        WeightPublisher(None, "shm", slots=1, model=mine) as pub,
        WeightSubscriber(None, mine, publisher=pub.endpoint) as sub,
    ):
        assert pub.info.local.startswith("local:")
        grant = pub._grant

        def recorded(msg, holder):  # noqa: ANN001, ANN202
            holders.append(holder)
            return grant(msg, holder)

        pub._grant = recorded
        for version in range(1, 6):
            pub.publish({"w": torch.full((8,), float(version))}, version)  # the only slot: released, or this waits
            assert sub.wait(version, timeout=30) == version and torch.equal(mine["w"], torch.full((8,), float(version)))
        assert holders and all(h.startswith(b"local/") for h in holders)
    with WeightPublisher(None, "tcp") as pub:
        assert pub.info.local == ""  # its readers may be anywhere


def test_a_lease_waiting_for_a_version_the_trainer_skips_is_refused_and_the_server_goes_on():
    """A lease parked for version 2 is retried when version 3 starts staging; 2 will never be
    staged, so it gets `WeightSyncError`, from the retry on the server thread, which serves on."""
    weights = {"a": torch.arange(1 << 12, dtype=torch.float32)}
    with WeightPublisher(None, transport="tcp", bucket_bytes=1 << 14, timeout=10, delta=False) as pub:
        pub.publish(weights, 1)
        waiting = RpcClient(pub.endpoint, timeout=30.0)
        answer: list = []

        def lease() -> None:
            try:
                answer.append(waiting.call(Lease(2, "tcp", timeout=20.0)))
            except tq.SluiceError as exc:
                answer.append(exc)

        thread = threading.Thread(target=lease)
        thread.start()
        try:
            eventually(lambda: pub._lease_waiters, what="the lease of version 2 parked")
            pub.publish(weights, 3)
            thread.join(30)
            assert answer and isinstance(answer[0], tq.WeightSyncError), answer
            assert "no longer staged" in str(answer[0])
            other = RpcClient(pub.endpoint, timeout=10.0)
            try:
                granted = other.call(Lease(3, "tcp"))
                assert isinstance(granted, Granted) and granted.version == 3
            finally:
                other.close()
        finally:
            thread.join(30)
            waiting.close()


def test_looking_for_a_publisher_that_is_not_there_barely_blocks():
    """A `poll` before the publisher is reachable returns None after `_FIRST_CONTACT` rather
    than after the connect timeout a `wait`'s first contact with a busy publisher may take
    (`DEAD_AFTER`), and `wait` keeps to its own deadline: also where rank 0 is reached late in
    it and never answers (its connection and its answer share the one deadline)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there yet
    with WeightSubscriber(None, {"w": torch.zeros(8)}, publisher=endpoint) as sub:
        for _ in range(2):
            began = time.monotonic()
            assert sub.poll() is None
            assert time.monotonic() - began < _FIRST_CONTACT + 1
        began = time.monotonic()
        with pytest.raises(tq.TimeoutError):
            sub.wait(1, timeout=0.5)
        assert time.monotonic() - began < DEAD_AFTER / 2
        silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes the connection, never answers
        silent.setsockopt(zmq.LINGER, 0)
        late = threading.Timer(2.0, silent.bind, (endpoint,))  # 2 s into the wait below
        began = time.monotonic()
        late.start()
        try:
            with pytest.raises(tq.TimeoutError):
                sub.wait(1, timeout=3.0)
            assert time.monotonic() - began < 4.0  # not 2 s to connect + 3 s for the answer
        finally:
            late.join()
            silent.close()


def test_a_release_says_whether_its_lease_still_held_its_slot():
    """`Release` answers `Ok` while the lease pins its slot, and `WeightSyncError` once it does
    not (released already, or the slot staged again): what a reader whose reads outlasted their
    lease awaits before it takes them for a version."""
    with WeightPublisher(None, "shm", slots=1, lease_timeout=600) as pub:
        pub.publish({"w": torch.ones(8)}, version=1)
        with contextlib.closing(RpcClient(pub.endpoint, timeout=5.0)) as client:
            grant = client.call(Lease(1, "shm"))
            assert isinstance(client.call(Release(grant.lease)), Ok)
            with pytest.raises(tq.WeightSyncError, match="did not hold its slot"):
                client.call(Release(grant.lease))


def test_a_failed_publish_keeps_the_version_before_it_and_says_its_number_is_taken():
    """A publish that fails while staging (a meta tensor among the weights) leaves the previous
    version served; publishing the same number again is refused saying that publish failed
    (it said only "not above the last published version"), and the next number goes through.
    A publisher with no staging slot is refused at once (it was accepted, and its publish
    timed out blaming stuck subscribers)."""
    with pytest.raises(ValueError, match="at least one staging slot"):
        WeightPublisher(None, "shm", slots=0)
    mine = {"w": torch.zeros(8), "b": torch.zeros(4)}
    with WeightPublisher(None, "shm") as pub, WeightSubscriber(None, mine, publisher=pub.endpoint) as sub:
        pub.publish({"w": torch.ones(8), "b": torch.ones(4)}, version=1)
        assert sub.wait(1, timeout=30) == 1
        with pytest.raises(tq.SluiceError):
            pub.publish({"w": torch.full((8,), 2.0), "b": torch.empty(4, device="meta")}, version=2)
        assert sub.poll() is None and sub.version == 1 and torch.equal(mine["w"], torch.ones(8))
        with pytest.raises(tq.VersionError, match="its publish failed"):
            pub.publish({"w": torch.full((8,), 2.0), "b": torch.full((4,), 2.0)}, version=2)
        pub.publish({"w": torch.full((8,), 3.0), "b": torch.full((4,), 3.0)}, version=3)
        assert sub.wait(3, timeout=30) == 3 and torch.equal(mine["b"], torch.full((4,), 3.0))


def test_a_one_slot_publisher_whose_publish_failed_says_so_to_a_late_subscriber():
    """With one slot, a publish that fails while staging leaves nothing to serve. A subscriber
    that comes then is told at once (`WeightSyncError`) instead of waiting for a version being
    staged that the failed one is not (it waited out its timeout)."""
    with WeightPublisher(None, "shm", slots=1) as pub:
        pub.publish({"w": torch.ones(8), "b": torch.ones(4)}, version=1)
        with pytest.raises(tq.SluiceError):
            pub.publish({"w": torch.ones(8), "b": torch.empty(4, device="meta")}, version=2)
        with WeightSubscriber(None, {"w": torch.zeros(8), "b": torch.zeros(4)}, publisher=pub.endpoint) as late:
            started = time.monotonic()
            with pytest.raises(tq.WeightSyncError):
                late.wait(1, timeout=20)
            assert time.monotonic() - started < 10


def test_versions_far_apart_complete_when_the_other_ranks_stage_them_later():
    """Version numbers need not be consecutive (training steps 100, 200): rank 0 stages both
    before rank 1 stages either, and both still complete (a version was forgotten when the
    next was more than RECENT numbers above it)."""
    with (
        WeightPublisher(None, "shm", world_size=2, timeout=10) as p0,
        WeightPublisher(None, "shm", rank=1, world_size=2, coordinator=p0.endpoint, timeout=10) as p1,
    ):
        for pub in (p0, p1):
            for version in (100, 200):
                pub.publish({"w": torch.full((8,), float(version))}, version=version)
        eventually(lambda: p0._coordinator.complete == 200, 10, "version 200 complete")
        assert list(p0._coordinator.recent) == [100, 200]
