"""Shared fixtures: real clusters (controller + storage unit processes on loopback)."""

from __future__ import annotations

import glob

import pytest

import transfer_queue as tq


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
