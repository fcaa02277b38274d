"""Shared fixtures: real clusters (controller + storage unit processes on loopback)."""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import transfer_queue as tq

# Property tests check what they compute, not how fast: on shared CI cores one example can take
# longer than hypothesis's 200 ms default deadline (the first one imports and warms torch ops).
# The vLLM and verl environments run none of them and do not install hypothesis.
with contextlib.suppress(ImportError):
    from hypothesis import settings

    settings.register_profile("sluice", deadline=None)
    settings.load_profile("sluice")

MakeCluster = Callable[..., "tq.Cluster"]


@pytest.fixture
def cluster():
    """A fresh two-unit cluster per test; checks it leaves no shared memory behind."""
    with tq.init(num_storage_units=2, storage_capacity="256MiB") as c:
        yield c
    assert not glob.glob(f"/dev/shm/sluice-{c.cluster_id}-*")


@pytest.fixture
def client(cluster):
    with tq.connect(cluster.address) as c:
        yield c


@pytest.fixture(scope="module")
def shared_cluster():
    """One cluster for a module's tests that do not depend on a fresh state."""
    with tq.init(num_storage_units=2, storage_capacity="256MiB") as c:
        yield c


@pytest.fixture
def make_cluster() -> Iterator[MakeCluster]:
    """`make_cluster(**init_kwargs)` starts a one-unit cluster; every one is shut down (and
    checked to leave no shared memory behind) when the test ends."""
    started: list[tq.Cluster] = []

    def make(**kwargs: Any) -> tq.Cluster:
        kwargs.setdefault("num_storage_units", 1)
        kwargs.setdefault("storage_capacity", "64MiB")
        cluster = tq.init(**kwargs)
        started.append(cluster)
        return cluster

    yield make
    for cluster in started:
        cluster.shutdown()
        assert not glob.glob(f"/dev/shm/sluice-{cluster.cluster_id}-*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` skip, saying why, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
