"""Where new rows go: a put in parts of at least `PART_BYTES` over the storage units with the
fewest bytes (a small put whole to one, the producer's previous unit while it is not far ahead),
or over all units when those lack the room."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["PART_BYTES", "STAY_SHARE", "place_rows"]


PART_BYTES = 16 << 20
"""A put is split into parts of at least this many bytes: a smaller one goes whole to one unit
(one message per field, and a consumer's micro-batch read from one unit as one frame it keeps
without a copy); a larger one is spread over as many units as it has parts, whose processes then
copy it in parallel."""


STAY_SHARE = 16
"""A put that goes whole to one unit goes to the unit of its producer's previous put while that
unit holds at most 1/STAY_SHARE of its free bytes more than the emptiest unit: a producer's
stream of puts then stays on one unit, which serves a put's write and the read of the put before
in the same turns of its loop, instead of alternating between units (`benchmarks/data_plane.py`'s
TCP stream shows the gain); the units' byte counts still stay within that share plus one put of
each other."""


def place_rows(
    unit_bytes: Mapping[int, int],
    n: int,
    row_bytes: int,
    room: Mapping[int, int] | None = None,
    stay: int = -1,
) -> np.ndarray:
    """Unit id per new row, in contiguous runs (a client sends each unit one frame per field).

    Rows with bytes fill the `n * row_bytes // PART_BYTES` (at least one) units holding the
    fewest bytes, evenly by bytes, when they fit those units' `room` (free bytes; no limit when
    not given); a put of one part goes to unit `stay` instead (its producer's previous unit)
    while that unit has the room and holds at most `room[stay] // STAY_SHARE` more bytes than
    the emptiest. Otherwise, and for rows with no bytes yet (keys), every unit takes a share, so
    that the units' byte counts end up as even as possible."""
    ids = sorted(unit_bytes, key=lambda u: (unit_bytes[u], u))  # the emptiest first
    if row_bytes > 0:
        count = max(1, min(len(ids), n * row_bytes // PART_BYTES))
        if count == 1 and _near(unit_bytes, stay, ids[0], n * row_bytes, room):
            return np.full(n, stay, dtype=np.int64)
        parts = _fill({u: unit_bytes[u] for u in ids[:count]}, n, row_bytes)
        if room is None or all(int(np.sum(parts == u)) * row_bytes <= room[u] for u in np.unique(parts).tolist()):
            return parts
    return _fill(unit_bytes, n, row_bytes)


def _near(unit_bytes: Mapping[int, int], stay: int, emptiest: int, nbytes: int, room: Mapping[int, int] | None) -> bool:
    """Whether unit `stay` may take a put of `nbytes` whole: it has the `room` (free bytes, known)
    and holds at most 1/STAY_SHARE of its free bytes more than the `emptiest` unit."""
    if room is None or stay not in unit_bytes or stay not in room:
        return False
    return nbytes <= room[stay] and unit_bytes[stay] - unit_bytes[emptiest] <= room[stay] // STAY_SHARE


def _fill(unit_bytes: Mapping[int, int], n: int, row_bytes: int) -> np.ndarray:
    """Water-filling: the emptiest of `unit_bytes` take rows first, until all are level."""
    ids = sorted(unit_bytes)
    used = np.array([unit_bytes[i] for i in ids], dtype=np.float64)
    per_row = max(row_bytes, 1)
    # level L with sum(max(0, L - used)) == n * per_row, then each unit takes its share of rows
    order = np.sort(used)
    total = n * per_row
    level = order[0] + total
    for k in range(1, len(order) + 1):
        level = (order[:k].sum() + total) / k
        if k == len(order) or level <= order[k]:
            break
    share = np.maximum(0.0, level - used) / per_row
    counts = np.floor(share).astype(np.int64)
    for i in np.argsort(-(share - counts), kind="stable")[: n - int(counts.sum())]:
        counts[i] += 1
    return np.repeat(np.array(ids, dtype=np.int64), counts)
