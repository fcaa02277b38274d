"""Benchmark of a storage unit's row index (`storage.table.Table`) on its own: what registering,
freeing and reading rows costs the unit's event loop, per access pattern.

A table holds 256 writes of 256 rows, 4 fields each (dense float32[4], or ragged int64 of 1-7
elements a row), every write's indexes consecutive as a put's are. Measured, medians:

- insert a write (4 fields), free a write's rows;
- read one write's rows as written (the one-run path);
- read 512 rows spanning two writes, in order (a batch across two puts, a FIFO sampler's);
- read 256 rows at random (a random or priority sampler's), the first such read and later ones.

Baseline, measured in the same run: the per-row dict look-ups alone that any read of scattered
rows needs (`lookups`). Goal: a random read costs at most 6x its look-ups (its per-row step
merging rows into runs; no per-segment work such as building a dict of a whole write).

    .venv/bin/python benchmarks/table_reads.py            # 5 rounds
    .venv/bin/python benchmarks/table_reads.py --rounds 2
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import random
import statistics
import time
import uuid
from collections.abc import Callable
from functools import partial

from benchmarks._common import exit_on_sigterm, print_table
from storage.arena import Arena
from storage.table import Table
from transfer_queue.wire.meta import RAGGED, FieldSpec

WRITES, ROWS, FIELDS = 256, 256, ("a", "b", "c", "d")
SPECS = {"dense": FieldSpec("float32", (4,)), "ragged": FieldSpec("int64", (RAGGED,))}
RANDOM_LIMIT = 6.0  # a random read against its dict look-ups


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _write(table: Table, arena: Arena, spec: FieldSpec, w: int) -> None:
    indexes = list(range(w * ROWS, (w + 1) * ROWS))
    lengths = [i % 7 + 1 for i in range(ROWS)] if spec.ragged else None
    nbytes = spec.row_bytes * (sum(lengths) if lengths is not None else ROWS)
    for name in FIELDS:
        chunk = arena.new_chunk(nbytes)
        assert chunk is not None, "the arena holds every write"
        table.insert("p", name, spec, indexes, chunk, lengths)
        arena.unref(chunk)


def _round(spec: FieldSpec, rng: random.Random) -> dict[str, float]:
    """One round's medians (seconds) on a fresh table."""
    with Arena(f"/dev/shm/sluice-bench-{uuid.uuid4().hex[:8]}", 1 << 27) as arena:
        table = Table(arena)
        inserts = [_timed(partial(_write, table, arena, spec, w)) for w in range(WRITES)]
        fields = list(FIELDS)

        def read(wanted: list[int]) -> float:
            return _timed(lambda: table.read("p", wanted, fields))

        def lookups(wanted: list[int]) -> float:
            columns = table.partitions["p"].columns
            return _timed(lambda: [list(map(columns[f].rows.__getitem__, wanted)) for f in fields])

        samples = [rng.sample(range(WRITES * ROWS), ROWS) for _ in range(21)]
        got = {"random, first": read(samples[0])}
        got["random"] = statistics.median(read(s) for s in samples[1:])
        got["lookups"] = statistics.median(lookups(s) for s in samples[1:])
        got["insert"] = statistics.median(inserts)
        got["whole write"] = statistics.median(read(list(range(w * ROWS, (w + 1) * ROWS))) for w in range(20))
        got["two writes"] = statistics.median(read(list(range(w * ROWS, (w + 2) * ROWS))) for w in range(0, 40, 2))
        got["free"] = statistics.median(
            _timed(partial(table.remove, "p", range(w * ROWS, (w + 1) * ROWS))) for w in range(100, 140)
        )
        return got


def main() -> None:
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    failed = False
    for kind, spec in SPECS.items():
        rounds = [_round(spec, rng) for _ in range(args.rounds)]
        med = {key: statistics.median(r[key] for r in rounds) * 1e6 for key in rounds[0]}
        ratio = med["random"] / med["lookups"]
        failed |= ratio > RANDOM_LIMIT
        rows.append(
            [kind, med["insert"], med["free"], med["whole write"], med["two writes"], med["random, first"]]
            + [med["random"], med["lookups"], ratio]
        )
    header = ["field", "insert", "free", "one write", "two writes", "random 1st", "random", "lookups", "x lookups"]
    print_table(
        f"Table, 4 fields x {ROWS} rows, {WRITES} writes held (us, medians of {args.rounds} rounds)", header, rows
    )
    print(f"goal: random read <= {RANDOM_LIMIT:g}x its look-ups: {'MISSED' if failed else 'met'}")


if __name__ == "__main__":
    main()
