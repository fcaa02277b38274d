"""Where new rows go: fill the storage units with the fewest bytes first (water-filling)."""

from __future__ import annotations

import numpy as np

__all__ = ["place_rows"]


def place_rows(unit_bytes: dict[int, int], n: int, row_bytes: int) -> np.ndarray:
    """Unit id per new row, in contiguous runs, so that the units' byte counts end up as even as
    possible. Contiguous runs let a client send each unit one frame per field."""
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
