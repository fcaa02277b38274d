"""The sans-IO flows of the clients (`ClientCore.put`, `get_meta`, `stream`), driven in process by
a scripted driver that answers each call, as httpx tests its clients with `MockTransport`: what
each flow sends, in which steps, and what it does with each reply, including errors. The same
flows against real services are in test_roundtrip.py, test_put_faults.py and test_stream.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from transfer_queue._client_core import ClientCore
from transfer_queue._flows import CONTROLLER, NOTICED, Call, Finish, Flow, Give, Launch, Plan, Run, Withdraw
from transfer_queue.wire.errors import ProtocolError
from transfer_queue.wire.messages import (
    FEATURES,
    LANE,
    AbortPut,
    Ack,
    BeginPut,
    ClusterConfig,
    CommitPut,
    GetMeta,
    Hello,
    HelloReply,
    MetaReply,
    Nack,
    PutPlan,
    Read,
    ReadReply,
    UnitInfo,
    Write,
)
from transfer_queue.wire.meta import BatchMeta, FieldSpec
from transfer_queue.wire.rpc import GRACE, ErrorReply, Ok, error_reply

X = {"x": FieldSpec("int64", ())}
Answer = Callable[[Call], Any]
"""Answers one call: a reply message, (reply, frames), or an exception the driver raises (a
timeout, a dead service), which is thrown into the flow as the real drivers do."""


class Scripted:
    """A driver with no sockets: each step's calls are answered at once by `answer`, and every
    step is kept in `steps` (a list of calls sent together)."""

    def __init__(self, answer: Answer):
        self.answer = answer
        self.steps: list[list[Call]] = []

    def run(self, flow: Flow) -> Any:
        """Drive `flow` to its end; its result, or what it raised."""
        replies: list[Any] | None = None
        error: BaseException | None = None
        while True:
            try:
                if error is not None:
                    calls = flow.throw(error)
                else:
                    calls = next(flow) if replies is None else flow.send(replies)
            except StopIteration as stop:
                return stop.value
            self.steps.append(calls)
            replies, error = [], None
            for call in calls:
                try:
                    reply = NOTICED if call.notice else self.answer(call)
                except BaseException as exc:  # noqa: BLE001 - thrown into the flow, as a driver does
                    replies, error = None, exc
                    break
                replies.append(reply if isinstance(reply, tuple) else (reply, []))

    def iterate(self, plan: Plan):
        """Drive `plan` (a launched flow runs to its end at once: its replies are all here)."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = plan.send(value) if error is None else plan.throw(error)
            except StopIteration:
                return
            value, error = None, None
            try:
                if isinstance(step, Give):
                    yield step.item
                elif isinstance(step, Run):
                    value = self.run(step.flow)
                elif isinstance(step, Launch):
                    value = _Done(self, step.flow)
                elif isinstance(step, Finish):
                    value = step.task.outcome()
                elif isinstance(step, Withdraw):
                    value = step.task.result
            except BaseException as exc:  # noqa: BLE001 - GeneratorExit included: the plan cleans up
                error = exc

    def sent(self, kind: type) -> list[Any]:
        """The messages of type `kind` sent, in order."""
        return [call.msg for step in self.steps for call in step if isinstance(call.msg, kind)]


class _Done:
    """A launched flow, already ended."""

    def __init__(self, driver: Scripted, flow: Flow):
        self.result, self.error = None, None
        try:
            self.result = driver.run(flow)
        except Exception as exc:  # noqa: BLE001 - raised at its `Finish`
            self.error = exc

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


def _core(units: int = 2) -> ClientCore:
    """A client core that said hello to a cluster of `units` units on other hosts (no arenas)."""
    core = ClientCore("tcp://127.0.0.1:1", use_shm=False)
    infos = [UnitInfo(u, f"tcp://127.0.0.1:{10 + u}", 1 << 30) for u in range(units)]
    config = ClusterConfig(num_storage_units=units, storage_capacity=units << 30)
    hello = HelloReply("c1", config, infos, 0, features=[LANE])
    driver = Scripted(lambda call: hello)
    assert driver.run(core.hello()) is hello
    assert driver.sent(Hello) == [Hello(sorted(FEATURES))] and sorted(core.units) == list(range(units))
    assert core.features == {LANE}
    return core


def test_hello_to_a_controller_before_features_asks_again_without_them():
    """Such a controller refuses `Hello.features` (an unknown field) with `ProtocolError`; it
    grants no feature."""
    core = ClientCore("tcp://127.0.0.1:1", use_shm=False)
    hello = HelloReply("c1", ClusterConfig(num_storage_units=1, storage_capacity=1 << 30), [], 0)
    refusal = error_reply(ProtocolError("undecodable message: Object contains unknown field `features`"))
    driver = Scripted(lambda call: refusal if call.msg.features else hello)
    assert driver.run(core.hello()) is hello
    assert driver.sent(Hello) == [Hello(sorted(FEATURES)), Hello()]
    assert core.features == frozenset() and core.lanes == {}


def _answers(**by_type: Any) -> Answer:
    """Answer each message by its class name (a value, or a function of the call)."""

    def answer(call: Call) -> Any:
        reply = by_type[type(call.msg).__name__]
        return reply(call) if callable(reply) else reply

    return answer


def _batch(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n, dtype=torch.int64)}, batch_size=[n])


def _meta(indexes: list[int], task: str = "t", units: list[int] | None = None) -> BatchMeta:
    n = len(indexes)
    units = [0] * n if units is None else units
    return BatchMeta("train", indexes, [0] * n, [0] * n, list(range(n)), units, dict(X), task)


def _raise(exc: BaseException) -> Callable[[Call], Any]:
    def answer(call: Call) -> Any:
        raise exc

    return answer


# -- put ---------------------------------------------------------------------------------


def test_a_put_sends_its_writes_with_the_commit_and_stays_on_its_unit():
    core = _core()
    driver = Scripted(_answers(BeginPut=PutPlan([10, 11, 12, 13], [0, 0, 1, 1]), CommitPut=Ok()))
    meta = driver.run(core.put(_batch(4), "train", policy_version=3, timeout=5.0))
    begin, writes_and_commit = driver.steps
    (call,) = begin
    assert call.target == CONTROLLER and call.wait == 5.0 + GRACE
    assert call.msg == BeginPut("train", X, 4, 8, 5.0, [], -1)
    assert [c.target for c in writes_and_commit] == [0, 1, CONTROLLER], "one step: no round trip of its own"
    writes = [c.msg for c in writes_and_commit[:2]]
    assert [w.indexes for w in writes] == [[10, 11], [12, 13]] and all(w.put == 10 for w in writes)
    assert all(c.notice for c in writes_and_commit[:2]), "a unit reports its write to the controller"
    sent = [np.frombuffer(bytes(c.data[0]), np.int64).tolist() for c in writes_and_commit[:2]]
    assert sent == [[0, 1], [2, 3]]
    commit = writes_and_commit[2].msg
    assert commit.indexes == [10, 11, 12, 13] and commit.rows.versions_first == [3] * 4
    assert meta.indexes == [10, 11, 12, 13] and meta.units == [0, 0, 1, 1] and meta.policy_versions == [3] * 4
    driver.run(core.put(_batch(1), "train"))
    assert driver.sent(BeginPut)[1].stay == 1, "the next put asks for the unit of this one's last rows"


def test_a_put_of_new_columns_commits_after_its_writes():
    core = _core()
    meta = _meta([4, 5], units=[1, 1])
    driver = Scripted(_answers(Write=Ok(), CommitPut=Ok()))
    extended = driver.run(core.put(TensorDict({"y": torch.ones(2)}, batch_size=[2]), meta=meta))
    assert [[type(c.msg) for c in step] for step in driver.steps] == [[Write], [CommitPut]]
    assert not driver.steps[0][0].notice, "not an open put: the unit answers the write itself"
    assert driver.steps[1][0].msg.rows is None and set(extended.fields) == {"x", "y"}


@pytest.mark.parametrize(
    ("code", "error"),
    [("capacity", tq.CapacityError), ("schema", tq.SchemaError), ("timeout", tq.TimeoutError)],
)
def test_a_refused_begin_put_raises_its_error_and_sends_nothing_else(code, error):
    core = _core()
    driver = Scripted(_answers(BeginPut=ErrorReply(code, "refused")))
    with pytest.raises(error, match="refused"):
        driver.run(core.put(_batch(2)))
    assert len(driver.steps) == 1, "no rows were placed: nothing to write or abort"


def test_a_units_failed_write_fails_the_commit_and_the_put_is_aborted():
    """The controller answers the commit with the error a unit reported for its write."""
    core = _core()
    driver = Scripted(
        _answers(
            BeginPut=PutPlan([0, 1], [1, 1]),
            CommitPut=ErrorReply("capacity", "storage unit 1 is full"),
            AbortPut=Ok(),
        )
    )
    with pytest.raises(tq.CapacityError, match="unit 1 is full"):
        driver.run(core.put(_batch(2)))
    assert driver.sent(AbortPut) == [AbortPut("train", [0, 1])]
    driver = Scripted(_answers(BeginPut=PutPlan([2], [0]), CommitPut=Ok()))
    driver.run(core.put(_batch(1)))
    assert driver.sent(BeginPut)[0].stay == -1, "a failed put's unit is not remembered"


def test_a_put_whose_commit_times_out_is_aborted():
    core = _core()
    driver = Scripted(
        _answers(BeginPut=PutPlan([0, 1], [0, 1]), CommitPut=_raise(tq.TimeoutError("no answer")), AbortPut=Ok())
    )
    with pytest.raises(tq.TimeoutError, match="no answer"):
        driver.run(core.put(_batch(2)))
    assert driver.sent(AbortPut) == [AbortPut("train", [0, 1])]


def test_a_put_whose_abort_fails_too_raises_the_first_error():
    core = _core()
    driver = Scripted(
        _answers(
            BeginPut=PutPlan([0], [0]),
            CommitPut=ErrorReply("internal", "KeyError: 7"),
            AbortPut=_raise(tq.ServiceError("the controller died")),
        )
    )
    with pytest.raises(tq.InternalError, match="KeyError"):
        driver.run(core.put(_batch(1)))


def test_a_put_checks_its_input_before_sending_anything():
    core = _core()
    driver = Scripted(_answers())
    with pytest.raises(tq.SchemaError, match="groups"):
        driver.run(core.put(_batch(2), groups=[1]))
    with pytest.raises(tq.SchemaError, match="meta has 3"):
        driver.run(core.put(_batch(2), meta=_meta([0, 1, 2])))
    assert driver.steps == []


# -- get_meta ----------------------------------------------------------------------------


def test_get_meta_asks_the_controller_and_waits_past_the_timeout():
    core = _core()
    driver = Scripted(_answers(GetMeta=MetaReply(_meta([3, 4]))))
    meta = driver.run(core.get_meta(["x"], 2, task="t", timeout=7.0, sampler="grpo_group", group_size=2))
    (call,) = driver.steps[0]
    assert call.wait == 7.0 + GRACE, "the controller answers at the timeout; the client waits a grace longer"
    assert (
        call.msg.fields == ["x"] and call.msg.sampler == "grpo_group" and call.msg.sampler_options == {"group_size": 2}
    )
    assert meta.indexes == [3, 4]


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (ErrorReply("timeout", "too few ready samples"), tq.TimeoutError),
        (ErrorReply("schema", "no partition"), tq.SchemaError),
        (ErrorReply("stale", "too stale"), tq.StaleError),
        (_raise(tq.ServiceError("the controller at tcp://x stopped answering")), tq.ServiceError),
    ],
)
def test_get_meta_raises_the_error_of_its_reply(answer, error):
    driver = Scripted(_answers(GetMeta=answer))
    with pytest.raises(error):
        driver.run(_core().get_meta(["x"], 2, task="t"))


def test_get_meta_refuses_a_bad_batch_size_before_sending():
    driver = Scripted(_answers())
    with pytest.raises(tq.SchemaError, match="batch_size"):
        driver.run(_core().get_meta(["x"], 0, task="t"))
    assert driver.steps == []


# -- stream ------------------------------------------------------------------------------


class _Partition:
    """The controller and one unit, scripted: `batches` lease in turn, then the sealed
    partition is drained (an empty batch)."""

    def __init__(self, batches: list[list[int]], fail_read: int | None = None):
        self.batches = list(batches)
        self.fail_read = fail_read
        self.reads = 0

    def answer(self, call: Call) -> Any:
        msg = call.msg
        if isinstance(msg, GetMeta):
            return MetaReply(_meta(self.batches.pop(0) if self.batches else [], msg.task))
        if isinstance(msg, Read):
            self.reads += 1
            if self.reads == self.fail_read:
                return ErrorReply("internal", "ZeroDivisionError: in the unit")
            values = np.asarray(msg.indexes, np.int64) * 10
            return ReadReply({}, {"x": [(0, values.nbytes)]}), [bytearray(values.tobytes())]
        assert isinstance(msg, (Ack, Nack)), msg
        return Ok()


def test_stream_hands_out_each_batch_and_acks_it_when_the_next_is_taken():
    partition = _Partition([[0, 1], [2, 3]])
    driver = Scripted(partition.answer)
    seen = [
        (batch["x"].tolist(), meta.indexes)
        for batch, meta in driver.iterate(_core().stream(["x"], 2, "t", "train", 5.0, {}))
    ]
    assert seen == [([0, 10], [0, 1]), ([20, 30], [2, 3])]
    assert [a.indexes for a in driver.sent(Ack)] == [[0, 1], [2, 3]] and driver.sent(Nack) == []


def test_leaving_a_stream_early_gives_back_the_batch_in_hand_and_the_prefetched_one():
    partition = _Partition([[0, 1], [2, 3], [4, 5]])
    driver = Scripted(partition.answer)
    for _, meta in driver.iterate(_core().stream(["x"], 2, "t", "train", 5.0, {})):
        assert meta.indexes == [0, 1]
        break
    assert driver.sent(Ack) == []
    assert sorted(n.indexes for n in driver.sent(Nack)) == [[0, 1], [2, 3]]


def test_a_failed_read_in_a_stream_gives_its_lease_back_and_raises():
    partition = _Partition([[0, 1], [2, 3]], fail_read=2)
    driver = Scripted(partition.answer)
    stream = driver.iterate(_core().stream(["x"], 2, "t", "train", 5.0, {}))
    _, meta = next(stream)
    assert meta.indexes == [0, 1]
    with pytest.raises(tq.InternalError, match="ZeroDivisionError"):
        next(stream)  # taking the next batch acks the one in hand; the next one's read failed
    assert [a.indexes for a in driver.sent(Ack)] == [[0, 1]]
    assert [n.indexes for n in driver.sent(Nack)] == [[2, 3]], "the failed batch's lease is given back"
