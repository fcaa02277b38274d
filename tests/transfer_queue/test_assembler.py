"""`Assembler`: a field received whole in one private buffer is kept, anything else is copied."""

from __future__ import annotations

import numpy as np
import torch

from transfer_queue._tensors import Assembler
from transfer_queue.wire.meta import RAGGED, FieldSpec

DENSE = FieldSpec("int64", (4,))
RAGGED_SPEC = FieldSpec("float32", (RAGGED, 2))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_an_owned_run_holding_the_whole_field_in_order_is_kept_not_copied():
    rows = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    values = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    src, vsrc = _bytes(rows.clone()), _bytes(values.clone())
    asm = Assembler({"d": DENSE, "r": RAGGED_SPEC}, 3)
    asm.add_unit(np.arange(3), {"r": [1, 0, 5]}, {"d": [src], "r": [vsrc]}, owned=True)
    out = asm.result()
    assert out["d"].data_ptr() == src.data_ptr(), "a whole owned frame was copied"
    assert out["r"].values().data_ptr() == vsrc.data_ptr()
    assert torch.equal(out["d"], rows) and not out["d"]._is_view()
    assert torch.equal(out["r"].values(), values) and out["r"].offsets().tolist() == [0, 1, 1, 6]


def test_shared_runs_split_runs_and_reordered_rows_are_copied():
    rows = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    src = _bytes(rows.clone())
    shared = Assembler({"d": DENSE}, 3)  # an arena view: its memory is reused after a clear
    shared.add_unit(np.arange(3), {}, {"d": [src]})
    got = shared.result()["d"]
    assert got.data_ptr() != src.data_ptr() and torch.equal(got, rows)
    reordered = Assembler({"d": DENSE}, 3)
    reordered.add_unit(np.array([2, 1, 0]), {}, {"d": [src]}, owned=True)
    got = reordered.result()["d"]
    assert got.data_ptr() != src.data_ptr() and torch.equal(got, rows.flip(0))
    two = Assembler({"d": DENSE}, 3)
    two.add_unit(np.array([0, 1]), {}, {"d": [src[: 2 * 32]]}, owned=True)
    two.add_unit(np.array([2]), {}, {"d": [src[2 * 32 :]]}, owned=True)
    got = two.result()["d"]
    assert got.data_ptr() != src.data_ptr() and torch.equal(got, rows)
    unaligned = torch.zeros(3 * 32 + 1, dtype=torch.uint8)[1:]
    unaligned.copy_(src)
    odd = Assembler({"d": DENSE}, 3)
    odd.add_unit(np.arange(3), {}, {"d": [unaligned]}, owned=True)
    assert torch.equal(odd.result()["d"], rows)


def test_a_whole_batch_is_sliced_as_every_position_is():
    """`Columns.slice(None)` (a put on one unit) gives the buffers and lengths of all rows in
    order, as `slice` of every position does, for dense, jagged (its offsets ending before its
    values do) and non-tensor fields."""
    from transfer_queue._tensors import Columns

    base = torch.arange(40, dtype=torch.float32).reshape(20, 2)
    window = torch.nested.nested_tensor_from_jagged(base, torch.tensor([0, 4, 4, 9, 12]))
    cols = Columns({"d": torch.arange(12, dtype=torch.int64).reshape(4, 3), "r": window, "o": ["a", "bb", "", "dddd"]})
    whole, lengths = cols.slice(None)
    each, each_lengths = cols.slice(np.arange(4))
    assert lengths == each_lengths == {"r": [4, 0, 5, 3], "o": [2, 3, 1, 5]}  # msgpack: a 1-byte header each
    assert [b.tolist() for b in whole] == [b.tolist() for b in each]
    assert whole[1].numel() == 12 * 2 * 4  # the 12 rows of 2 floats the offsets cover, not all 20
