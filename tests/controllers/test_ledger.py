"""The ledger of rows on its own (it needs no controller): byte counts per unit follow the live
rows through new rows, new columns, frees, a dropped partition and a retired unit; every change
is recorded once, and frees are passed on to the units."""

from __future__ import annotations

import numpy as np
import pytest

from controllers.ledger import Ledger
from controllers.records import Freed, Placed, Record
from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.messages import UnitInfo
from transfer_queue.wire.meta import FieldSpec

X = {"x": FieldSpec("int64", ())}


def _ledger() -> tuple[Ledger, list[Record], list[tuple[str, dict | None]]]:
    records: list[Record] = []
    freed: list[tuple[str, dict | None]] = []
    ledger = Ledger(records.append)
    ledger.freed = lambda partition, rows: freed.append((partition, rows))
    for unit_id in (0, 1):
        ledger.add_unit(UnitInfo(unit_id, f"tcp://127.0.0.1:{unit_id + 1}", 1000))
    return ledger, records, freed


def test_rows_are_counted_on_their_units_and_freed_once():
    ledger, records, freed = _ledger()
    part = ledger.partition("p")
    units = np.array([0, 0, 1], np.int64)
    first = ledger.new_rows(part, units, {"x": 10}, X, ledger.shares(units, 10))
    assert (first, ledger.next_index) == (0, 3)
    assert ledger.unit_bytes == {0: 20, 1: 10} and ledger.room() == {0: 980, 1: 990}
    assert records == [Placed("p", 0, [0, 0, 1], 10, X, False, {"x": 10})]
    y = {"y": FieldSpec("int8", (5,))}
    ledger.write_fields(part, part.rows_of([0, 2]), y, {"y": 5})  # a new column of two rows
    assert ledger.unit_bytes == {0: 25, 1: 15}
    ledger.write_fields(part, part.rows_of([0, 2]), y, {"y": 5})  # written again: replaced, not added
    assert ledger.unit_bytes == {0: 25, 1: 15}
    rows = part.rows_of([1, 2])
    ledger.free_rows(part, rows)
    ledger.free_rows(part, rows)  # already dead: nothing happens twice
    assert ledger.unit_bytes == {0: 15, 1: 0}
    assert records[1:] == [Freed("p", [1, 2])]
    assert freed == [("p", {0: [1], 1: [2]})]
    assert ledger.new_rows(part, np.array([1], np.int64), {"x": 0}, X, {}) == 3, "indexes are never reused"


def test_a_dropped_partition_and_a_retired_unit_leave_no_bytes_behind():
    ledger, _, freed = _ledger()
    part = ledger.partition("p")
    units = np.array([0, 1], np.int64)
    ledger.new_rows(part, units, {"x": 10}, X, ledger.shares(units, 10))
    assert ledger.retire_unit(1).unit_id == 1 and ledger.unit_bytes == {0: 10}
    assert ledger.shares(units, 10) == {0: 10}, "a retired unit takes no share"
    ledger.drop_partition("p")
    assert ledger.unit_bytes == {0: 0} and "p" not in ledger.partitions and freed == [("p", None)]
    with pytest.raises(SchemaError, match="no partition named 'p'"):
        ledger.existing("p")
    with pytest.raises(SchemaError, match="non-empty name"):
        ledger.partition("")


def test_replayed_rows_keep_their_indexes_and_are_not_recorded_again():
    ledger, records, _ = _ledger()
    ledger.restore_rows(Placed("p", 7, [1, 1], 4, X, True))
    part = ledger.partitions["p"]
    assert part.gidx[: part.n].tolist() == [7, 8] and part.committed[: part.n].all()
    assert ledger.unit_bytes == {0: 0, 1: 8} and ledger.next_index == 9 and records == []
    ledger.advance(5)
    assert ledger.next_index == 9, "a replay never moves the next index back"
