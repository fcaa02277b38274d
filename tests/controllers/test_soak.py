"""Over a long stream the controller's memory stays flat: `benchmarks/soak.py`, shorter."""

from __future__ import annotations

import pytest

from tests.helpers import run_benchmark


@pytest.mark.slow
def test_the_controllers_memory_stays_flat_over_a_long_stream():
    """600,000 small samples put, read, acked and cleared: after 200,000 the controller's
    anonymous memory grows by at most 2 MiB per 100,000 samples and ends within 64 MiB of idle."""
    summary, out = run_benchmark("soak.py", "--samples", "600000", "--warmup", "200000")
    assert summary["controller_anon_growth_mib_per_100k"] <= 2.0, out
    assert summary["controller_anon_above_idle_mib"] <= 64.0, out
