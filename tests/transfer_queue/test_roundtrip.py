"""Put and get through real processes: every dtype, dense and ragged, TCP frames and shm."""

from __future__ import annotations

import uuid

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.helpers import put_anew
from transfer_queue._tensors import Columns

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]


def _random(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


def _ragged(dtype: torch.dtype, lengths: list[int], inner: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.nested.nested_tensor([_random(dtype, (n, *inner)) for n in lengths], layout=torch.jagged)


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.is_nested:
        assert b.is_nested
        assert torch.equal(a.offsets(), b.offsets())
        assert torch.equal(a.values(), b.values())
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_every_dtype_dense_and_ragged(shared_cluster, use_shm):
    part = f"rt-{uuid.uuid4().hex[:6]}"
    lengths = [3, 0, 7, 1, 5, 2, 9, 4]
    data = {}
    for dtype in DTYPES:
        name = str(dtype).split(".")[-1]
        data[f"dense_{name}"] = _random(dtype, (8, 5, 3))
        data[f"ragged_{name}"] = _ragged(dtype, lengths, (2,))
    data["scalar"] = torch.arange(8, dtype=torch.float32)
    td = TensorDict(data, batch_size=[8])
    with tq.connect(shared_cluster.address, use_shm=use_shm) as client:
        assert bool(client.mapped_units) == use_shm
        # a put goes whole to the emptiest unit; a producer's next ones stay there: two producers
        metas = [client.put(td, partition=part), put_anew(shared_cluster.address, td, use_shm, partition=part)]
        assert len(metas[0]) == 8 and set(metas[0].fields) == set(data)
        assert [len(set(m.units)) for m in metas] == [1, 1] and metas[0].units != metas[1].units
        got_meta = client.get_meta(list(data), 16, task="check", partition=part, timeout=5)
        assert got_meta.indexes == metas[0].indexes + metas[1].indexes
        batch = client.get_data(got_meta)  # assembled from both units
        twice = list(range(8)) * 2
        for name, tensor in data.items():
            _assert_same(
                _ragged_rows(tensor, twice) if tensor.is_nested else tensor[torch.as_tensor(twice)], batch[name]
            )
        client.ack(got_meta)


def test_rows_come_back_in_meta_order_across_puts(client):
    for start in range(0, 40, 10):
        client.put(TensorDict({"x": torch.arange(start, start + 10)}, batch_size=[10]))
    meta = client.get_meta(["x"], 40, task="t", timeout=5)
    shuffled = meta.select([5, 39, 0, 17, 22, 3, 11])
    assert client.get_data(shuffled)["x"].tolist() == [5, 39, 0, 17, 22, 3, 11]
    # ragged rows from several puts, asked for out of order
    for start in range(0, 20, 5):
        rows = [torch.full((i + 1,), i) for i in range(start, start + 5)]
        client.put(
            TensorDict({"r": torch.nested.nested_tensor(rows, layout=torch.jagged)}, batch_size=[5]), partition="r"
        )
    meta = client.get_meta(["r"], 20, task="t", partition="r", timeout=5).select([19, 2, 7, 0])
    out = client.get_data(meta)["r"]
    assert [t.tolist() for t in out.unbind()] == [[19] * 20, [2] * 3, [7] * 8, [0]]


def test_new_columns_for_the_same_rows(client):
    meta = client.put(TensorDict({"prompt": torch.arange(16).view(8, 2)}, batch_size=[8]))
    got = client.get_meta(["prompt"], 8, task="ref", timeout=5)
    prompts = client.get_data(got)["prompt"]
    extended = client.put(TensorDict({"logp": prompts.float().sum(-1)}, batch_size=[8]), meta=got)
    assert set(extended.fields) == {"prompt", "logp"}
    client.ack(got)
    both = client.get_meta(["prompt", "logp"], 8, task="train", timeout=5)
    batch = client.get_data(both)
    assert both.indexes == meta.indexes
    assert torch.equal(batch["logp"], batch["prompt"].float().sum(-1))


def test_new_columns_that_contradict_the_schema_are_refused_at_commit(client):
    """A put with `meta=` goes straight to the units (no BeginPut); the commit checks its fields
    against the partition's schema, so a wrong dtype changes nothing readable."""
    client.put(TensorDict({"a": torch.ones(4, 2), "logp": torch.zeros(4)}, batch_size=[4]))
    got = client.get_meta(["a"], 4, task="ref", timeout=5)
    with pytest.raises(tq.SchemaError, match="logp"):
        client.put(TensorDict({"logp": torch.zeros(4, dtype=torch.int64)}, batch_size=[4]), meta=got)
    fresh = client.put(TensorDict({"b": torch.full((4,), 3.0)}, batch_size=[4]), meta=got)
    assert sorted(fresh.fields) == ["a", "b"]
    assert client.get_data(fresh, fields=["b"])["b"].tolist() == [3.0] * 4
    assert client.status()["partitions"]["train"]["samples"] == 4


def test_get_data_of_a_subset_of_fields(client):
    client.put(TensorDict({"a": torch.ones(4, 2), "b": torch.zeros(4)}, batch_size=[4]))
    meta = client.get_meta(["a", "b"], 4, task="t", timeout=5)
    batch = client.get_data(meta, fields=["b"])
    assert list(batch.keys()) == ["b"]


def test_rows_of_one_unit_read_over_tcp_are_private_to_the_batch(shared_cluster):
    """A read served by one unit keeps the received frames as the batch's memory (no copy out):
    every dtype still comes back intact, and writing into one batch changes no later read."""
    part = f"one-{uuid.uuid4().hex[:6]}"
    lengths = [3, 0, 7, 1, 5, 2, 9, 4] * 64
    data = {}
    for dtype in DTYPES:
        name = str(dtype).split(".")[-1]
        data[f"dense_{name}"] = _random(dtype, (len(lengths), 64, 3))
        data[f"ragged_{name}"] = _ragged(dtype, lengths, (2,))
    td = TensorDict(data, batch_size=[len(lengths)])
    with tq.connect(shared_cluster.address, use_shm=False) as client:
        meta = client.put(td, partition=part)
        assert len(set(meta.units)) == 1, "a put goes whole to one unit"
        mine = list(range(len(meta)))
        one = meta.select(mine)
        first = client.get_data(one)
        for name, tensor in data.items():
            expected = tensor[torch.as_tensor(mine)] if not tensor.is_nested else None
            if expected is not None:
                _assert_same(expected, first[name])
            else:
                _assert_same(_ragged_rows(tensor, mine), first[name])
        assert not first["dense_int64"].untyped_storage().resizable(), "the frame was copied out"
        first["dense_int64"].fill_(-7)
        first["ragged_float32"].values().fill_(-7.0)
        again = client.get_data(one)
        _assert_same(data["dense_int64"][torch.as_tensor(mine)], again["dense_int64"])
        _assert_same(_ragged_rows(data["ragged_float32"], mine), again["ragged_float32"])
        client.clear(meta)


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_a_jagged_tensor_with_holes_is_stored_as_its_rows(shared_cluster, use_shm):
    """`torch.nested.narrow` keeps the whole buffer and gives each row a length shorter than its
    run: only those lengths are the rows (and their sequence lengths)."""
    block = torch.arange(20).reshape(4, 5)
    cut = torch.nested.narrow(
        block, 1, torch.zeros(4, dtype=torch.int64), torch.tensor([1, 0, 3, 5]), layout=torch.jagged
    )
    td = TensorDict({"r": cut}, batch_size=[4])
    assert Columns(td).seqlens() == [1, 0, 3, 5]
    with tq.connect(shared_cluster.address, use_shm=use_shm) as client:
        meta = client.put(td, partition=f"holes-{uuid.uuid4().hex[:6]}")
        rows = client.get_data(meta)["r"].unbind()
        assert [r.tolist() for r in rows] == [[0], [], [10, 11, 12], [15, 16, 17, 18, 19]]
        client.clear(meta)


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_a_read_of_only_empty_ragged_rows(shared_cluster, use_shm):
    """Rows whose ragged field is empty on their unit: a read over TCP brings no frame for it."""
    ragged = torch.nested.nested_tensor([torch.zeros(0, 2), torch.ones(3, 2), torch.zeros(0, 2)], layout=torch.jagged)
    meta = put_anew(shared_cluster.address, {"r": ragged}, partition=f"empty-{uuid.uuid4().hex[:6]}")
    with tq.connect(shared_cluster.address, use_shm=use_shm) as client:
        rows = client.get_data(meta.select([0, 2]))["r"].unbind()
        assert [tuple(r.shape) for r in rows] == [(0, 2), (0, 2)]
        client.clear(meta)


def _ragged_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    return torch.nested.nested_tensor([tensor[i] for i in rows], layout=torch.jagged)
