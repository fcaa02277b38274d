"""Late acks on an in-process controller: samples another consumer of the task was handed since
the acker's lease expired stay with it, also once they were acked, cleared and compacted away.

Leases are ended as their timers would end them (`Scheduler._expire_lease`); nothing waits."""

from __future__ import annotations

import pytest

from controllers.service import Controller
from tests.controllers.journaled import journaled_controller, state, stop
from transfer_queue.wire.errors import LeaseExpiredError, SchemaError
from transfer_queue.wire.messages import (
    Ack,
    BeginPut,
    Clear,
    CommitPut,
    GetMeta,
    Ok,
    RegisterUnit,
    RowInfo,
    UnitInfo,
)
from transfer_queue.wire.meta import BatchMeta, FieldSpec

SPECS = {"x": FieldSpec("int64", ())}


def _controller(path) -> Controller:
    ctl = journaled_controller(path, "lateacks")
    ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30), "s"), [])
    return ctl


def _put(ctl: Controller, n: int) -> list[int]:
    plan = ctl.puts.on_begin_put(BeginPut("p", SPECS, n, 8), [])
    ctl.puts.landed(plan.indexes[0], 0)
    assert ctl.puts.on_commit_put(CommitPut("p", plan.indexes, SPECS, RowInfo([0] * n, [0] * n, [0] * n, [0] * n)), [])
    return plan.indexes


async def _lease(ctl: Controller, n: int) -> BatchMeta:
    return (await ctl.on_get_meta(GetMeta("p", "t", ["x"], n, timeout=0), [])).meta


async def test_a_late_ack_after_its_samples_were_cleared_and_compacted(tmp_path) -> None:
    """A churning partition (ack + clear) compacts its table: the late ack's indexes that are gone
    are neither taken nor refused, the rest line up with their rows, and the journal records
    exactly what it took."""
    path = tmp_path / "j"
    ctl = _controller(path)
    _put(ctl, 3000)
    late = await _lease(ctl, 3000)
    ctl.scheduler._expire_lease(late.lease_id)
    b = await _lease(ctl, 2000)
    assert ctl.on_ack(Ack("p", "t", b.indexes, b.lease_id), []) == Ok()
    assert ctl.on_clear(Clear("p", b.indexes), []) == Ok()
    part = ctl.ledger.partitions["p"]
    assert part.wasteful()
    part.compact()
    assert part.n == 1000
    c = await _lease(ctl, 500)
    assert c.indexes == late.indexes[2000:2500]
    with pytest.raises(LeaseExpiredError, match=r"500 of its 3000 samples .*\(500 acked\)"):
        ctl.on_ack(Ack("p", "t", late.indexes, late.lease_id), [])
    assert ctl.scheduler.leases[c.lease_id].outstanding == 500  # C's lease whole
    assert ctl.scheduler.ack_refused == 500
    before = state(ctl)
    assert before["p"]["consumed"]["t"] == [False] * 500 + [True] * 500
    stop(ctl)
    again = _controller(path)  # the replay consumes the 500 the late ack took, no others
    assert state(again) == before
    stop(again)


async def test_an_ack_of_indexes_the_partition_never_had_acks_nothing(tmp_path) -> None:
    ctl = _controller(tmp_path / "j")
    indexes = _put(ctl, 4)
    meta = await _lease(ctl, 4)
    with pytest.raises(SchemaError, match=r"\[4\]"):
        ctl.on_ack(Ack("p", "t", indexes + [4], meta.lease_id), [])
    assert ctl.scheduler.leases[meta.lease_id].outstanding == 4 and ctl.scheduler.acked == 0
    stop(ctl)


async def test_a_late_ack_after_the_other_consumer_acked_and_cleared(tmp_path) -> None:
    """Clearing a sample keeps who consumed it (until compaction drops its row)."""
    ctl = _controller(tmp_path / "j")
    _put(ctl, 4)
    late = await _lease(ctl, 4)
    ctl.scheduler._expire_lease(late.lease_id)
    b = await _lease(ctl, 4)
    assert ctl.on_ack(Ack("p", "t", b.indexes, b.lease_id), []) == Ok()
    assert ctl.on_clear(Clear("p", b.indexes), []) == Ok()
    with pytest.raises(LeaseExpiredError, match=r"4 of its 4 samples .*\(0 acked\)"):
        ctl.on_ack(Ack("p", "t", late.indexes, late.lease_id), [])
    assert ctl.scheduler.ack_refused == 4 and ctl.scheduler.acked == 4
    stop(ctl)


async def test_an_ack_under_a_lease_id_nobody_was_given_takes_what_no_lease_holds(tmp_path) -> None:
    """The largest lease id a message may carry is compared like any other (no overflow)."""
    ctl = _controller(tmp_path / "j")
    indexes = _put(ctl, 4)
    held = await _lease(ctl, 2)
    with pytest.raises(LeaseExpiredError, match="2 of its 4"):
        ctl.on_ack(Ack("p", "t", indexes, (1 << 63) - 1), [])
    assert ctl.scheduler.leases[held.lease_id].outstanding == 2 and ctl.scheduler.acked == 2
    stop(ctl)
