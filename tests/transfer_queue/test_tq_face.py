"""TransferQueue 0.1.11's API on a real Sluice cluster (controller and unit processes, ZeroMQ)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

import transfer_queue as tq
from tests.verl.tq_signatures import CLASSES, FUNCTIONS
from transfer_queue.compat.face import ENV_ADDRESS

TQ_NAMES = {*FUNCTIONS, *CLASSES}
"""TransferQueue's public names (the parity check's list: tests/verl/tq_signatures.py)."""
CONF = {"backend": {"SimpleStorage": {"num_data_storage_units": 2}}, "sluice": {"storage_capacity": "64MiB"}}


def stack(values):
    return NonTensorStack(*(NonTensorData(v) for v in values), stack_dim=0)


def padded(value: torch.Tensor) -> torch.Tensor:
    """A field read through TransferQueue's API (jagged, as TransferQueue returns it) as a dense tensor."""
    assert value.is_nested, "TransferQueue hands per-sample tensors back jagged"
    return value.to_padded_tensor(0)


def entry(data: TensorDict, name: str):
    """The stored entry (`td[name]` unwraps non-tensor entries to their values)."""
    return dict(data.items())[name]


@pytest.fixture(scope="module")
def face():
    conf = tq.init(CONF)
    try:
        yield conf
    finally:
        tq.close()


def test_transfer_queue_names_exist():
    assert set(tq.__all__) >= TQ_NAMES
    client_methods = {"get_data", "put", "kv_retrieve_meta", "kv_retrieve_keys", "kv_list", "clear_samples"}
    for name in client_methods:
        assert callable(getattr(tq.TransferQueueClient, name))
        assert asyncio.iscoroutinefunction(getattr(tq.TransferQueueClient, f"async_{name}"))


def test_init_conf_starts_sluice_and_exports_the_address(face):
    assert face["sluice"]["address"].startswith("tcp://")
    assert os.environ[ENV_ADDRESS] == face["sluice"]["address"]
    assert tq.init() is None  # attaches: TransferQueue's init() in a worker
    assert tq.get_client().address == face["sluice"]["address"]


def test_kv_batch_put_get_with_tags_and_varying_lengths(face):
    keys = ["u1_0_0", "u1_0_1"]
    meta = tq.kv_batch_put(
        keys,
        "p1",
        TensorDict({"ids": torch.arange(6).view(2, 3)}, batch_size=[2]),
        tags=[{"status": "finished", "global_steps": 3}, {"status": "running"}],
    )
    assert meta.keys == keys and meta.fields == ["ids"] and meta.partition_id == "p1"
    assert meta.tags == [{"status": "finished", "global_steps": 3}, {"status": "running"}]
    tq.kv_put("u2", "p1", fields={"ids": torch.arange(5)}, tag={"is_prompt": True})
    tq.kv_batch_put(keys[1:], "p1", tags=[{"status": "finished"}])  # tags merge, data stays
    assert tq.kv_list("p1") == {
        "p1": {
            "u1_0_0": {"status": "finished", "global_steps": 3},
            "u1_0_1": {"status": "finished"},
            "u2": {"is_prompt": True},
        }
    }
    same = tq.kv_batch_get(keys, "p1")["ids"]  # same length: still jagged, as TransferQueue returns it
    assert same.is_nested and torch.equal(same.to_padded_tensor(0), torch.arange(6).view(2, 3))
    mixed = tq.kv_batch_get(["u2", "u1_0_0"], "p1", "ids")["ids"]
    assert mixed.is_nested and [t.tolist() for t in mixed.unbind()] == [list(range(5)), [0, 1, 2]]
    by_meta = tq.kv_batch_get_by_meta(tq.KVBatchMeta(keys=["u1_0_1"], tags=[{}], partition_id="p1", fields=["ids"]))
    assert padded(by_meta["ids"]).tolist() == [[3, 4, 5]]


def test_missing_keys_and_unready_fields_raise_value_errors(face):
    tq.kv_batch_put(["m0", "m1"], "p2", TensorDict({"a": torch.zeros(2, 1)}, batch_size=[2]))
    tq.kv_put("m2", "p2", tag={"status": "pending"})
    with pytest.raises(ValueError, match="no key"):
        tq.kv_batch_get(["m0", "nope"], "p2")
    with pytest.raises(ValueError, match="not ready"):
        tq.kv_batch_get(["m0", "m2"], "p2", select_fields=["a"])
    with pytest.raises(ValueError):
        tq.kv_batch_put(["x"], "p2")  # neither fields nor tags
    with pytest.raises(ValueError):
        tq.kv_batch_put(["x", "y"], "p2", tags=[{}])
    tq.kv_clear(["m0", "never-existed"], "p2")
    assert set(tq.kv_list("p2")["p2"]) == {"m1", "m2"}


def test_selected_fields_no_key_has_are_left_out_as_transfer_queue_does(face):
    """verl selects its standard field list (`values`, `ref_log_prob`, ...) whether or not the
    run produces every field; TransferQueue returns the fields that exist."""
    tq.kv_batch_put(["s0", "s1"], "unwritten", TensorDict({"a": torch.ones(2, 2)}, batch_size=[2]))
    got = tq.kv_batch_get(["s0", "s1"], "unwritten", select_fields=["a", "values", "ref_log_prob"])
    assert set(got.keys()) == {"a"} and got.batch_size == torch.Size([2])
    assert torch.equal(padded(got["a"]), torch.ones(2, 2))
    none = tq.kv_batch_get(["s0"], "unwritten", select_fields=["values"])
    assert list(none.keys()) == [] and none.batch_size == torch.Size([1])


def test_jagged_reads_pad_to_their_longest_row(face):
    """A jagged field read back records its longest row, so `to_padded_tensor()` (verl pads every
    batch it reads) pads to it, not to the total length of all rows."""
    rows = [torch.arange(n) for n in (3, 5, 2)]
    data = TensorDict({"r": torch.nested.as_nested_tensor(rows, layout=torch.jagged)}, batch_size=[3])
    tq.kv_batch_put(["j0", "j1", "j2"], "jagged", data)
    got = tq.kv_batch_get(["j2", "j0", "j1"], "jagged")
    assert got.to_padded_tensor()["r"].shape == (3, 5)
    assert got["r"].to_padded_tensor(-1)[0].tolist() == [0, 1, -1, -1, -1]


def test_non_tensor_fields_round_trip_exactly(face):
    values = ["text", {"k": [1, 2.5, "x"], "n": None}, [True, {"deep": [1, 2]}]]
    arrays = [np.arange(4, dtype=np.int32), np.array(["a", "bc"]), np.array([{"o": 1}, "s"], dtype=object)]
    data = TensorDict({"t": torch.ones(3, 2)}, batch_size=[3])
    data["v"] = stack(values)
    data["a"] = stack(arrays)
    data["meta"] = NonTensorData({"temperature": 0.7}, batch_size=[3])
    tq.kv_batch_put(["n0", "n1", "n2"], "p3", data)
    out = tq.kv_batch_get(["n0", "n1", "n2"], "p3")
    assert isinstance(entry(out, "v"), NonTensorStack) and entry(out, "v").tolist() == values
    got = entry(out, "a").tolist()
    for want, have in zip(arrays, got):
        assert isinstance(have, np.ndarray) and have.dtype == want.dtype and have.tolist() == want.tolist()
    assert isinstance(entry(out, "meta"), NonTensorData) and out["meta"] == {"temperature": 0.7}
    assert isinstance(entry(tq.kv_batch_get("n1", "p3", "v"), "v"), NonTensorStack)


def test_arbitrary_objects_are_refused_by_name(face):
    class Opaque:
        pass

    data = TensorDict({"t": torch.ones(2)}, batch_size=[2])
    data["obj"] = stack([1, [Opaque()]])
    with pytest.raises(tq.SchemaError, match=r"field 'obj', sample 1: a list holding a Opaque .*never pickles"):
        tq.kv_batch_put(["o0", "o1"], "p4", data)
    with pytest.raises(tq.SchemaError, match="tags"):
        tq.kv_put("o2", "p4", tag={"bad": Opaque()})


def test_batch_meta_bridges_keys_and_indexes(face):
    client = tq.get_client()
    tq.kv_batch_put(["b0", "b1", "b2"], "p5", TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    meta = client.kv_retrieve_meta(["b2", "b0"], "p5")
    assert isinstance(meta, tq.BatchMeta) and meta.is_ready and meta.partition_ids == ["p5", "p5"]
    assert client.kv_retrieve_keys(meta.global_indexes, "p5") == ["b2", "b0"]
    meta.extra_info = {"step": 1}
    updated = client.put(TensorDict({"y": torch.tensor([20.0, 0.0])}, batch_size=[2]), metadata=meta)
    assert updated.field_names == ["x", "y"] and updated.extra_info == {"step": 1}
    both = client.get_data(updated)
    assert both["x"].tolist() == [2, 0] and both["y"].tolist() == [20.0, 0.0]
    halves = updated.chunk(2)
    assert tq.BatchMeta.concat(halves).indexes == updated.indexes
    with pytest.raises(ValueError, match="not ready"):
        tq.kv_batch_get(["b0", "b1"], "p5", "y")  # b1 never got y


def test_batch_meta_answers_transfer_queues_batch_operations(face):
    tq.kv_batch_put(["d0", "d1", "d2"], "p5b", TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    meta = tq.get_client().kv_retrieve_meta(["d0", "d1", "d2"], "p5b")
    assert [m.indexes for m in meta.chunk(chunks=2)] == [meta.indexes[:2], meta.indexes[2:]]
    assert meta[-1].indexes == meta.indexes[2:] and meta[0:2].indexes == meta.indexes[:2]
    with pytest.raises(IndexError):
        meta[3]
    copy = meta.copy()
    copy.reorder([2, 0, 1])
    assert copy.indexes == [meta.indexes[i] for i in (2, 0, 1)] and meta.indexes != copy.indexes
    assert tq.get_client().get_data(copy)["x"].tolist() == [2, 0, 1]
    with pytest.raises(tq.SchemaError, match="permutation"):
        copy.reorder([0, 0, 1])
    meta.set_extra_info("step", 3)
    meta.update_extra_info({"temp": 1.0})
    assert meta.has_extra_info("step") and meta.get_extra_info("nope", 7) == 7
    assert meta.remove_extra_info("temp") == 1.0 and meta.get_all_extra_info() == {"step": 3}
    wider = meta.union(tq.get_client().put(TensorDict({"y": torch.ones(3)}, batch_size=[3]), metadata=meta))
    assert wider.field_names == ["x", "y"] and meta.chunk_by_partition()[0].indexes == meta.indexes
    with pytest.raises(tq.SchemaError, match="same samples"):
        meta.union(copy)
    assert tq.BatchMeta.concat([meta[:1], wider[1:]], validate=False).indexes == meta.indexes
    meta.clear_extra_info()
    assert meta.extra_info == {}


def test_async_twins_from_two_event_loops(face):
    async def produce():
        await tq.async_kv_batch_put(["c0", "c1"], "p6", TensorDict({"x": torch.ones(2, 4)}, batch_size=[2]))
        await tq.async_kv_put("c0", "p6", tag={"status": "finished"})
        return await tq.async_kv_list("p6")

    async def consume():
        client = tq.get_client()
        meta = await client.async_kv_retrieve_meta(["c0", "c1"], "p6")
        data = await client.async_get_data(meta)
        got = await tq.async_kv_batch_get(["c1"], "p6")
        await tq.async_kv_clear("c1", "p6")
        return data, got, await tq.async_kv_list("p6")

    listed = asyncio.run(produce())
    assert listed == {"p6": {"c0": {"status": "finished"}, "c1": {}}}
    data, got, after = asyncio.run(consume())
    assert torch.equal(padded(data["x"]), torch.ones(2, 4)) and torch.equal(padded(got["x"]), torch.ones(1, 4))
    assert after == {"p6": {"c0": {"status": "finished"}}}


def test_checkpoint_round_trip_restores_keys_tags_and_data(face, tmp_path):
    data = TensorDict({"ids": torch.arange(8).view(2, 4), "bf": torch.randn(2, 3).bfloat16()}, batch_size=[2])
    data["text"] = stack(["a", "b"])
    tq.kv_batch_put(["k0", "k1"], "ck", data, tags=[{"status": "finished"}, {"status": "finished"}])
    tq.kv_batch_put(
        ["k2"], "ck", TensorDict({"ids": torch.arange(3).view(1, 3)}, batch_size=[1]), tags=[{"is_prompt": True}]
    )
    before = tq.kv_list("ck")
    tq.save_checkpoint(tmp_path / "ckpt", metadata={"step": 7})
    assert json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["user_metadata"] == {"step": 7}
    tq.kv_clear(["k0", "k1", "k2"], "ck")
    tq.kv_put("stray", "ck", tag={"x": 1})
    tq.load_checkpoint(tmp_path / "ckpt")
    assert tq.kv_list("ck") == before
    out = tq.kv_batch_get(["k0", "k1"], "ck")
    assert torch.equal(padded(out["ids"]), data["ids"]) and torch.equal(padded(out["bf"]), data["bf"])
    assert entry(out, "text").tolist() == ["a", "b"]
    assert padded(tq.kv_batch_get("k2", "ck", "ids")["ids"]).tolist() == [[0, 1, 2]]


def test_load_of_a_corrupt_checkpoint_partition_is_a_schema_error(face, tmp_path):
    tq.kv_put("c0", "corrupt", tag={"x": 1})
    tq.kv_batch_put(["c1"], "corrupt", TensorDict({"ids": torch.arange(4).view(1, 4)}, batch_size=[1]))
    tq.save_checkpoint(tmp_path / "ckpt")
    first = sorted((tmp_path / "ckpt").glob("partition-*.bin"))[0]
    whole = first.read_bytes()
    before = tq.kv_list()
    pack = msgspec.msgpack.encode
    for bad in (b"\xc1 not msgpack", pack({"partition": "corrupt"}), pack([1, 2]), whole[:-8], whole + b"\0"):
        first.write_bytes(bad)
        with pytest.raises(tq.SchemaError, match="is not a Sluice KV checkpoint"):
            tq.load_checkpoint(tmp_path / "ckpt")
    assert tq.kv_list() == before


def test_another_process_attaches_through_the_environment(face):
    tq.kv_put("from-parent", "env", fields={"x": torch.tensor([1.5])})
    code = (
        "import transfer_queue as tq, torch\n"
        "assert tq.init() is None\n"
        "print(tq.kv_batch_get('from-parent', 'env')['x'].to_padded_tensor(0).tolist())\n"
        "tq.kv_put('from-child', 'env', tag={'status': 'finished'})\n"
        "tq.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[[1.5]]"
    assert tq.kv_list("env")["env"]["from-child"] == {"status": "finished"}


def test_keyed_samples_are_sluice_samples(face):
    """Keys ride on the controller's sample table: Sluice's own consumers and clears see them."""
    tq.kv_batch_put(["s0", "s1", "s2"], "both", TensorDict({"x": torch.arange(3.0)}, batch_size=[3]))
    with tq.connect(face["sluice"]["address"]) as client:
        meta = client.get_meta(["x"], 3, task="native", partition="both", timeout=10)
        assert client.get_data(meta)["x"].tolist() == [0.0, 1.0, 2.0]
        assert tq.get_client().kv_retrieve_keys(meta.indexes, "both") == ["s0", "s1", "s2"]
        client.ack(meta)
        client.clear(meta.select([0]))  # Sluice's clear frees the row, and the key goes with it
        assert set(tq.kv_list("both")["both"]) == {"s1", "s2"}
        client.clear_partition("both")
    assert tq.kv_list("both") == {}
    tq.kv_put("s0", "both", tag={"fresh": True})  # the name is usable again, keys start afresh
    assert tq.kv_list("both") == {"both": {"s0": {"fresh": True}}}


SHORT_LOOPS = """
import asyncio, gc, torch, transfer_queue as tq
tq.init()  # attaches to the test's cluster (SLUICE_TQ_ADDRESS)
for i in range(3):
    asyncio.run(tq.async_kv_put(f"loop{i}", "short", {"a": torch.ones(2)}, {"i": i}))
    gc.collect()
print(sorted(asyncio.run(tq.async_kv_list("short"))["short"]))
tq.close()
gc.collect()
"""


def test_short_lived_event_loops_leave_no_client_to_the_garbage_collector(face):
    """`asyncio.run(tq.async_...)` again and again (verl's `auto_await`): each loop's client
    closes as its loop shuts down, so no reader task is destroyed pending and no socket is left
    unclosed, up to the process's exit (`-X dev` shows both)."""
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", SHORT_LOOPS], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "['loop0', 'loop1', 'loop2']"
    assert "Task was destroyed" not in out.stderr and "Unclosed socket" not in out.stderr, out.stderr
