"""A small crowd of concurrent clients (`benchmarks/crowd.py`): every sample put is read exactly
once, and no client hangs or fails."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow
def test_a_crowd_loses_duplicates_and_hangs_nothing():
    summary, out = run_benchmark(
        "crowd.py", "--producers", "160", "--consumers", "40", "--procs", "2", "--seconds", "10"
    )
    assert summary["samples_put"] > 0, out
    assert (summary["lost"], summary["duplicated"], summary["hung"], summary["errors"]) == (0, 0, 0, 0), out
