"""Where new rows go: a put whole to the storage unit with the fewest bytes, or spread over the
emptiest units (water-filling) when it does not fit there."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = ["place_rows"]


def place_rows(
    unit_bytes: Mapping[int, int], n: int, row_bytes: int, room: Mapping[int, int] | None = None
) -> np.ndarray:
    """Unit id per new row, in contiguous runs (a client sends each unit one frame per field).

    Rows with bytes go whole to the unit holding the fewest bytes when they fit its `room` (free
    bytes; no limit when not given): a consumer then reads a batch of them from one unit, one
    frame per field that becomes the batch's memory without a copy, and the units stay within one
    put of each other. Otherwise, and for rows with no bytes yet (keys), they are spread so that
    the units' byte counts end up as even as possible."""
    ids = sorted(unit_bytes)
    emptiest = min(ids, key=unit_bytes.__getitem__)
    if row_bytes > 0 and (room is None or n * row_bytes <= room[emptiest]):
        return np.full(n, emptiest, np.int64)
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
