"""The row index: placement of rows in chunks, run merging, replacement and freeing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from storage.arena import Arena
from storage.table import Table
from transfer_queue.wire.errors import SchemaError
from transfer_queue.wire.meta import RAGGED, FieldSpec

DENSE = FieldSpec("float32", (4,))  # 16 bytes per row
RAGGED_SPEC = FieldSpec("int64", (RAGGED,))  # 8 bytes per element


@pytest.fixture
def arena() -> Iterator[Arena]:
    with Arena(f"/dev/shm/sluice-test-{uuid.uuid4().hex[:8]}-u0", 1 << 20) as a:
        yield a


def _insert(table: Table, arena: Arena, partition: str, name: str, spec: FieldSpec, indexes, lengths=None):
    nbytes = spec.row_bytes * (sum(lengths) if lengths is not None else len(indexes))
    chunk = arena.new_chunk(nbytes)
    table.insert(partition, name, spec, indexes, chunk, lengths)
    arena.unref(chunk)  # the creator's reference
    return chunk


def test_dense_rows_merge_into_runs_in_request_order(arena: Arena) -> None:
    table = Table(arena, unit_id=4)
    a = _insert(table, arena, "p", "x", DENSE, [10, 11, 12, 13])
    b = _insert(table, arena, "p", "x", DENSE, [20, 21])
    assert b.offset == a.offset + 64  # packed: the first write's 64 bytes, then the next
    plan = table.read("p", [11, 12, 13, 20, 21, 10], ["x"])
    # rows 13 and 20 are adjacent in the arena: one run over both chunks
    assert plan.runs == {"x": [(a.offset + 16, 80), (a.offset, 16)]}
    assert plan.lengths == {}
    assert plan.chunks == [[a, b], [a]]
    assert table.row_counts() == {"p": 6}


def test_ragged_rows_keep_lengths_and_skip_empty_rows(arena: Arena) -> None:
    table = Table(arena)
    c = _insert(table, arena, "p", "ids", RAGGED_SPEC, [0, 1, 2, 3], lengths=[3, 0, 2, 5])
    plan = table.read("p", [0, 1, 2, 3], ["ids"])
    assert plan.lengths == {"ids": [3, 0, 2, 5]}
    assert plan.runs == {"ids": [(c.offset, 80)]}
    plan = table.read("p", [1], ["ids"])
    assert plan.runs == {"ids": []} and plan.lengths == {"ids": [0]}
    plan = table.read("p", [3, 0], ["ids"])
    assert plan.runs == {"ids": [(c.offset + 40, 40), (c.offset, 24)]}


def test_replacing_a_row_releases_the_old_chunk(arena: Arena) -> None:
    table = Table(arena)
    first = _insert(table, arena, "p", "x", DENSE, [0, 1])
    assert arena.used == 32
    _insert(table, arena, "p", "x", DENSE, [1])
    assert arena.used == 48  # row 0 still holds the first chunk
    new = _insert(table, arena, "p", "x", DENSE, [0])
    assert new.offset == 48
    assert arena.used == 32  # the first chunk went back when its last row was replaced
    assert arena.alloc(1) == first.offset
    assert table.row_counts() == {"p": 2}


def test_remove_is_idempotent_and_frees_chunks(arena: Arena) -> None:
    table = Table(arena)
    _insert(table, arena, "p", "x", DENSE, [0, 1, 2])
    _insert(table, arena, "p", "ids", RAGGED_SPEC, [0, 1, 2], lengths=[1, 1, 1])
    _insert(table, arena, "q", "x", DENSE, [0])
    assert table.remove("p", [1, 99]) == 1
    assert table.remove("p", [1]) == 0
    assert table.remove("nope", [1]) == 0
    assert arena.used == 48 + 32 + 16  # p's x and ids chunks (rows 0 and 2 hold them) and q's
    assert table.remove("p", [0, 2]) == 2
    assert table.row_counts() == {"q": 1} and arena.used == 16
    assert table.fields("p") == {}  # the spec is forgotten with the last row
    assert table.remove("q") == 1 and arena.used == 0


def test_schema_errors_say_what_is_missing(arena: Arena) -> None:
    table = Table(arena, unit_id=2)
    _insert(table, arena, "p", "x", DENSE, [0, 1])
    with pytest.raises(SchemaError, match="no rows of partition 'q'"):
        table.read("q", [0], ["x"])
    with pytest.raises(SchemaError, match="has no field 'y'"):
        table.read("p", [0], ["y"])
    with pytest.raises(SchemaError, match=r"no row\(s\) \[5, 7\] \(2 of 3 requested\) of field 'x'"):
        table.read("p", [0, 5, 7], ["x"])
    with pytest.raises(SchemaError, match="holds rows of dtype float32"):
        table.check_specs("p", {"x": FieldSpec("float16", (4,))})
    table.check_specs("p", {"x": DENSE, "y": FieldSpec("int8", ())})


def test_a_read_of_one_writes_rows_is_one_run_until_a_row_is_replaced_or_freed(arena: Arena) -> None:
    table = Table(arena)
    a = _insert(table, arena, "p", "x", DENSE, [0, 1, 2])
    c = _insert(table, arena, "p", "ids", RAGGED_SPEC, [0, 1, 2], lengths=[2, 0, 1])
    plan = table.read("p", [0, 1, 2], ["x", "ids"])
    assert plan.runs == {"x": [(a.offset, 48)], "ids": [(c.offset, 24)]}
    assert plan.lengths == {"ids": [2, 0, 1]} and plan.chunks == [[a], [c]]
    assert table.read("p", [2, 1, 0], ["x"]).runs == {"x": [(a.offset + 32, 16), (a.offset + 16, 16), (a.offset, 16)]}
    b = _insert(table, arena, "p", "x", DENSE, [1])  # a producer's retry replaces row 1
    assert table.read("p", [0, 1, 2], ["x"]).runs == {"x": [(a.offset, 16), (b.offset, 16), (a.offset + 32, 16)]}
    assert table.remove("p", [1]) == 1
    with pytest.raises(SchemaError, match=r"no row\(s\) \[1\]"):
        table.read("p", [0, 1, 2], ["ids"])
    assert table.read("p", [0, 2], ["ids"]).runs == {"ids": [(c.offset, 24)]}  # row 1 held no bytes of it
    assert table.remove("p", [0, 2]) == 2 and arena.used == 0


def test_reads_match_a_row_by_row_model_through_writes_replacements_and_frees(arena: Arena) -> None:
    """Rows kept by the write that laid them out: whatever mix of writes a read spans, in any
    order, after rows were replaced or freed, its runs, lengths and chunks are those of looking up
    each row's bytes one by one and merging neighbours, and every byte goes back when all are
    freed."""
    import random

    rng = random.Random(7)
    table = Table(arena)
    model: dict[str, dict[int, tuple[int, int, int, object]]] = {"x": {}, "ids": {}}
    for step in range(60):
        indexes = rng.sample(range(40), rng.randint(1, 8))
        if rng.random() < 0.5:
            indexes.sort()  # a put's rows, in order
        if step % 7 == 6:
            table.remove("p", indexes)
            for rows in model.values():
                for i in indexes:
                    rows.pop(i, None)
            continue
        lengths = [rng.randint(0, 3) for _ in indexes]
        for name, spec, lens in (("x", DENSE, None), ("ids", RAGGED_SPEC, lengths)):
            chunk = _insert(table, arena, "p", name, spec, indexes, lens)
            offset = chunk.offset
            for i, k in zip(indexes, lens or [1] * len(indexes)):
                model[name][i] = (offset, k * spec.row_bytes, k, chunk)
                offset += k * spec.row_bytes
        held = sorted(model["x"])
        wanted = rng.sample(held, rng.randint(1, len(held)))
        if rng.random() < 0.3:
            wanted.sort()
        plan = table.read("p", wanted, ["x", "ids"])
        runs: dict[str, list[tuple[int, int]]] = {}
        chunks: list[list[object]] = []
        for name in ("x", "ids"):
            runs[name] = []
            end = -1
            for offset, nbytes, _, chunk in (model[name][i] for i in wanted):
                if not nbytes:
                    continue
                if offset == end:
                    runs[name][-1] = (runs[name][-1][0], runs[name][-1][1] + nbytes)
                    if chunks[-1][-1] is not chunk:
                        chunks[-1].append(chunk)
                else:
                    runs[name].append((offset, nbytes))
                    chunks.append([chunk])
                end = offset + nbytes
        assert plan.runs == runs, f"step {step}"
        assert plan.lengths == {"ids": [model["ids"][i][2] for i in wanted]}
        assert plan.chunks == chunks
    assert table.remove("p", range(40)) == len(model["x"])
    assert arena.used == 0 and table.row_counts() == {}
