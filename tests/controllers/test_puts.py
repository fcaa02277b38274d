"""A put of new rows takes two round trips: the producer sends its writes and its `CommitPut`
together, and the controller commits only once every unit reported its write stored, so no
consumer sees rows whose bytes are not all in place; a unit that fails the write ends the put."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import eventually, unit_status
from tests.helpers import put_anew
from tests.peers import ask, peer
from transfer_queue.wire.messages import (
    FIELD_BYTES,
    AbortPut,
    BeginPut,
    CommitPut,
    CommitWrite,
    ErrorReply,
    Ok,
    PutPlan,
    RowInfo,
    Status,
    Write,
    WriteLanded,
    WriteReply,
)
from transfer_queue.wire.meta import RAGGED, FieldSpec

SPEC = {"x": FieldSpec("float32", (4,))}


def _rounds(client: tq.Client, td: TensorDict) -> list[list[str]]:
    """Run one put, recording the requests of each round trip by message type (a notice, sent
    without awaiting an answer, marked `!`)."""
    rounds: list[list] = []
    client._run(_watched(client._core.put(td), rounds))
    return [[type(c.msg).__name__ + ("!" if c.notice else "") for c in calls] for calls in rounds]


def _watched(flow, rounds: list[list]):
    """`flow`, recording the calls of each of its round trips in `rounds`."""
    replies = None
    while True:
        try:
            calls = next(flow) if replies is None else flow.send(replies)
        except StopIteration as stop:
            return stop.value
        rounds.append(list(calls))
        replies = yield calls


def _begin_and_commit(controller) -> tuple[PutPlan, int]:
    """Open a put of two `SPEC` rows and send its commit at once (its writes still to come): the
    put's plan, and the commit's request id."""
    plan = controller.call(BeginPut("train", SPEC, 2, 16))
    return plan, controller.send(CommitPut("train", plan.indexes, SPEC, RowInfo([0, 0], [0, 0], [0, 1], [1, 1])))


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_a_put_of_new_rows_takes_two_round_trips(make_cluster, use_shm):
    cluster = make_cluster(num_storage_units=2)
    with tq.connect(cluster.address, use_shm=use_shm) as client:
        rounds = _rounds(client, TensorDict({"x": torch.ones(8, 4)}, batch_size=[8]))
        # writes carrying their bytes are notices the units report to the controller; a mapped
        # arena is reserved first, filled, then committed with the put
        if use_shm:
            assert rounds == [["BeginPut"], ["Write"], ["CommitWrite!", "CommitPut"]]
        else:
            assert rounds == [["BeginPut"], ["Write!", "CommitPut"]]
        meta = client.get_meta(["x"], 8, task="t", timeout=5)
        assert client.get_data(meta)["x"].sum().item() == 32


def test_a_mapped_producer_reserves_its_next_put_along_with_its_begin_put(make_cluster):
    """After a put that went whole to a unit it maps, a producer reserves the next put's space
    there along with its `BeginPut`: a put that stays takes it, in two round trips; the unit
    checks the plan's ticket when the space is committed with the put's rows."""
    cluster = make_cluster(num_storage_units=2)

    def batch(x: torch.Tensor) -> TensorDict:  # a dense and a jagged field
        ids = torch.nested.nested_tensor([torch.arange(i % 3) for i in range(8)], layout=torch.jagged)
        return TensorDict({"x": x, "ids": ids}, batch_size=[8])

    with tq.connect(cluster.address, use_shm=True) as client:
        first = client.put(batch(torch.ones(8, 4)))
        values = torch.arange(32, dtype=torch.float32).reshape(8, 4)
        rounds = _rounds(client, batch(values))
        assert rounds == [["BeginPut", "Write"], ["CommitWrite!", "CommitPut"]]
        meta = client.get_meta(["x", "ids"], 16, task="t", timeout=5)
        assert meta.units == [first.units[0]] * 16
        got = client.get_data(meta)
        assert torch.equal(got["x"][8:], values)
        assert [t.tolist() for t in got["ids"].unbind()[8:]] == [list(range(i % 3)) for i in range(8)]
        status = unit_status(client.units[first.units[0]].address)
        assert status["reservations"] == 0 and status["unplanned"] == 0


def test_space_reserved_ahead_that_the_plan_does_not_use_is_given_back(make_cluster):
    """A put placed on another unit than the producer's last one gives the space it reserved
    ahead back and reserves where it was placed; nothing stays reserved, nothing is lost."""
    cluster = make_cluster(num_storage_units=2, storage_capacity="2MiB")  # 1 MiB a unit: 60 KiB ahead at most
    row = torch.ones(1, 16 << 10)  # 64 KiB: one put puts its unit too far ahead to stay
    with tq.connect(cluster.address, use_shm=True) as client:
        first = client.put(TensorDict({"x": row}, batch_size=[1]))
        rounds = _rounds(client, TensorDict({"x": row * 2}, batch_size=[1]))
        assert rounds == [["BeginPut", "Write"], ["CommitWrite!"], ["Write"], ["CommitWrite!", "CommitPut"]]
        meta = client.get_meta(["x"], 2, task="t", timeout=5)
        assert sorted(meta.units) == [0, 1] and meta.units[0] == first.units[0]
        assert client.get_data(meta)["x"].sum(dim=1).tolist() == [16 << 10, 32 << 10]
        for address in [u.address for u in client.units.values()]:
            eventually(lambda a=address: unit_status(a)["reservations"] == 0, 10, "the space given back")
        assert sum(unit_status(u.address)["used"] for u in client.units.values()) == client.status()["bytes"]


def test_a_begin_put_asked_now_does_not_wait_for_room(make_cluster):
    """`BeginPut.now` (its producer holds space reserved ahead) is answered at once: placed, or
    an empty plan when there is no room now; the same put asked to wait waits, then fails."""
    cluster = make_cluster(storage_capacity="1MiB")
    spec = {"x": FieldSpec("uint8", (256 << 10,))}
    controller = peer(cluster.address)

    def begin(n: int, **options) -> BeginPut:  # written through a mapping: no frame window to wait for
        return BeginPut("train", spec, n, 256 << 10, mapped=[0], **options)

    held = controller.call(begin(3, timeout=5.0))  # 768 KiB, left open
    assert len(held.indexes) == 3
    assert controller.call(begin(2, now=True)) == PutPlan([], [])
    assert len(controller.call(begin(1, now=True)).indexes) == 1
    refused = ask(controller, begin(1, timeout=0.2))
    assert isinstance(refused, ErrorReply) and refused.code == "capacity", refused
    controller.close()


def test_the_commit_waits_for_the_write(make_cluster):
    """A commit that arrives before the write is parked: its rows stay invisible until the unit
    reports the bytes stored, then the commit answers."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan, commit = _begin_and_commit(controller)
        # asked after the commit on the same connection, so answered after the commit was handled
        status = controller.call(Status()).status
        assert controller.ready(commit) is None, "the commit was answered before the data landed"
        assert status["partitions"]["train"]["committed"] == 0
        with pytest.raises(tq.TimeoutError):
            client.get_meta(["x"], 2, task="t", timeout=0.5)
        unit = peer(client.units[0].address)
        write = Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0])
        unit.post(write, [np.arange(8, dtype=np.float32)])  # a notice: the unit tells the controller
        assert controller.reply(commit, 10)[0] == Ok()
        meta = client.get_meta(["x"], 2, task="t", timeout=5)
        assert client.get_data(meta)["x"].flatten().tolist() == list(range(8))
        unit.close()
        controller.close()


def test_the_last_report_answers_the_waiting_commits_in_order(make_cluster):
    """The report that completes a put applies the commit waiting for it and answers it; a
    withdrawn commit is skipped and leaves the put to the next one, and a second commit of the
    same put learns it is no open put any more (the rows are committed once)."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan, withdrawn = _begin_and_commit(controller)
        assert controller.cancel(withdrawn) is None, "the commit was answered before the data landed"
        info = RowInfo([0, 0], [0, 0], [0, 1], [1, 1])
        first = controller.send(CommitPut("train", plan.indexes, SPEC, info))
        again = controller.send(CommitPut("train", plan.indexes, SPEC, info))
        controller.call(Status())  # both commits were handled: they wait
        assert controller.ready(first) is None and controller.ready(again) is None
        unit = peer(client.units[0].address)
        unit.post(
            Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0]), [np.zeros(8, np.float32)]
        )
        assert controller.reply(first, 10)[0] == Ok()
        late = controller.reply(again, 10)[0]
        assert isinstance(late, ErrorReply) and late.code == "schema" and "no open put" in late.message, late
        status = client.status()
        assert status["partitions"]["train"]["committed"] == 2 and status["counters"]["open_puts"] == 0
        unit.close()
        controller.close()


def test_a_commit_waiting_for_its_writes_learns_why_its_put_ended(make_cluster):
    """An abort while the commit waits (the put ends before any report) answers the commit with
    the reason at once, and its rows are freed."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        other = peer(cluster.address)
        plan, commit = _begin_and_commit(controller)
        controller.call(Status())
        assert controller.ready(commit) is None
        assert other.call(AbortPut("train", plan.indexes)) == Ok()
        answer = controller.reply(commit, 10)[0]
        assert isinstance(answer, ErrorReply) and "aborted by its producer" in answer.message, answer
        status = client.status()
        assert status["partitions"]["train"]["samples"] == 0 and status["counters"]["open_puts"] == 0
        other.close()
        controller.close()


def test_a_commit_must_name_exactly_its_puts_indexes(make_cluster):
    """A commit is applied to the rows its put placed: one that names the put's first and last
    index but another row between (or a row twice) is refused and commits nothing."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan = controller.call(BeginPut("train", SPEC, 3, 16))
        first, _, last = plan.indexes
        info = RowInfo([0] * 3, [0] * 3, [0, 1, 2], [1] * 3)
        for indexes in ([first, first, last], [first, last + 1, last]):
            wrong = ask(controller, CommitPut("train", indexes, SPEC, info))
            assert isinstance(wrong, ErrorReply) and wrong.code == "schema" and "no open put" in wrong.message, wrong
        assert (
            client.status()["partitions"]["train"]["committed"] == 0 and client.status()["counters"]["open_puts"] == 1
        )
        controller.close()


def test_a_write_report_needs_the_cluster_secret(make_cluster):
    """Only a storage unit may declare a put's bytes in place: a report without the cluster
    secret is refused (and counted), and the commit keeps waiting for the real one."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan, commit = _begin_and_commit(controller)
        forged = ask(controller, WriteLanded(0, "train", plan.indexes[0], plan.indexes, "guess"))
        assert isinstance(forged, ErrorReply) and forged.code == "protocol", forged
        assert controller.ready(commit) is None
        status = client.status()
        assert status["partitions"]["train"]["committed"] == 0 and status["counters"]["reports_refused"] == 1
        unit = peer(client.units[0].address)
        unit.post(
            Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0]), [np.zeros(8, np.float32)]
        )
        assert controller.reply(commit, 10)[0] == Ok()
        unit.close()
        controller.close()


def test_a_failed_write_ends_the_put(make_cluster):
    """The unit refuses the write (its frame is short): its producer hears the refusal, the
    commit waiting for it answers with the unit's error, and the put's rows are freed without
    the producer's abort."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan, commit = _begin_and_commit(controller)
        unit = peer(client.units[0].address)
        refused = ask(
            unit,
            Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0]),
            [np.zeros(3, np.float32)],
        )
        assert isinstance(refused, ErrorReply)
        answer = controller.reply(commit, 10)[0]
        assert isinstance(answer, ErrorReply) and answer.code == refused.code, (answer, refused)
        status = client.status()
        assert status["partitions"]["train"]["samples"] == 0 and status["counters"]["open_puts"] == 0
        assert status["bytes"] == 0
        unit.close()
        controller.close()


def test_a_write_of_part_of_a_put_does_not_commit_it(make_cluster):
    """A put's ticket covers exactly its rows on that unit: a write of one of two rows is refused
    and stores nothing, and the commit keeps waiting (no consumer may see a row without its bytes)."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan, commit = _begin_and_commit(controller)
        unit = peer(client.units[0].address)
        part = Write("train", plan.indexes[:1], SPEC, put=plan.indexes[0], ticket=plan.tickets[0])
        refused = ask(unit, part, [np.zeros(4, np.float32)])
        assert isinstance(refused, ErrorReply) and refused.code == "protocol", refused
        assert not unit_status(client.units[0].address)["rows"].get("train")
        status = controller.call(Status()).status
        assert controller.ready(commit) is None and status["partitions"]["train"]["committed"] == 0
        unit.post(
            Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0]), [np.zeros(8, np.float32)]
        )
        assert controller.reply(commit, 10)[0] == Ok()
        unit.close()
        controller.close()


def test_a_write_that_lands_after_its_put_ended_is_freed(make_cluster):
    """The producer does not wait for its writes, so an abort (or a seal, another unit's failure)
    can free the rows before their bytes arrive: the unit's late report makes the controller
    free them there again, and nothing is left."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        controller = peer(cluster.address)
        plan = controller.call(BeginPut("train", SPEC, 2, 16))
        controller.call(AbortPut("train", plan.indexes))
        address = client.units[0].address
        served = unit_status(address)["served"]
        unit = peer(address)
        unit.post(
            Write("train", plan.indexes, SPEC, put=plan.indexes[0], ticket=plan.tickets[0]), [np.zeros(8, np.float32)]
        )

        def freed_after_it_landed() -> bool:
            now = unit_status(address)  # the write, then the controller's Free again, were served
            return now["served"] >= served + 3 and now["used"] == 0 and not now["rows"].get("train")

        eventually(freed_after_it_landed, 10, "the late write freed")
        assert client.status()["bytes"] == 0
        unit.close()
        controller.close()


def test_a_producers_puts_stay_on_its_unit_until_it_is_ahead(make_cluster):
    """Small puts of one producer go to one unit (its process awake, its memory warm); a new
    producer begins at the emptiest unit; a producer moves on once its unit holds more than
    1/16 of its room beyond the emptiest one, so the units stay level."""
    cluster = make_cluster(num_storage_units=2, storage_capacity="64MiB")  # 32 MiB a unit: 2 MiB ahead at most
    row = TensorDict({"x": torch.zeros(1, 64 << 10)}, batch_size=[1])  # 256 KiB
    with tq.connect(cluster.address, use_shm=False) as first, tq.connect(cluster.address, use_shm=False) as second:
        mine = [first.put(row).units[0] for _ in range(4)]
        assert len(set(mine)) == 1, "one producer, one unit"
        other = second.put(row).units[0]
        assert other != mine[0], "a new producer begins at the emptiest unit"
        units = [first.put(row).units[0] for _ in range(16)]
        assert units[:4] == [mine[0]] * 4 and other in units, "it stays, then moves on once far ahead"
        moved = units.index(other)
        assert units[moved:] == [other] * (len(units) - moved), "and stays on the unit it moved to"
        held = [u["bytes"] for u in first.status()["units"].values()]
        assert max(held) - min(held) <= (2 << 20) + (256 << 10), "the units stay within the bound"


def test_a_put_whose_frames_would_wait_on_its_producers_unit_goes_to_another(make_cluster):
    """A producer's put stays on its unit only when its frames need not wait there: with another
    open put filling that unit's frame window, it goes to the emptiest unit at once instead of
    queueing (and holding up every put behind it)."""
    cluster = make_cluster(num_storage_units=2)  # 32 MiB a unit: a frame window of 1 MiB
    spec = {"x": FieldSpec("uint8", (256 << 10,))}
    controller = peer(cluster.address)
    first = controller.call(BeginPut("train", spec, 4, 256 << 10, timeout=2.0))  # 1 MiB of frames, left open
    (unit,) = set(first.units)
    second = ask(controller, BeginPut("train", spec, 4, 256 << 10, timeout=2.0, stay=unit))
    assert isinstance(second, PutPlan) and set(second.units) == {1 - unit}, second
    controller.close()


def test_space_reserved_ahead_takes_only_the_plans_rows(make_cluster):
    """Space reserved ahead of a plan holds no rows until committed with the put's rows and the
    plan's ticket: a commit without them, with other rows or a wrong ticket is refused, stores
    nothing and gives the space back; an ahead reservation never waits for room."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        address = client.units[0].address
        controller, unit = peer(cluster.address), peer(address)
        plan, commit = _begin_and_commit(controller)
        put = plan.indexes[0]

        def reserve() -> int:
            reply = ask(unit, Write("train", [0, 1], SPEC, via="shm", ahead=True))
            assert isinstance(reply, WriteReply) and reply.token, reply
            return reply.token

        for wrong, code in (
            (CommitWrite(reserve()), "schema"),  # no put's rows named
            (CommitWrite(reserve(), put=put, indexes=plan.indexes[:1], ticket=plan.tickets[0]), "schema"),
            (CommitWrite(reserve(), put=put, indexes=plan.indexes, ticket=b"forged"), "protocol"),
        ):
            refused = ask(unit, wrong)
            assert isinstance(refused, ErrorReply) and refused.code == code, (wrong, refused)
        status = unit_status(address)
        assert status["unplanned"] == 1 and status["reservations"] == 0 and status["used"] == 0
        assert controller.ready(commit) is None, "the commit waits for the real rows"
        for bad in (
            Write("train", [0, 1], SPEC, ahead=True),
            Write("train", [0, 1], SPEC, via="shm", put=put, ahead=True),
        ):
            assert isinstance(ask(unit, bad), ErrorReply)
        unit.post(CommitWrite(reserve(), put=put, indexes=plan.indexes, ticket=plan.tickets[0]))
        assert controller.reply(commit, 10)[0] == Ok()
        assert unit_status(address)["rows"] == {"train": 2}
        big = {"x": FieldSpec("uint8", (20 << 20,))}  # 40 MiB of the unit's 64 MiB
        assert isinstance(ask(unit, Write("big", [0, 1], big, via="shm", ahead=True)), WriteReply)
        full = ask(unit, Write("big", [0, 1], big, via="shm", timeout=60.0, ahead=True), timeout=5.0)
        assert isinstance(full, ErrorReply) and full.code == "capacity", full
        unit.close()
        controller.close()


def _tokens(*lengths: int) -> torch.Tensor:
    """A ragged field of 16 rows, of `lengths` tokens in turn."""
    rows = [torch.zeros(lengths[i % len(lengths)], dtype=torch.int64) for i in range(16)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def test_a_column_written_again_replaces_its_bytes(make_cluster):
    """A consumer whose lease expired and the one that got its samples next both write their
    column: the unit replaces the rows, and the controller counts the difference in size only
    (before, each rewrite added its bytes again until puts found no room)."""
    cluster = make_cluster(storage_capacity="16MiB")
    with tq.connect(cluster.address) as client:
        meta = client.put(TensorDict({"x": torch.zeros(16, 4)}, batch_size=[16]))
        address = client.units[0].address
        for length in (4, 8, 2, 2, 2):  # 5 x 4 MiB of `y`: more than the unit holds, counted again
            column = TensorDict({"y": torch.zeros(16, 64 * 1024), "tokens": _tokens(length)}, batch_size=[16])
            client.put(column, meta=meta)
            assert client.status()["bytes"] == unit_status(address)["used"]
        client.put(TensorDict({"x": torch.zeros(16, 4)}, batch_size=[16]), timeout=1)


def test_each_field_written_again_replaces_its_own_bytes(make_cluster):
    """Rows of two ragged fields of very different sizes and a dense one, then each field written
    again on its own (and two at once), with other sizes: the controller counts each field's
    bytes as the client gave them (`BeginPut.field_bytes`, `CommitPut.field_bytes`), so its count
    is the unit's throughout. Before, it knew only a row's total and shared the ragged part of it
    evenly: writing the short `b` again took off half the long `a` (65,728 counted of 131,200)."""
    cluster = make_cluster(storage_capacity="16MiB")
    with tq.connect(cluster.address) as client:
        data = {"a": _tokens(1024), "b": _tokens(1), "x": torch.zeros(16, 3)}
        meta = client.put(TensorDict(data, batch_size=[16]))
        address = client.units[0].address
        assert client.status()["bytes"] == unit_status(address)["used"] == 131_392
        for column in (
            {"b": _tokens(1)},
            {"a": _tokens(1024)},
            {"b": _tokens(3, 700, 0)},
            {"x": torch.ones(16, 3)},
            {"a": _tokens(5), "x": torch.ones(16, 3)},
            {"b": _tokens(1)},
        ):
            client.put(TensorDict(column, batch_size=[16]), meta=meta)
            assert client.status()["bytes"] == unit_status(address)["used"], list(column)


def test_field_bytes_between_releases(make_cluster):
    """Every peer refuses a field it does not know, so a client sends `field_bytes` only to a
    controller that granted `FIELD_BYTES`: to an older one (here: one that did not grant it) its
    `BeginPut` and `CommitPut` carry none, and encode as before. From an older client (none
    given), the controller splits a put's `row_bytes` by the specs as before. Sizes that do not
    add up to `row_bytes` are refused."""
    cluster = make_cluster()
    with tq.connect(cluster.address) as client:
        assert FIELD_BYTES in client._core.features
        client._core.features -= {FIELD_BYTES}
        rounds: list[list] = []
        meta = client._run(_watched(client._core.put(TensorDict({"a": _tokens(3)}, batch_size=[16])), rounds))
        client._run(_watched(client._core.put(TensorDict({"b": _tokens(2)}, batch_size=[16]), meta=meta), rounds))
        puts = [c.msg for calls in rounds for c in calls if isinstance(c.msg, (BeginPut, CommitPut))]
        assert len(puts) == 3 and not any(
            "field_bytes" in msgspec.msgpack.decode(msgspec.msgpack.encode(m)) for m in puts
        )
        assert client.status()["bytes"] == unit_status(client.units[0].address)["used"] == 16 * (24 + 16)
        controller = peer(cluster.address)
        ragged = {"a": FieldSpec("int64", (RAGGED,)), "b": FieldSpec("int64", (RAGGED,))}
        wrong = ask(controller, BeginPut("train", ragged, 2, 80, field_bytes={"a": 64, "b": 8}))
        assert isinstance(wrong, ErrorReply) and wrong.code == "schema" and "row_bytes" in wrong.message, wrong
        controller.close()


def test_a_refused_column_put_leaves_its_units_as_they_were(make_cluster):
    """A column put whose dtype clashes with the partition's is refused at commit, after its unit
    stored it: the unit drops it again, so it holds no uncounted bytes and a correct put of the
    column is taken (before, the unit kept the wrong dtype and refused it)."""
    cluster = make_cluster(num_storage_units=2)
    with tq.connect(cluster.address) as client:
        first = put_anew(cluster.address, TensorDict({"x": torch.zeros(4, 1024)}, batch_size=[4]))
        other = put_anew(cluster.address, TensorDict({"x": torch.zeros(4, 1024)}, batch_size=[4]))
        assert set(first.units) != set(other.units)
        client.put(TensorDict({"y": torch.zeros(4, 256)}, batch_size=[4]), meta=first)  # y is float32
        address = client.units[other.units[0]].address
        used = unit_status(address)["used"]
        with pytest.raises(tq.SchemaError, match="field 'y' of partition 'train' is float32"):
            client.put(TensorDict({"y": torch.zeros(4, 256, dtype=torch.int64)}, batch_size=[4]), meta=other)
        eventually(lambda: unit_status(address)["used"] == used, 10, "the refused column dropped")
        written = client.put(TensorDict({"y": torch.ones(4, 256)}, batch_size=[4]), meta=other)
        assert client.get_data(written)["y"].sum().item() == 4 * 256
        assert client.status()["bytes"] == sum(unit_status(u.address)["used"] for u in client.units.values())
