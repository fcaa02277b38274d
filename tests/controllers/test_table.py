"""The sample table stays the size of its live rows: freed rows are compacted away, global
indexes and every task's progress survive it, and a controller's journal replays past it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from controllers.service import Controller
from controllers.table import _INITIAL_ROWS, Partition
from transfer_queue.wire.errors import SchemaError
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
from transfer_queue.wire.meta import FieldSpec

from .journaled import journaled_controller, stop

SPECS = {"x": FieldSpec("int64", ())}


def _filled(rows: int) -> Partition:
    part = Partition("p")
    part.add_fields(SPECS)
    for first in range(0, rows, 100):
        got = part.append(10 * first, 100, np.zeros(100, np.int32), 8)  # indexes 10 apart per batch: sparse
        part.committed[got] = True
        part.mark_ready(got, ["x"])
    return part


def test_compaction_keeps_live_rows_their_indexes_and_each_tasks_progress() -> None:
    part = _filled(20_000)
    assert part.capacity >= 20_000
    task = part.task("t")
    part.consume(task, np.arange(0, 15_000))  # the first 15,000 consumed, then 14,000 of them freed
    part.kill(np.arange(1_000, 15_000))
    part.kill(np.arange(19_900, 20_000))
    assert part.live == 5_900 and part.wasteful()
    before = part.gidx[np.flatnonzero(part.alive[: part.n])].tolist()
    part.compact()
    assert part.n == part.live == 5_900 and part.capacity == 2 * 5_900
    assert part.gidx[: part.n].tolist() == before
    assert part.alive[: part.n].all() and part.committed[: part.n].all() and part.ready["x"][: part.n].all()
    assert task.consumed[: part.n].tolist() == [True] * 1_000 + [False] * 4_900
    assert task.cursor == 1_000, "the cursor moved with its rows"
    assert part.status().samples == 5_900 and part.outstanding(task) == 4_900
    # indexes stay unique: new rows continue after the highest, and a lookup still finds each
    rows = part.append(10**9, 4, np.zeros(4, np.int32), 8)
    assert part.gidx[rows].tolist() == list(range(10**9, 10**9 + 4))
    assert part.rows_of(before[-3:]).tolist() == [5_897, 5_898, 5_899]


def test_a_run_of_consecutive_live_rows_is_a_slice_and_anything_else_none() -> None:
    """`run` (an open put's rows at its commit) gives the rows of `first`..`first + n - 1` only
    when every one of them is there and alive, also after compaction moved them."""
    part = _filled(300)  # indexes 0..99, 1000..1099, 2000..2099
    assert part.run(1000, 100) == slice(100, 200)
    assert part.run(1010, 5) == slice(110, 115)
    assert part.run(1050, 100) is None, "past the batch: 1100.. were never placed"
    assert part.run(999, 2) is None and part.run(2050, 60) is None and part.run(5000, 1) is None
    part.kill(np.arange(0, 100))
    part.kill(np.array([150]))
    assert part.run(1040, 20) is None, "a freed row inside"
    assert part.run(1000, 50) == slice(100, 150)
    part.compact()
    assert part.run(1000, 50) == slice(0, 50) and part.run(2000, 100) == slice(99, 199)


def test_indexes_compacted_away_are_gone_not_unknown() -> None:
    part = _filled(2_000)
    gone = part.gidx[:1_500].tolist()
    part.kill(np.arange(1_500))
    part.compact()
    assert part.rows_of(gone, alive=False).tolist() == [], "a freed sample may be cleared or acked again"
    assert not part.holds(gone).any() and part.holds(part.gidx[:1].tolist()).all()
    with pytest.raises(SchemaError, match="no \\(live\\) samples"):
        part.rows_of(gone[:1])
    with pytest.raises(SchemaError, match=str(part.high)):
        part.rows_of([part.high], alive=False)  # never given to this partition


def test_the_table_shrinks_back_after_a_long_stream() -> None:
    part = Partition("p")
    part.add_fields(SPECS)
    task = part.task("t")
    first = 0
    for _ in range(2_000):  # 200,000 rows put, consumed and freed; 100 live at a time
        rows = part.append(first, 100, np.zeros(100, np.int32), 8)
        first += 100
        part.committed[rows] = True
        part.consume(task, rows)
        part.kill(rows)
        if part.wasteful():
            part.compact()
    assert part.capacity <= 2 * _INITIAL_ROWS and part.n <= 2 * _INITIAL_ROWS
    assert part.live == 0 and task.cursor == part.n


def _controller(path) -> Controller:
    ctl = journaled_controller(path, "tabletest")
    ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30), "s"), [])
    return ctl


def _put(ctl: Controller, n: int) -> list[int]:
    plan = ctl.puts.on_begin_put(BeginPut("p", SPECS, n, 8), [])
    ctl.puts.landed(plan.indexes[0], 0)
    assert ctl.puts.on_commit_put(CommitPut("p", plan.indexes, SPECS, RowInfo([0] * n, [0] * n, [0] * n, [0] * n)), [])
    return plan.indexes


async def test_a_controller_compacts_once_its_handlers_are_done_and_replays_after(tmp_path) -> None:
    ctl = _controller(tmp_path / "j")
    assert ctl.on_clear(Clear("p", _put(ctl, 200)), []) == Ok()  # rows before the kept ones: they move
    kept = _put(ctl, 50)
    leased = (await ctl.on_get_meta(GetMeta("p", "t", ["x"], 10, timeout=0), [])).meta
    for _ in range(400):  # 40,000 samples put, acked and cleared
        indexes = _put(ctl, 100)
        assert ctl.on_ack(Ack("p", "t", indexes), []) == Ok()
        assert ctl.on_clear(Clear("p", indexes), []) == Ok()
    part = ctl.ledger.partitions["p"]
    for _ in range(3):
        await asyncio.sleep(0)  # one turn of the loop: the compaction it scheduled runs
    assert part.capacity <= 2 * _INITIAL_ROWS, part.capacity
    assert part.gidx[: part.n].tolist() == kept and ctl.ledger.next_index == 250 + 40_000
    # the lease taken before the compaction still expires onto the right rows
    assert leased.indexes == kept[:10]
    ctl.scheduler._expire_lease(leased.lease_id)
    again = (await ctl.on_get_meta(GetMeta("p", "t", ["x"], 50, timeout=0), [])).meta
    assert again.indexes == kept
    assert ctl.on_clear(Clear("p", kept[:10] + indexes[:3]), []) == Ok(), "clearing freed samples again is harmless"
    stop(ctl)
    replayed = _controller(tmp_path / "j")
    part = replayed.ledger.partitions["p"]
    assert part.gidx[: part.n][part.alive[: part.n]].tolist() == kept[10:]
    assert part.capacity <= 2 * _INITIAL_ROWS and replayed.ledger.next_index == 250 + 40_000
    stop(replayed)
