"""Samplers and placement as pure functions (the service-level behaviour is in tests/controllers/test_scheduling.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from controllers.placement import PART_BYTES, STAY_SHARE, place_rows
from controllers.samplers import FifoSampler, GroupSampler, SampleView, SeqlenBalancedSampler
from transfer_queue import SchemaError


def _view(n, groups=None, seqlens=None):
    return SampleView(
        np.asarray(groups if groups is not None else range(n)),
        np.asarray(seqlens if seqlens is not None else [0] * n),
        np.zeros(n, np.int64),
    )


def test_fifo_waits_for_a_full_batch_unless_partial():
    ready = np.arange(3)
    assert FifoSampler().sample(ready, 4, _view(3), {}, False) is None
    assert FifoSampler().sample(ready, 4, _view(3), {}, True).tolist() == [0, 1, 2]


def test_group_sampler_needs_a_dividing_group_size():
    with pytest.raises(SchemaError):
        GroupSampler().sample(np.arange(4), 6, _view(4), {"group_size": 4}, False)


_BAD_COUNTS = [(GroupSampler(), "group_size", v) for v in ("a", 2.5, 0, -2, True)] + [
    (SeqlenBalancedSampler(), "dp_size", v) for v in ("a", 2.5, 0, True)
]


@pytest.mark.parametrize("sampler, name, value", _BAD_COUNTS)
def test_a_count_option_must_be_a_positive_integer(sampler, name, value):
    """Not an `InternalError` for a string, nor a fraction truncated: the caller's mistake, typed."""
    with pytest.raises(SchemaError, match=f"needs {name} as a positive integer, got {value!r}"):
        sampler.sample(np.arange(4), 4, _view(4), {name: value}, False)


def test_the_group_sampler_needs_a_group_size():
    with pytest.raises(SchemaError, match="needs group_size as a positive integer, got None"):
        GroupSampler().sample(np.arange(4), 4, _view(4), {}, False)


@given(st.lists(st.integers(1, 5000), min_size=8, max_size=64), st.sampled_from([2, 4, 8]))
def test_seqlen_balanced_is_a_permutation_with_equal_counts(lengths, dp):
    n = len(lengths) // dp * dp
    rows = SeqlenBalancedSampler().sample(np.arange(n), n, _view(len(lengths), seqlens=lengths), {"dp_size": dp}, False)
    assert sorted(rows.tolist()) == list(range(n))
    loads = [sum(lengths[r] for r in chunk) for chunk in np.array_split(rows, dp)]
    assert max(loads) - min(loads) <= max(lengths[:n])  # greedy LPT bound


@given(
    st.dictionaries(st.integers(0, 3), st.integers(0, 10**6), min_size=1), st.integers(1, 1000), st.integers(1, 10**5)
)
@example(used={0: 0, 1: 0, 2: 0}, n=503, row_bytes=66709)  # a put of two parts
def test_placement_fills_the_emptiest_units_in_contiguous_runs(used, n, row_bytes):
    units = place_rows(used, n, row_bytes)
    assert len(units) == n and np.all(np.diff(units) >= 0)
    parts = max(1, min(len(used), n * row_bytes // PART_BYTES))
    emptiest = sorted(used, key=lambda k: (used[k], k))[:parts]
    assert set(units.tolist()) <= set(emptiest), "a put fills the emptiest units, one per part"
    if parts == 1:
        assert set(units.tolist()) == set(emptiest), "a small put goes whole to the emptiest unit"
    # without room in those, every unit takes a share
    units = place_rows(used, n, row_bytes, {k: 0 if k in emptiest else n * row_bytes for k in used})
    assert len(units) == n
    assert np.all(np.diff(units) >= 0), "contiguous runs per unit"
    after = {k: used[k] + row_bytes * int(np.sum(units == k)) for k in used}
    receivers = [k for k in used if np.any(units == k)]
    if receivers:  # no unit that received rows ends up much fuller than any other unit
        assert max(after[k] for k in receivers) <= max(min(after.values()), max(used[k] for k in receivers)) + row_bytes


@given(st.integers(2, 4), st.lists(st.integers(1, 2 * PART_BYTES - 1), min_size=1, max_size=200))
def test_a_producers_puts_stay_on_one_unit_and_the_units_stay_level(nunits, sizes):
    capacity = 8 << 30  # room for every put: only the lead makes a producer move
    used = dict.fromkeys(range(nunits), 0)
    stay, switches = -1, 0
    for nbytes in sizes:
        room = {u: capacity - b for u, b in used.items()}
        units = place_rows(used, 1, nbytes, room, stay)
        (unit,) = units.tolist()
        if stay >= 0 and unit != stay:
            switches += 1
            assert used[stay] - min(used.values()) > room[stay] // STAY_SHARE, "left a unit that was not ahead"
        used[unit] += nbytes
        stay = unit
        assert max(used.values()) - min(used.values()) <= capacity // STAY_SHARE + 2 * PART_BYTES, "levels drift apart"
    assert switches <= sum(sizes) // (capacity // STAY_SHARE // 2) + nunits, "a producer hops between units"


def test_a_put_leaves_its_producers_unit_when_it_lacks_the_room():
    used = {0: 50, 1: 0}  # unit 0 is 50 bytes ahead: within 1000 // STAY_SHARE
    assert place_rows(used, 4, 10, {0: 1000, 1: 1000}, stay=0).tolist() == [0] * 4
    assert place_rows(used, 4, 10, {0: 30, 1: 1000}, stay=0).tolist() == [1] * 4, "no room on unit 0"
    assert place_rows(used, 4, 10, {0: 1000, 1: 1000}, stay=7).tolist() == [1] * 4, "a retired unit"
    assert place_rows(used, 4, 10, None, stay=0).tolist() == [1] * 4, "unknown room: the emptiest"
    assert place_rows(used, 4, 10, {0: 500, 1: 1000}, stay=0).tolist() == [1] * 4, "ahead by more than 500 // 16"
    assert place_rows(used, 4, 10, {0: 800, 1: 1000}, stay=0).tolist() == [0] * 4, "ahead by exactly 800 // 16"
    level = {0: 0, 1: 0}
    assert place_rows(level, 4, 0, {0: 1000, 1: 1000}, stay=0).tolist() == [0, 0, 1, 1], "keys: every unit a share"


def test_a_put_of_two_parts_or_more_ignores_its_producers_unit():
    used = {0: 0, 1: 0, 2: 1 << 30}
    room = dict.fromkeys(used, 4 << 30)
    units = place_rows(used, 4, PART_BYTES // 2, room, stay=2)  # 32 MiB: two parts
    assert sorted(set(units.tolist())) == [0, 1], "split over the two emptiest, not the producer's unit"
