"""No waiting call waits for what can never come, over a real cluster.

A consumer whose batch is larger than the admission budget lets in would wait for samples the
producers may not make until the trainer publishes a version, which the trainer does only after
the batch: by default the budget follows the consumers and grows to their demand per version;
pinned (`follow_consumers=False`), the request fails at once with `UnsatisfiableError` naming the
budget and the fix. A sealed partition with too few samples (or groups that can never fill)
returns what is left at once, as a stream's end.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest

import transfer_queue as tq
from tests.helpers import eventually, rows


def admission(client: tq.Client) -> dict:
    return client.status()["admission"]


class Producer:
    """A rollout worker's loop in a thread: acquire `per_grant` slots, put that many rows under
    the grant, until stopped; errors are kept for the test to raise."""

    def __init__(self, address: str, per_grant: int = 4, groups: bool = False, partition: str = "train"):
        self.address, self.per_grant, self.groups, self.partition = address, per_grant, groups, partition
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)

    def __enter__(self) -> Producer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive() and not self.errors, self.errors

    def _run(self) -> None:
        try:
            with tq.connect(self.address) as client:
                put = 0
                while not self.stop.is_set():
                    try:
                        grant = client.acquire(self.per_grant, timeout=0.5)
                    except tq.TimeoutError:
                        continue
                    with grant:
                        groups = [put // self.per_grant] * self.per_grant if self.groups else None
                        client.put(rows(self.per_grant, put), partition=self.partition, grant=grant, groups=groups)
                    put += self.per_grant
        except BaseException as exc:  # noqa: BLE001 - raised by the test thread in __exit__
            self.errors.append(exc)


# -- the budget follows the consumers (the default) ------------------------------------------


def test_a_consumer_batch_larger_than_the_budget_grows_it_and_is_served(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)  # admits 8 at version 0
    with Producer(cluster.address), cluster.connect() as trainer:
        meta = trainer.get_meta(["x"], 16, task="train", timeout=60)
        adm = admission(trainer)
    assert len(meta) == 16
    assert adm["consumer_batch_size"] == 16 and adm["configured_consumer_batch_size"] == 4
    assert adm["follows_consumers"]
    assert adm["grown_by"] == "task 'train' on partition 'train' takes 16 samples per version"


def test_the_budget_learns_several_batches_per_version_even_with_no_slack(make_cluster):
    """η = 0 leaves no version of slack: two batches of 8 per version need a budget of 16 per
    version, learned in the first version from what the trainer took and waits for."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)
    with Producer(cluster.address), cluster.connect() as trainer:
        for version in range(3):
            for _ in range(2):
                meta = trainer.get_meta(["x"], 8, task="train", timeout=60)
                assert meta.policy_versions == [version] * 8
                trainer.ack(meta)
                trainer.clear(meta)
            trainer.set_version(version + 1)
        status = trainer.status()
    assert status["admission"]["consumer_batch_size"] == 16
    assert status["staleness"]["histogram"] == {"0": 48}


def fill(client: tq.Client, n: int, partition: str = "train") -> None:
    """Put `n` samples under one grant into `partition`."""
    with client.acquire(n, timeout=5) as grant:
        client.put(rows(n), partition=partition, grant=grant)


@contextlib.contextmanager
def asking(
    address: str, task: str, batch: int = 4, partition: str = "train", max_staleness: int | None = None
) -> Iterator[tuple[threading.Thread, list[tq.BatchMeta]]]:
    """A `get_meta` of `batch` samples in a thread, from a client of its own (a client belongs to
    one thread): yields the thread and the list its answer lands in; the thread is joined on the
    way out, a failing test's too (it then ends at the request's timeout)."""
    out: list[tq.BatchMeta] = []

    def ask() -> None:
        with tq.connect(address) as client:
            meta = client.get_meta(
                ["x"], batch, task=task, partition=partition, timeout=60, max_staleness=max_staleness
            )
            out.append(meta)

    thread = threading.Thread(target=ask)
    thread.start()
    try:
        yield thread, out
    finally:
        thread.join(60)


def parked_or_ended(client: tq.Client, thread: threading.Thread) -> Callable[[], bool]:
    """For `eventually`: one request is parked at the controller, or the thread asking ended."""
    return lambda: client.status()["counters"]["parked_get_meta"] == 1 or not thread.is_alive()


@pytest.mark.parametrize(
    "staleness",
    [tq.StalenessConfig(8, 2), tq.StalenessConfig(8, 0, follow_consumers=False)],
    ids=["following", "pinned-and-spent"],
)
def test_a_request_a_sealed_drained_partition_answers_empty_counts_nothing(make_cluster, staleness):
    """A stream's last, prefetched `get_meta` arrives while its previous batch is still leased:
    it waits for that lease, then ends empty. It asked for 4 more, but no put can come to a
    sealed partition, so it is no demand: the budget stays at the 8 samples handed out, and a
    pinned budget with no slot left does not fail it as unsatisfiable."""
    cluster = make_cluster(staleness=staleness)
    with cluster.connect() as client:
        fill(client, 8)
        client.seal("train")
        for task in ("a", "b", "c"):  # a few streams, each its own consumer of the 8 samples
            first = client.get_meta(["x"], 4, task=task, timeout=5)
            second = client.get_meta(["x"], 4, task=task, timeout=5)
            with asking(cluster.address, task) as (waiter, last):
                eventually(parked_or_ended(client, waiter))
                client.ack(first)
                client.ack(second)
            assert len(last) == 1 and len(last[0]) == 0
        adm = admission(client)
    assert adm["consumer_batch_size"] == 8 and adm["grown_by"] == "", adm


def test_a_request_that_waits_within_the_budget_and_gives_up_counts_nothing(make_cluster):
    """The budget still lets producers in for this batch: the request waits for them, not for
    admission, so it is no demand until samples are handed out to it (here none are)."""
    cluster = make_cluster(max_staleness=2, consumer_batch_size=8)
    with cluster.connect() as client:
        fill(client, 8)
        assert len(client.get_meta(["x"], 8, task="train", timeout=5)) == 8
        with pytest.raises(tq.TimeoutError):
            client.get_meta(["x"], 4, task="train", timeout=0.2)
        adm = admission(client)
    assert adm["consumer_batch_size"] == 8 and adm["grown_by"] == "", adm


def give_back_by_nack(client: tq.Client) -> None:
    client.nack(client.get_meta(["x"], 8, task="train", timeout=5))


def give_back_by_lease_expiry(client: tq.Client) -> None:
    client.get_meta(["x"], 8, task="train", timeout=5, lease_timeout=0.1)
    eventually(lambda: client.status()["counters"]["open_leases"] == 0, what="the lease's expiry")


@pytest.mark.parametrize("give_back", [give_back_by_nack, give_back_by_lease_expiry], ids=["nack", "lease-expiry"])
def test_samples_handed_out_again_count_once(make_cluster, give_back):
    """Samples given back (nacked, or their lease expired) and handed out again in the same
    version are the same samples: the 8 served three times are 8 per version, not 24, when a
    request the spent budget holds back reports its consumer's demand (8 + the 4 it waits for)."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=8)  # admits 8 at version 0
    with cluster.connect() as client:
        fill(client, 8)
        for _ in range(3):
            give_back(client)
        meta = client.get_meta(["x"], 8, task="train", timeout=5)
        with asking(cluster.address, "train") as (waiter, more):
            eventually(lambda: admission(client)["consumer_batch_size"] != 8 or not waiter.is_alive())
            fill(client, 4)  # the 4 slots the budget grew by
        adm = admission(client)
    assert len(meta) == 8 and len(more) == 1 and len(more[0]) == 4
    assert adm["consumer_batch_size"] == 12, adm  # 12 distinct samples taken in one version
    assert adm["grown_by"] == "task 'train' on partition 'train' takes 12 samples per version"


def test_a_batch_taken_ahead_within_the_budget_is_no_demand(make_cluster):
    """A stream asks for its next batch before the trainer publishes; the budget's slack (η = 1)
    let its samples in, so it is served under the same version. The trainer still consumes 8
    per version: the budget stays at 8, not 16 (what a consumer was handed counts only with a
    request the budget holds back)."""
    cluster = make_cluster(max_staleness=1, consumer_batch_size=8)  # admits 16 at version 0
    with cluster.connect() as client:
        fill(client, 16)
        batch = client.get_meta(["x"], 8, task="train", timeout=5)
        ahead = client.get_meta(["x"], 8, task="train", timeout=5)
        adm = admission(client)
    assert len(batch) == len(ahead) == 8
    assert adm["consumer_batch_size"] == 8 and adm["grown_by"] == "", adm


def test_a_stream_prefetch_with_less_than_a_batch_of_slack_counts(make_cluster):
    """The behaviour docs/staleness.md describes: η = 0 leaves the budget no slack, so a
    stream's prefetch, launched once its first batch is in hand, is held back under the same
    version and asks for a second batch: the budget grows to two batches per version."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=8)  # admits 8 at version 0
    with cluster.connect() as trainer:
        fill(trainer, 8)
        for _batch, meta in trainer.stream(["x"], 8, task="train", timeout=60):
            assert meta.policy_versions == [0] * 8
            eventually(lambda: admission(trainer)["consumer_batch_size"] != 8)
            adm = admission(trainer)
            fill(trainer, 8)  # the prefetch is served: leaving the stream gives it back at once
            break
    assert adm["consumer_batch_size"] == 16
    assert adm["grown_by"] == "task 'train' on partition 'train' takes 16 samples per version"


def test_a_put_into_another_partition_that_spends_the_budget_reports_a_parked_request(make_cluster):
    """A request parked while the budget could still let its batch in is no demand then; a put
    under a grant into another partition spends that budget, and the request must report the
    demand at once (4 taken + 4 waited for, and the 4 the other partition holds for its
    consumers), or the budget never grows to it and it waits for a version the trainer
    publishes only after it."""
    cluster = make_cluster(max_staleness=1, consumer_batch_size=4)  # admits 8 at version 0
    with cluster.connect() as client:
        fill(client, 4)
        taken = client.get_meta(["x"], 4, task="train", timeout=5)
        with asking(cluster.address, "train") as (waiter, more):
            eventually(parked_or_ended(client, waiter))
            fill(client, 4, partition="eval")  # the budget's last 4 slots, spent elsewhere
            adm = admission(client)
            assert adm["consumer_batch_size"] == 12, adm
            assert adm["grown_by"] == (
                "task 'train' on partition 'train' takes 8 samples per version and other partitions hold 4 for theirs"
            )
            fill(client, 4)  # the slots the budget grew by
    assert len(taken) == 4 and len(more) == 1 and len(more[0]) == 4


@pytest.mark.parametrize("how", ["served", "cleared", "acked-late"])
def test_a_parked_request_whose_ready_samples_went_elsewhere_reports_with_what_is_left(make_cluster, how):
    """A request for 8 parks with 4 ready and 8 more the budget can let in: not held back.
    The 4 then stop being ready for it with nothing else on its partition changing: served to
    another request of its task, cleared by another task, or acked after their lease expired.
    A put under a grant into another partition spends 2 slots: the 0 ready + 6 fall short of
    8, so the request must report the demand (its consumer's, and the 2 the other partition
    holds), though 4 + 6 would not have."""
    cluster = make_cluster(max_staleness=2, consumer_batch_size=4)  # admits 12 at version 0
    with cluster.connect() as client:
        fill(client, 4)
        if how == "acked-late":
            late = client.get_meta(["x"], 4, task="train", timeout=5, lease_timeout=0.1)
            eventually(lambda: client.status()["counters"]["open_leases"] == 0, what="the lease's expiry")
        with asking(cluster.address, "train", batch=8) as (waiter, more):
            eventually(parked_or_ended(client, waiter))
            taken = 0  # granted samples handed to the task under this version and kept
            if how == "served":
                client.get_meta(["x"], 4, task="train", timeout=5)
                taken = 4
            elif how == "cleared":
                client.clear(client.get_meta(["x"], 4, task="other", timeout=5))
            else:
                client.ack(late)  # under no lease since it expired: taken from the ready pool
            fill(client, 2, partition="eval")
            adm = admission(client)
            assert adm["consumer_batch_size"] == taken + 8 + 2, adm
            assert adm["grown_by"] == (
                f"task 'train' on partition 'train' takes {taken + 8} samples per version"
                " and other partitions hold 2 for theirs"
            )
            fill(client, 8)  # the slots the budget grew by
    assert len(more) == 1 and len(more[0]) == 8


def test_a_parked_request_whose_ready_samples_were_dropped_as_stale_reports_with_none(make_cluster):
    """A request for 8 parks with 4 ready (version 0, within its own bound of 1) under version 1
    and 12 more the budget can let in: not held back. Another task drops the 4 as staler than the
    cluster's bound (0), with nothing else on the partition changing; a put under a grant into
    another partition then leaves room for 7: 0 ready + 7 fall short of 8, so the request
    reports the demand: its consumer's 8 and the 9 the other partition holds (no consumer of it
    has asked: it counts at most the configured consumer_batch_size, 4, plus one acquire, 9, per
    partition fed under grants)."""
    staleness = tq.StalenessConfig(4, max_staleness=0, budget_staleness=2)  # admits 12 at version 0, 16 at 1
    cluster = make_cluster(staleness=staleness)
    with cluster.connect() as client:
        fill(client, 4)
        client.set_version(1)
        with asking(cluster.address, "train", batch=8, max_staleness=1) as (waiter, more):
            eventually(parked_or_ended(client, waiter))
            assert len(client.get_meta(["x"], 4, task="other", timeout=0, allow_partial=True)) == 0
            assert client.status()["staleness"]["dropped"] == 4
            fill(client, 9, partition="eval")
            assert admission(client)["consumer_batch_size"] == 8 + 9
            fill(client, 8)
    assert len(more) == 1 and len(more[0]) == 8


@pytest.mark.parametrize("spent, grows", [(4, False), (5, True)])
def test_a_parked_request_reports_only_when_its_ready_samples_and_the_room_fall_short(make_cluster, spent, grows):
    """8 asked with 4 ready and room for 8 more (12 admitted at version 0): a put under a grant
    into another partition spends `spent` of it. 4 + 4 reach the batch (no demand); 4 + 3 fall
    short, and the request reports 8, plus the 5 the other partition holds (within what it may
    count: the configured consumer_batch_size plus one acquire per partition fed under grants)."""
    cluster = make_cluster(max_staleness=2, consumer_batch_size=4)
    with cluster.connect() as client:
        fill(client, 4)
        with asking(cluster.address, "train", batch=8) as (waiter, more):
            eventually(parked_or_ended(client, waiter))
            fill(client, spent, partition="eval")
            assert admission(client)["consumer_batch_size"] == (8 + 5 if grows else 4)
            fill(client, 4)
    assert len(more) == 1 and len(more[0]) == 8


# -- several partitions under one budget ---------------------------------------------------


@pytest.mark.parametrize("first", ["put", "request"])
def test_samples_another_partition_holds_for_its_consumer_count_in_a_held_back_consumer_s_demand(make_cluster, first):
    """The budget's 4 slots went to partition "math", whose consumer has not asked yet (a trainer
    that takes its "code" batch first, then its "math" batch, then publishes): the consumer of
    "code" is held back. Its own demand (4) fits the budget; what "math" holds for its consumer
    counts too, or "code" waits for a version the trainer publishes only after it. The request
    parks before or after the put that spends the budget; parked before, on a partition no put
    has made, it waits for the producer that will feed "code" (its first samples may need no
    grant), whose acquire the budget then grows for."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)  # admits 4 at version 0
    with cluster.connect() as client:
        if first == "put":
            fill(client, 4, partition="math")
        with asking(cluster.address, "code", partition="code") as (waiter, got):
            eventually(parked_or_ended(client, waiter))
            if first == "request":
                fill(client, 4, partition="math")
                assert admission(client)["consumer_batch_size"] == 4
            fill(client, 4, partition="code")  # the slots the budget grew by
        adm = admission(client)
        assert adm["consumer_batch_size"] == 8, adm
        assert adm["grown_by"] == (
            "task 'code' on partition 'code' takes 4 samples per version and other partitions hold 4 for theirs"
        )
        assert len(got) == 1 and len(got[0]) == 4
        assert len(client.get_meta(["x"], 4, task="math", partition="math", timeout=5)) == 4


def test_a_trainer_taking_a_batch_from_each_of_two_partitions_per_version_is_never_starved(make_cluster):
    """Two producers, one per partition, draw on one budget of 4 per version; the trainer takes
    4 from "code", then 4 from "math", then publishes. Whichever producer gets the slots first,
    the other partition's consumer is held back by samples it will never take: the budget grows
    to what both partitions take per version, and within a bound: a partition counts at most
    what its consumers take per version plus one acquire per partition fed under grants."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)
    with (
        Producer(cluster.address, partition="math"),
        Producer(cluster.address, partition="code"),
        cluster.connect() as trainer,
    ):
        for version in range(3):
            for name in ("code", "math"):
                meta = trainer.get_meta(["x"], 4, task="train", partition=name, timeout=60)
                assert len(meta) == 4 and meta.policy_versions == [version] * 4
                trainer.ack(meta)
                trainer.clear(meta)
            trainer.set_version(version + 1)
        adm = admission(trainer)
    assert 8 <= adm["consumer_batch_size"] <= 4 + 4 + 2 * 4, adm


@pytest.mark.parametrize("steps_before", [0, 5])
def test_a_partition_overfed_while_another_s_consumer_waits_grows_the_budget_a_bounded_amount(
    make_cluster, steps_before
):
    """A producer loops into "math", whose consumers never ask; a consumer waits on "code",
    which no put under a grant fed yet (its producer is slow, or not started). The producer
    waiting for budget holds that consumer back (it may be the one to feed "code"); "math"
    counts at most the configured consumer_batch_size (no consumer of it was seen) plus one
    acquire (one partition is fed under grants): the budget grows to 4 + 8 and then, with the
    consumer's demand fitting it, lends the waiting producer one acquire, and stops there
    however often the producer waits again. Partitions made per step, fed under grants and
    consumed before (`steps_before`) leave nothing behind that widens that bound."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=4)
    with cluster.connect() as client:
        for step in range(steps_before):
            fill(client, 4, partition=f"step{step}")
            meta = client.get_meta(["x"], 4, task="t", partition=f"step{step}", timeout=30)
            client.ack(meta)
            client.clear(meta)
            client.set_version(step + 1)
    with cluster.connect() as client, asking(cluster.address, "code", partition="code") as (waiter, got):
        eventually(parked_or_ended(client, waiter))
        with Producer(cluster.address, partition="math"):
            eventually(lambda: admission(client)["waits"] >= 4, what="the producer waiting again and again")
            adm = admission(client)
        client.put(rows(4), partition="code")  # the samples it waits for, at last
    # accepted: (versions so far) x 12, the budget's limit at version `steps_before`, plus the lent acquire
    assert adm["consumer_batch_size"] == 12 and adm["overdrafts"] == 1, adm
    assert adm["accepted"] == (steps_before + 1) * 12 + 4, adm
    assert len(got) == 1 and len(got[0]) == 4


@pytest.mark.parametrize(
    "staleness",
    [tq.StalenessConfig(4, 0), tq.StalenessConfig(4, 0, follow_consumers=False)],
    ids=["following", "pinned"],
)
def test_a_consumer_of_a_partition_not_yet_made_waits_for_puts_that_need_no_grant(make_cluster, staleness):
    """The budget is spent on "train"; a rollout worker asks 16 from "prompts", which a
    dataloader fills a moment later with plain puts (no grant). No put under a grant fed
    "prompts" and no producer waits: admission does not hold the request back, so a pinned
    budget does not fail it and a following one does not grow; it is served when the prompts
    come."""
    cluster = make_cluster(staleness=staleness)
    with cluster.connect() as client:
        fill(client, 4)
        with asking(cluster.address, "rollout", batch=16, partition="prompts") as (waiter, got):
            eventually(parked_or_ended(client, waiter))
            client.put(rows(16), partition="prompts")
        adm = admission(client)
    assert len(got) == 1 and len(got[0]) == 16
    assert adm["consumer_batch_size"] == 4 and adm["grown_by"] == "", adm


# -- a leftover smaller than a producer's acquire ----------------------------------------------


@pytest.mark.parametrize("first", ["producer", "consumer"])
@pytest.mark.parametrize(
    "staleness",
    [tq.StalenessConfig(6, 0), tq.StalenessConfig(6, 0, follow_consumers=False)],
    ids=["following", "pinned"],
)
def test_a_leftover_a_producer_s_acquire_exceeds_is_lent_to_it_when_a_consumer_waits(make_cluster, staleness, first):
    """6 admitted at version 0; the producer acquires in units of 4 (one GRPO group, say). After
    one unit the leftover is 2, which its next acquire never fits, and the consumer (3 taken, 1
    ready) waits for 3 more: neither can move until the trainer publishes, which it does only
    after this batch. The consumer is held back, so the producer at the head of the queue gets
    its 4, overdrawing the budget by 2 (the next version pays them back); the budget does not
    grow. The producer starts waiting before or after the consumer."""
    cluster = make_cluster(staleness=staleness)
    with cluster.connect() as client, contextlib.ExitStack() as stack:
        fill(client, 4)
        assert len(client.get_meta(["x"], 3, task="train", timeout=5)) == 3
        if first == "producer":
            stack.enter_context(Producer(cluster.address, per_grant=4))
            eventually(lambda: admission(client)["waiting"] == 1)
        waiter, more = stack.enter_context(asking(cluster.address, "train", batch=3))
        if first == "consumer":
            eventually(parked_or_ended(client, waiter))
            stack.enter_context(Producer(cluster.address, per_grant=4))
        waiter.join(60)
        adm = admission(client)
    assert len(more) == 1 and len(more[0]) == 3
    assert adm["consumer_batch_size"] == 6 and adm["grown_by"] == "", adm
    assert adm["accepted"] == 8 and adm["budget"] == -2 and adm["overdrafts"] == 1, adm


def test_slots_given_back_while_a_producer_waits_have_a_parked_consumer_check_again(make_cluster):
    """8 admitted at version 0; the consumer took 4. A grant of 2 runs (leftover 2) and a
    producer waits for 5; the consumer asks for 2, which the running grant covers: not held back.
    That grant is given back unused: the leftover (4) still falls short of the waiting 5, so
    nothing is room any more, and the parked consumer must check again, which lends the waiting
    producer its 5."""
    cluster = make_cluster(max_staleness=0, consumer_batch_size=8)
    with cluster.connect() as client:
        fill(client, 4)
        assert len(client.get_meta(["x"], 4, task="train", timeout=5)) == 4
        grant = client.acquire(2, timeout=5)
        got: list[tq.Grant] = []

        def produce() -> None:  # one long acquire: a retry would make the check happen anyway
            with tq.connect(cluster.address) as producer:
                got.append(producer.acquire(5, timeout=60))
                producer.put(rows(5), partition="train", grant=got[0])

        producing = threading.Thread(target=produce)
        producing.start()
        try:
            eventually(lambda: admission(client)["waiting"] == 1)
            with asking(cluster.address, "train", batch=2) as (waiter, more):
                eventually(parked_or_ended(client, waiter))
                grant.release()
        finally:
            producing.join(60)
        adm = admission(client)
    assert len(got) == 1 and len(more) == 1 and len(more[0]) == 2
    assert adm["overdrafts"] == 1 and adm["accepted"] == 9, adm


# -- a pinned budget fails at once what it can never let in ----------------------------------


def test_a_consumer_batch_a_pinned_budget_never_lets_in_fails_at_once(make_cluster):
    cluster = make_cluster(staleness=tq.StalenessConfig(4, 1, follow_consumers=False))
    with cluster.connect() as client:
        for k in range(2):  # the whole budget at version 0: (1 + 0 + 1) * 4
            with client.acquire(4, timeout=5) as grant:
                client.put(rows(4, 4 * k), partition="train", grant=grant)
        with pytest.raises(tq.UnsatisfiableError) as caught:
            client.get_meta(["x"], 12, task="train", timeout=60)  # a wait would end in TimeoutError
        message = str(caught.value)
        assert "takes 12 samples per version" in message
        assert "pinned at consumer_batch_size=4" in message and "= 8; now accepted 8, running 0" in message
        assert "sluice serve --consumer-batch-size 12" in message and "--no-follow-consumers" in message
        status = client.status()
        assert status["counters"]["parked_get_meta"] == 0
        assert status["admission"]["consumer_batch_size"] == 4 and not status["admission"]["follows_consumers"]
        assert len(client.get_meta(["x"], 8, task="train", timeout=5)) == 8  # what was let in is still served


def test_a_parked_consumer_fails_once_the_pinned_budget_is_spent(make_cluster):
    """The trainer asks first, before any sample exists; its request fails as soon as the
    producers have spent the budget, not at its timeout."""
    cluster = make_cluster(staleness=tq.StalenessConfig(4, 0, follow_consumers=False))
    errors: list[BaseException] = []

    def consume() -> None:
        with tq.connect(cluster.address) as trainer:
            try:
                trainer.get_meta(["x"], 8, task="train", timeout=300)
            except tq.SluiceError as exc:
                errors.append(exc)

    consumer = threading.Thread(target=consume)
    consumer.start()
    with cluster.connect() as producer:
        eventually(lambda: producer.status()["counters"]["parked_get_meta"] == 1)
        with producer.acquire(4, timeout=5) as grant:
            producer.put(rows(4), partition="train", grant=grant)
        consumer.join(60)
    assert not consumer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], tq.UnsatisfiableError), errors
    assert "takes 8 samples per version" in str(errors[0])


def test_groups_larger_than_a_pinned_budget_fail_at_once(make_cluster):
    cluster = make_cluster(staleness=tq.StalenessConfig(4, 0, follow_consumers=False))
    with cluster.connect() as client:
        with client.acquire(4, timeout=5) as grant:
            client.put(rows(4), partition="train", grant=grant, groups=[0] * 4)
        with pytest.raises(tq.UnsatisfiableError, match="takes 8 samples per version"):
            client.get_meta(["x"], 8, task="train", sampler="grpo_group", group_size=8, timeout=60)


def test_a_timeout_held_by_a_pinned_budget_names_it(make_cluster):
    """Another task took (and cleared) what admission let in: this task's demand fits the
    budget, so it waits, and its TimeoutError names the budget rather than `allow_partial`."""
    cluster = make_cluster(staleness=tq.StalenessConfig(4, 0, follow_consumers=False))
    with cluster.connect() as client:
        with client.acquire(4, timeout=5) as grant:
            client.put(rows(4), partition="train", grant=grant)
        client.clear(client.get_meta(["x"], 4, task="eval", timeout=5))
        with pytest.raises(tq.TimeoutError, match="admission lets no more producers in") as caught:
            client.get_meta(["x"], 4, task="train", timeout=0.5)
    assert "(0 + 0 + 1) * 4 = 4; now accepted 4, running 0" in str(caught.value)
    assert "allow_partial" not in str(caught.value)


# -- sealed partitions end at once -------------------------------------------------------------


def test_a_partition_sealed_before_enough_samples_returns_the_rest_at_once(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as client:
        client.put(rows(3), partition="train")
        client.seal("train")
        meta = client.get_meta(["x"], 8, task="train", timeout=60)  # a wait would end in TimeoutError
        assert len(meta) == 3
        client.ack(meta)
        assert len(client.get_meta(["x"], 8, task="train", timeout=60)) == 0


def test_groups_that_can_never_fill_in_a_sealed_partition_end_at_once(make_cluster):
    cluster = make_cluster()
    with cluster.connect() as client:
        client.put(rows(6), partition="train", groups=[0, 0, 0, 1, 1, 1])  # groups of 3, sampler wants 4
        client.seal("train")
        meta = client.get_meta(["x"], 8, task="train", sampler="grpo_group", group_size=4, timeout=60)
        assert len(meta) == 0
