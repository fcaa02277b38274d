"""Reads through a mapped arena that race a clear: the reader copies after the unit's reply named
the runs, and a clear plus a put landing in those extents meanwhile must not hand it the new
put's bytes (docs/storage.md, "Reads through the mapped arena").

The race is made deterministic with real processes: the reader's copy step (`_assemble`, which
runs between the unit's reply and the copies) first lets a second client clear rows and put new
ones, waiting until the unit has freed the cleared rows."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from storage_harness import UnitClient
from tensordict import TensorDict

import transfer_queue as tq
import transfer_queue._client_core as client_core
from transfer_queue.wire.messages import Read, UnitStatus


def _batch(value: float, rows: int = 8, width: int = 1024) -> TensorDict:
    return TensorDict({"x": torch.full((rows, width), value)}, batch_size=[rows])


def _runs(unit: UnitClient, meta: tq.BatchMeta) -> list[tuple[int, int]]:
    reply, _ = unit.ok(Read(meta.partition, list(meta.indexes), ["x"], "shm"))
    return [tuple(run) for run in reply.runs["x"]]


def _wait_freed(unit: UnitClient, partition: str, rows: int, timeout: float = 10.0) -> None:
    """Wait until the unit holds `rows` rows of `partition` (the controller's Free is posted)."""
    deadline = time.monotonic() + timeout
    while unit.ok(UnitStatus())[0].status["rows"].get(partition, 0) != rows:
        assert time.monotonic() < deadline, "the unit never freed the cleared rows"


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(o1 < o2 + n2 and o2 < o1 + n1 for o1, n1 in a for o2, n2 in b)


@pytest.fixture
def clients(make_cluster) -> Iterator[tuple[tq.Client, tq.Client, UnitClient]]:
    """A reader and a writer, both mapping the one unit's arena, and a channel to the unit."""
    cluster = make_cluster(num_storage_units=1, storage_capacity="16MiB")
    with tq.connect(cluster.address) as reader, tq.connect(cluster.address) as writer:
        assert reader.mapped_units == {0} and writer.mapped_units == {0}
        unit = UnitClient(reader._core.units[0].address)
        try:
            yield reader, writer, unit
        finally:
            unit.close()


def _between_reply_and_copy(monkeypatch, meanwhile: Callable[[], None]) -> list[int]:
    """Run `meanwhile` once, in the reader's first `_assemble` (after the units replied, before
    it copies); returns the list that counts `_assemble` calls."""
    calls: list[int] = []
    assemble = client_core._assemble

    def hooked(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            meanwhile()
        return assemble(*args, **kwargs)

    monkeypatch.setattr(client_core, "_assemble", hooked)
    return calls


def test_a_mapped_read_whose_rows_are_cleared_and_reused_meanwhile_raises(clients, monkeypatch) -> None:
    reader, writer, unit = clients
    first = writer.put(_batch(1.0))
    first_runs = _runs(unit, first)
    reused: list[list[tuple[int, int]]] = []

    def clear_and_put() -> None:
        writer.clear(first)
        _wait_freed(unit, "train", 0)
        second = writer.put(_batch(2.0))
        reused.append(_runs(unit, second))

    _between_reply_and_copy(monkeypatch, clear_and_put)
    with pytest.raises(tq.SchemaError, match="holds no row"):
        data = reader.get_data(first)
        pytest.fail(f"read another put's bytes: values {torch.unique(data['x']).tolist()}")
    assert _overlap(first_runs, reused[0]), "the second put did not reuse the first's extent: no race was made"


def test_a_mapped_read_whose_rows_are_replaced_meanwhile_reads_them_again(clients, monkeypatch) -> None:
    """The rows still exist, with new values elsewhere, and their old extent holds another put's
    bytes: the reader reads the rows again (as frames), and gets their new values."""
    reader, writer, unit = clients
    first = writer.put(_batch(1.0))
    first_runs = _runs(unit, first)
    reused: list[list[tuple[int, int]]] = []

    def replace_and_put() -> None:
        writer.put(_batch(5.0), meta=first)  # new values of the same rows: the unit freed the old before answering
        other = writer.put(_batch(2.0))
        reused.append(_runs(unit, other))

    calls = _between_reply_and_copy(monkeypatch, replace_and_put)
    data = reader.get_data(first)
    assert torch.unique(data["x"]).tolist() == [5.0]
    assert len(calls) == 2  # the mapped read could not vouch for its bytes: read again as frames
    assert _overlap(first_runs, reused[0]), "the other put did not reuse the old extent: no race was made"


def test_a_mapped_read_whose_neighbour_is_freed_meanwhile_keeps_its_copy(clients, monkeypatch) -> None:
    """Only a free that overlaps the runs read makes the reader read again: a neighbour's (cleared
    and its extent written again) is no alarm."""
    reader, writer, unit = clients
    kept = writer.put(_batch(1.0, width=16))
    neighbour = writer.put(_batch(3.0, width=16))  # the next 512 bytes of arena
    assert _runs(unit, neighbour)[0][0] == sum(_runs(unit, kept)[0])

    def clear_neighbour() -> None:
        writer.clear(neighbour)
        _wait_freed(unit, "train", len(kept))
        writer.put(_batch(4.0, width=16))

    calls = _between_reply_and_copy(monkeypatch, clear_neighbour)
    data = reader.get_data(kept)
    assert torch.equal(data["x"], _batch(1.0, width=16)["x"])
    assert len(calls) == 1
