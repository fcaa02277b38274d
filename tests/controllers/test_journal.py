"""The controller journal in one process: replay after appends, after a compaction, and past a
torn last record gives back the same tables."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from controllers import journal as journal_mod
from controllers.records import Record, Table
from controllers.service import Controller
from tests.helpers import eventually_async
from transfer_queue.wire.errors import LeaseExpiredError, SchemaError
from transfer_queue.wire.messages import (
    Ack,
    BeginPut,
    ClearPartition,
    CommitPut,
    GetMeta,
    KvClear,
    KvKeys,
    KvResolve,
    KvTag,
    Ok,
    PutPlan,
    RegisterUnit,
    RowInfo,
    Seal,
    SetVersion,
    UnitInfo,
)
from transfer_queue.wire.meta import RAGGED, FieldSpec

from .journaled import journaled_controller, state, stop

SPECS = {"x": FieldSpec("int64", ())}
RAGGED2 = {"a": FieldSpec("int64", (RAGGED,)), "b": FieldSpec("int64", (RAGGED,))}


def _put(ctl: Controller, part: str, rows: RowInfo) -> PutPlan:
    """A put of 4 rows on unit 0, which reports its write stored (there is no unit process here)."""
    plan = ctl.puts.on_begin_put(BeginPut(part, SPECS, 4, 8), [])
    ctl.puts.landed(plan.indexes[0], 0)
    assert ctl.puts.on_commit_put(CommitPut(part, plan.indexes, SPECS, rows), []) == Ok()
    return plan


async def _fill(ctl: Controller) -> list[int]:
    """Changes of every kind; returns the indexes of a key's freed row (the key was put again)."""
    ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30), "s"), [])
    ctl.on_set_version(SetVersion(2), [])
    for part in ("a", "b"):
        for _ in range(3):
            plan = _put(ctl, part, RowInfo([1] * 4, [2] * 4, list(range(4)), [0] * 4))
    ctl.puts.on_commit_put(CommitPut("b", plan.indexes, {"y": FieldSpec("int64", ())}, None, 8), [])  # a new column
    # fields counted as their client gave them: the replay must not split the rows' bytes again
    plan = ctl.puts.on_begin_put(BeginPut("r", RAGGED2, 2, 80, field_bytes={"a": 64, "b": 16}), [])
    ctl.puts.landed(plan.indexes[0], 0)
    ctl.puts.on_commit_put(CommitPut("r", plan.indexes, RAGGED2, RowInfo([0] * 2, [0] * 2, [0] * 2, [0] * 2)), [])
    ctl.puts.on_commit_put(CommitPut("r", plan.indexes, {"b": RAGGED2["b"]}, None, 32, {"b": 32}), [])  # b again
    keyed = ctl.keys.on_resolve(KvResolve("k", ["p0", "p1"], create=True), []).meta  # rows of keys (TransferQueue face)
    ctl.keys.on_tag(KvTag("k", ["p1"], [{"status": "finished", "n": 2}]), [])
    ctl.puts.on_commit_put(CommitPut("k", keyed.indexes, SPECS, None, 8), [])  # their first column
    ctl.keys.on_clear(KvClear("k", ["p2"]), [])  # no such key: ignored
    gone = ctl.keys.on_resolve(KvResolve("k", ["p3"], create=True), []).meta.indexes
    ctl.keys.on_clear(KvClear("k", ["p3"]), [])
    ctl.keys.on_resolve(KvResolve("k", ["p3"], create=True), [])  # the key again, on a new row
    ctl.puts.on_begin_put(BeginPut("a", SPECS, 2, 8), [])  # placed, never committed: freed on replay
    ctl.on_ack(Ack("a", "t", [0, 1, 2]), [])
    ctl.on_seal(Seal("b"), [])
    return gone


async def test_replay_restores_the_tables(tmp_path) -> None:
    path = tmp_path / "j"
    ctl = journaled_controller(path, "journaltest")
    gone = await _fill(ctl)
    before = state(ctl)
    stop(ctl)
    again = journaled_controller(path, "journaltest")
    after = state(again)
    # the uncommitted put died with the old controller: its rows are freed, its index not reused
    assert after["a"]["gidx"] == before["a"]["gidx"][:-2] and all(after["a"]["committed"])
    before["a"] = {k: (v[:-2] if isinstance(v, list) else v) for k, v in before["a"].items()}
    before["a"]["ready"] = {"x": before["a"]["ready"]["x"][:-2]}
    before["a"]["field_bytes"] = {"x": before["a"]["field_bytes"]["x"][:-2]}
    before["a"]["consumed"] = {"t": before["a"]["consumed"]["t"][:-2]}
    before["a"]["v"] = tuple(v[:-2] for v in before["a"]["v"])
    before["bytes"] = {0: before["bytes"][0] - 16}
    assert after == before
    assert sorted(after["keys"]["k"]) == ["p0", "p1", "p3"], "the key index of the TransferQueue face came back"
    with pytest.raises(SchemaError):  # the freed row of a key put again has no key any more
        again.keys.on_keys(KvKeys("k", gone), [])
    assert after["b"]["sealed"] and after["version"] == 2 and after["a"]["consumed"]["t"][:4] == [True] * 3 + [False]
    stop(again)


async def test_compaction_and_a_torn_tail(tmp_path, monkeypatch) -> None:
    path = tmp_path / "j"
    monkeypatch.setattr(journal_mod, "_CHECK_EVERY", 1)
    monkeypatch.setattr(journal_mod, "_COMPACT_BYTES", 512)
    ctl = journaled_controller(path, "journaltest")
    await _fill(ctl)
    ctl.on_clear_partition(ClearPartition("b"), [])
    for _ in range(20):  # grows past the threshold again and again: compacted each time
        _put(ctl, "c", RowInfo([0] * 4, [0] * 4, [0] * 4, [0] * 4))
    size = os.path.getsize(path)
    assert size < 2 * 4096, size
    before = state(ctl)
    stop(ctl)
    with open(path, "ab") as f:
        f.write(b"\xff\x00\x00\x00partial")  # the process died in the middle of a write
    again = journaled_controller(path, "journaltest")
    after = state(again)
    assert "b" not in after and after["c"] == before["c"] and after["next"] >= before["next"]
    assert after["keys"] == before["keys"] and after["keys"]["k"]["p1"][1] == {"status": "finished", "n": 2}
    stop(again)


async def test_a_late_ack_journals_only_the_samples_it_took(tmp_path) -> None:
    """An ack whose lease expired and whose samples were partly leased again journals the ones it
    consumed, so a replay consumes those and no others."""
    path = tmp_path / "j"
    ctl = journaled_controller(path, "journaltest")
    ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30), "s"), [])
    _put(ctl, "a", RowInfo([0] * 4, [0] * 4, [0] * 4, [0] * 4))
    late = (await ctl.on_get_meta(GetMeta("a", "t", ["x"], 4, timeout=0, lease_timeout=0.01), [])).meta
    await eventually_async(lambda: not ctl.scheduler.leases, what="the lease expired")
    await ctl.on_get_meta(GetMeta("a", "t", ["x"], 2, timeout=0), [])  # another consumer takes two
    with pytest.raises(LeaseExpiredError, match="2 of its 4"):
        ctl.on_ack(Ack("a", "t", late.indexes, late.lease_id), [])
    before = state(ctl)
    assert before["a"]["consumed"]["t"] == [False, False, True, True]
    stop(ctl)
    again = journaled_controller(path, "journaltest")
    assert state(again) == before
    stop(again)


async def test_a_snapshot_from_before_field_bytes(tmp_path) -> None:
    """A snapshot written before field bytes were journaled holds none: each row's bytes are
    split over the fields it holds as an older client's put is, so writing a column again after
    the upgrade counts only the difference (left at 0, `a` again would count 2 x 24 bytes more)."""
    path = tmp_path / "j"
    ctl = journaled_controller(path, "journaltest")
    ctl.links.on_register_unit(RegisterUnit(UnitInfo(0, "tcp://127.0.0.1:9", 1 << 30), "s"), [])
    specs = {**SPECS, **RAGGED2}
    plan = ctl.puts.on_begin_put(BeginPut("r", specs, 2, 56), [])  # an older client's: x 8, a and b 24 each
    ctl.puts.landed(plan.indexes[0], 0)
    ctl.puts.on_commit_put(CommitPut("r", plan.indexes, specs, RowInfo([0] * 2, [0] * 2, [0] * 2, [0] * 2)), [])
    ctl.puts.on_commit_put(CommitPut("r", plan.indexes[:1], {"y": SPECS["x"]}, None, 8), [])  # rows of other fields
    before = state(ctl)
    stop(ctl)
    stop(journaled_controller(path, "journaltest"))  # opening it leaves a snapshot
    _without_field_bytes(path)
    again = journaled_controller(path, "journaltest")
    assert state(again) == before
    again.puts.on_commit_put(CommitPut("r", plan.indexes, {"a": RAGGED2["a"]}, None, 24), [])
    assert again.ledger.unit_bytes == before["bytes"] == {0: 120}
    stop(again)


def _without_field_bytes(path: Path) -> None:
    """Rewrite the journal at `path` as a release before field bytes wrote it: tables without."""
    decoder = msgspec.msgpack.Decoder(Record)
    data, pos, out = path.read_bytes(), 0, bytearray()
    while pos < len(data):
        (size,) = journal_mod._LEN.unpack_from(data, pos)
        rec = decoder.decode(data[pos + journal_mod._LEN.size : pos + journal_mod._LEN.size + size])
        pos += journal_mod._LEN.size + size
        if isinstance(rec, Table):
            rec = msgspec.structs.replace(rec, field_bytes={})
        body = msgspec.msgpack.encode(rec)
        out += journal_mod._LEN.pack(len(body)) + body
    path.write_bytes(bytes(out))


def test_a_corrupt_journal_is_refused(tmp_path) -> None:
    path = tmp_path / "j"
    path.write_bytes(b"\x03\x00\x00\x00zzz")
    with pytest.raises(SchemaError, match="corrupt"):
        list(journal_mod.Journal(path, "journaltest")._read())
