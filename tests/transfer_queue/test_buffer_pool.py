"""`BufferPool`: get_data's output memory is reused only once no tensor uses it any more."""

from __future__ import annotations

import gc

import torch

from transfer_queue._tensors import BufferPool

MIB = 1 << 20


def test_memory_is_reused_only_after_every_tensor_on_it_is_gone():
    pool = BufferPool(max_bytes=64 * MIB, min_bytes=MIB)
    a = pool.empty((256, 1024), torch.int64)  # 2 MiB
    a.fill_(7)
    b = pool.empty((256, 1024), torch.int64)
    assert b.data_ptr() != a.data_ptr(), "a live tensor's memory was handed out again"
    view = a[10:20]
    ptr = a.data_ptr()
    del a
    c = pool.empty((256, 1024), torch.int64)
    assert c.data_ptr() != ptr, "memory still viewed by a slice was handed out again"
    assert torch.all(view == 7)
    c_ptr = c.data_ptr()
    del view, c
    gc.collect()
    d = pool.empty((512, 512), torch.float64)  # same byte size, other dtype and shape
    assert d.data_ptr() in (ptr, c_ptr), "released memory was not reused"
    e = pool.empty((256, 1024), torch.int64)
    assert e.data_ptr() in (ptr, c_ptr) and e.data_ptr() != d.data_ptr()
    assert len(pool._entries) == 3


def test_tensors_look_like_fresh_ones():
    pool = BufferPool(min_bytes=MIB)
    t = pool.empty((300, 4096), torch.float32)
    assert t.shape == (300, 4096) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t._is_view() and t.storage_offset() == 0
    assert t.untyped_storage().nbytes() == 300 * 4096 * 4
    t.resize_(600, 4096)  # the storage may grow under a user; the pool then lets it go
    del t
    u = pool.empty((300, 4096), torch.float32)
    assert u.untyped_storage().nbytes() == 300 * 4096 * 4


def test_small_and_huge_requests_bypass_the_pool_and_it_stays_bounded():
    pool = BufferPool(max_bytes=8 * MIB, min_bytes=MIB)
    small = pool.empty((10,), torch.int64)
    assert small.numel() == 10 and not pool._entries
    held = [pool.empty((MIB // 4,), torch.float32) for _ in range(12)]  # 12 x 1 MiB, all live
    assert pool._bytes <= 8 * MIB
    assert len({t.data_ptr() for t in held}) == 12
