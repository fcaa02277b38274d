"""The row index: placement of rows in chunks, run merging, replacement and freeing."""

from __future__ import annotations

import random
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


def test_removing_fields_keeps_the_rows_other_fields(arena: Arena) -> None:
    table = Table(arena)
    _insert(table, arena, "p", "x", DENSE, [0, 1])
    _insert(table, arena, "p", "ids", RAGGED_SPEC, [0, 1], lengths=[1, 1])
    assert table.remove("p", [0, 1, 99], ["ids", "nope"]) == 2
    assert arena.used == 32 and table.fields("p") == {"x": DENSE}  # the spec went with its last row
    assert table.row_counts() == {"p": 2} and table.read("p", [0, 1], ["x"]).runs["x"]
    table.check_specs("p", {"ids": FieldSpec("float16", (RAGGED,))})  # a new spec is welcome
    assert table.remove("p", [0, 1], ["x"]) == 2
    assert table.row_counts() == {} and arena.used == 0


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


def _model_plan(
    model: dict[str, dict[int, tuple[int, int, int, object]]], wanted: list[int], names: list[str]
) -> tuple[dict[str, list[tuple[int, int]]], dict[str, list[int]], list[list[object]]]:
    """A read's runs, lengths and chunks from each row's bytes looked up one by one and merged."""
    runs: dict[str, list[tuple[int, int]]] = {}
    chunks: list[list[object]] = []
    for name in names:
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
    return runs, {"ids": [model["ids"][i][2] for i in wanted]} if "ids" in names else {}, chunks


@pytest.mark.parametrize("seed", range(8))
def test_reads_match_a_row_by_row_model_through_writes_replacements_and_frees(arena: Arena, seed: int) -> None:
    """Rows kept by the write that laid them out: whatever mix of writes a read spans (a write's
    rows split over chunks, consecutive indexes or not, in or out of write order, exactly one
    write's rows), after rows were replaced, freed or their partition cleared, its runs, lengths
    and chunks are those of looking up each row's bytes one by one and merging neighbours, and
    every byte goes back when all are freed."""
    rng = random.Random(seed)
    table = Table(arena)
    specs = {"x": DENSE, "ids": RAGGED_SPEC}
    model: dict[str, dict[int, tuple[int, int, int, object]]] = {"x": {}, "ids": {}}
    for step in range(60):
        roll = rng.random()
        if roll < 0.1:
            freed = rng.sample(range(40), rng.randint(1, 10))
            table.remove("p", freed)
            for rows in model.values():
                for i in freed:
                    rows.pop(i, None)
            continue
        if roll < 0.13:
            table.remove("p")  # a whole partition cleared
            model = {"x": {}, "ids": {}}
            assert table.row_counts() == {} and arena.used == 0
            continue
        if rng.random() < 0.4:  # a put's rows on one unit: consecutive indexes
            lo = rng.randrange(36)
            indexes = list(range(lo, rng.randint(lo + 1, min(lo + 8, 40))))
        else:  # new fields of sampled rows, keyed rows: any order
            indexes = rng.sample(range(40), rng.randint(1, 8))
        names = rng.choice([["x"], ["ids"], ["x", "ids"]])
        lengths = [rng.randint(0, 3) for _ in indexes]
        cut = rng.randint(1, len(indexes))  # the unit may split a write's rows over two chunks
        for name in names:
            for a, b in ((0, cut), (cut, len(indexes))):
                if a == b:
                    continue
                lens = lengths[a:b] if specs[name].ragged else None
                chunk = _insert(table, arena, "p", name, specs[name], indexes[a:b], lens)
                offset = chunk.offset
                for i, k in zip(indexes[a:b], lens or [1] * (b - a)):
                    model[name][i] = (offset, k * specs[name].row_bytes, k, chunk)
                    offset += k * specs[name].row_bytes
        for name in names:
            held = sorted(model[name])
            kind = rng.random()
            if kind < 0.3 and all(i in model[name] for i in indexes[:cut]):
                wanted = indexes[:cut]  # exactly one chunk's rows in write order: the whole-write path
            elif kind < 0.6:
                wanted = sorted(rng.sample(held, rng.randint(1, len(held))))  # stretches in write order
            else:
                wanted = [rng.choice(held) for _ in range(rng.randint(1, len(held)))]  # repeats too
            plan = table.read("p", wanted, [name])
            runs, lens_by_name, chunks = _model_plan(model, wanted, [name])
            assert (plan.runs, plan.lengths, plan.chunks) == (runs, lens_by_name, chunks), f"step {step}"
    table.remove("p", range(40))
    assert arena.used == 0 and table.row_counts() == {}


def test_a_read_of_one_whole_write_is_its_chunk_as_one_run(arena: Arena) -> None:
    """The whole-write path: one write's rows, all live, read in write order (even when they are
    not consecutive indexes) are its chunk as one run, lengths as written; a read that drops, adds
    or reorders a row takes the row-by-row path and gives the same bytes."""
    table = Table(arena)
    x = _insert(table, arena, "p", "x", DENSE, [7, 3, 9])
    ids = _insert(table, arena, "p", "ids", RAGGED_SPEC, [7, 3, 9], lengths=[1, 3, 2])
    plan = table.read("p", [7, 3, 9], ["x", "ids"])
    assert plan.runs == {"x": [(x.offset, 48)], "ids": [(ids.offset, 48)]} and plan.lengths == {"ids": [1, 3, 2]}
    assert table.read("p", [7, 3], ["ids"]).runs == {"ids": [(ids.offset, 32)]}
    assert table.read("p", [3, 9], ["ids"]).lengths == {"ids": [3, 2]}
    assert table.read("p", [9, 7], ["x"]).runs == {"x": [(x.offset + 32, 16), (x.offset, 16)]}
    empty = table.read("p", [], ["x", "ids"])
    assert (empty.runs, empty.lengths, empty.chunks) == ({"x": [], "ids": []}, {"ids": []}, [])
