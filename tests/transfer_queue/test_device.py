"""`device=` on the data plane through real processes: `get_data`/`stream` return tensors on the
asked device through the same code whatever it is (here the CPU), bad devices and tensors a
process cannot copy are refused with a `SchemaError`, and (marked `cuda`) CUDA batches round trip
over TCP frames and mapped arenas."""

from __future__ import annotations

import uuid

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import transfer_queue as tq
from transfer_queue.cuda import HostRegistry, copy_each, pinned_source


def _batch(n: int = 8, device: str = "cpu") -> dict:
    lengths = [3, 0, 7, 1, 5, 2, 9, 4][:n]
    return {
        "ids": torch.arange(n * 6, dtype=torch.int64, device=device).reshape(n, 6),
        "logp": torch.randn(n, 4, device=device).to(torch.bfloat16),
        "resp": torch.nested.nested_tensor(
            [torch.arange(k, dtype=torch.int32, device=device) for k in lengths], layout=torch.jagged
        ),
    }


def _same(got: TensorDict, want: dict, device: str) -> None:
    for name, t in want.items():
        g = got[name]
        assert g.device.type == torch.device(device).type, name
        if t.is_nested:
            assert torch.equal(g.offsets().cpu(), t.offsets().cpu())
            assert torch.equal(g.values().cpu(), t.values().cpu())
        else:
            assert g.dtype == t.dtype and torch.equal(g.cpu(), t.cpu()), name


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_get_data_on_cpu_device_equals_default(shared_cluster, use_shm):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    data = _batch()
    with tq.connect(shared_cluster.address, use_shm=use_shm) as c:
        meta = c.put({**data, "tag": NonTensorStack(*[f"s{i}" for i in range(8)])}, part)
        meta = meta.select([6, 1, 3, 0, 7, 2, 5, 4])  # rows out of order: scattered places
        got = c.get_data(meta, device="cpu")
        plain = c.get_data(meta)
        order = torch.tensor([6, 1, 3, 0, 7, 2, 5, 4])
        assert torch.equal(got["ids"], data["ids"][order]) and torch.equal(got["ids"], plain["ids"])
        assert torch.equal(got["logp"], data["logp"][order])
        assert [got["resp"][i].tolist() for i in range(8)] == [data["resp"][int(i)].tolist() for i in order]
        assert got["tag"].tolist() == [f"s{int(i)}" for i in order]


def test_stream_on_cpu_device(shared_cluster):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    data = _batch()
    with tq.connect(shared_cluster.address) as c:
        c.put(data, part)
        c.seal(part)
        batches = list(c.stream(["ids", "resp"], 4, "t", part, timeout=30, device=torch.device("cpu")))
    assert [len(m) for _, m in batches] == [4, 4]
    ids = torch.cat([b["ids"] for b, _ in batches])
    assert sorted(ids[:, 0].tolist()) == data["ids"][:, 0].tolist()


async def test_async_client_device(shared_cluster):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    data = _batch()
    async with await tq.connect_async(shared_cluster.address) as c:
        meta = await c.put(data, part)
        _same(await c.get_data(meta, device="cpu"), data, "cpu")
        await c.seal(part)
        got = [b async for b, _ in c.stream(["ids"], 8, "t", part, timeout=30, device="cpu")]
        assert torch.equal(got[0]["ids"], data["ids"])
        with pytest.raises(tq.SchemaError, match="device"):
            await c.get_data(meta, device="meta")


def test_bad_devices_are_refused(shared_cluster):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    with tq.connect(shared_cluster.address) as c:
        meta = c.put(_batch(), part)
        for device in ("meta", "no-such-device"):
            with pytest.raises(tq.SchemaError, match="device"):
                c.get_data(meta, device=device)
        if not torch.cuda.is_available():
            with pytest.raises(tq.SchemaError, match="no CUDA"):
                c.get_data(meta, device="cuda")
            c.seal(part)
            with pytest.raises(tq.SchemaError, match="no CUDA"):
                next(iter(c.stream(["ids"], 8, "t", part, timeout=30, device="cuda:0")))
        assert torch.equal(c.get_data(meta)["ids"], _batch()["ids"])  # nothing lost


def test_a_tensor_this_process_cannot_copy_names_its_field(shared_cluster):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    with tq.connect(shared_cluster.address) as c:
        data = {"ok": torch.zeros(4, 2), "weights": torch.empty(4, 3, device="meta")}
        with pytest.raises(tq.SchemaError, match=r"'weights'.*device meta"):
            c.put(data, part)
        c.seal(part)
        with pytest.raises(tq.SchemaError, match="never had"):  # nothing of the batch was stored
            c.get_meta(["ok"], 1, "t", part, allow_partial=True, timeout=1)


def test_host_registration_is_a_no_op_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the `cuda` tests cover registration")
    reg = HostRegistry()
    buf = torch.empty(1 << 16, dtype=torch.uint8)
    assert reg.register(buf.data_ptr(), buf.numel()) is False
    assert buf.data_ptr() not in reg
    reg.clear()


@pytest.mark.cuda
@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_cuda_batches_round_trip(shared_cluster, use_shm):
    part = f"dev-{uuid.uuid4().hex[:6]}"
    data = _batch(device="cuda")
    with tq.connect(shared_cluster.address, use_shm=use_shm) as c:
        meta = c.put(data, part)
        _same(c.get_data(meta, device="cuda"), data, "cuda")
        scattered = c.get_data(meta.select([5, 2, 7]), device="cuda")
        assert torch.equal(scattered["ids"], data["ids"][[5, 2, 7]])
        assert scattered["resp"].values().is_cuda
        _same(c.get_data(meta), data, "cpu")
        if use_shm:
            assert c._core._pinned._ranges, "the mapped arenas are registered with CUDA"
        c.seal(part)
        got = list(c.stream(["ids"], 8, "t", part, timeout=30, device="cuda"))
        assert got[0][0]["ids"].is_cuda and torch.equal(got[0][0]["ids"], data["ids"])


@pytest.mark.cuda
def test_h2d_sources_are_pinned_once():
    frame = torch.arange(1 << 16, dtype=torch.uint8)  # ordinary heap memory, like a received frame
    staged = pinned_source(frame)
    assert staged.is_pinned() and staged.data_ptr() != frame.data_ptr() and torch.equal(staged, frame)
    assert pinned_source(staged) is staged  # pinned (or registered) memory is read where it is


def test_copy_each_copies_every_pair_as_copy_does():
    """Casts, strided views on either side and an empty list, as `dst.copy_(src)` would."""
    a, b = torch.zeros(4, 6, dtype=torch.bfloat16), torch.randn(6, 4)
    counts = torch.zeros(5, dtype=torch.float64)
    copy_each([a[:, :3], counts], [b.t()[:, :3], torch.arange(5)], non_blocking=True)
    assert torch.equal(a[:, :3], b.t()[:, :3].to(torch.bfloat16)) and torch.equal(
        a[:, 3:], torch.zeros(4, 3, dtype=torch.bfloat16)
    )
    assert torch.equal(counts, torch.arange(5, dtype=torch.float64))
    copy_each([], [])


@pytest.mark.cuda
def test_copy_each_on_the_gpu():
    """CUDA to CUDA pairs (one copy each), host to CUDA and CUDA to host pairs (pageable, and pinned
    with `non_blocking`, as the publisher packs)."""
    src = [torch.randn(64, 32, device="cuda"), torch.randn(7, device="cuda")]
    dst = [torch.empty(64, 32, device="cuda", dtype=torch.bfloat16), torch.empty(7, device="cuda")]
    copy_each(dst, src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(dst[0], src[0].to(torch.bfloat16)) and torch.equal(dst[1], src[1])
    host = [torch.empty(64, 32), torch.empty(7)]
    copy_each(host, src)
    assert torch.equal(host[0], src[0].cpu()) and torch.equal(host[1], src[1].cpu())
    pinned = [torch.empty(64, 32, dtype=torch.bfloat16).pin_memory(), torch.empty(7).pin_memory()]
    copy_each(pinned, src, non_blocking=True)  # the publisher's pack into registered staging
    torch.cuda.synchronize()
    assert torch.equal(pinned[0], src[0].cpu().to(torch.bfloat16)) and torch.equal(pinned[1], src[1].cpu())
    back = [torch.empty(64, 32, device="cuda"), torch.empty(7, device="cuda")]
    copy_each(back, host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back[0], src[0]) and torch.equal(back[1], src[1])
