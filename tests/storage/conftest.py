"""Fixtures of the storage tests: the session's unit processes and clients of them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from storage_harness import UnitClient, Units

from transfer_queue.wire.messages import Free, UnitStatus


@pytest.fixture(scope="session")
def units() -> Iterator[Units]:
    u = Units()
    yield u
    u.close()


@pytest.fixture
def main_client(units: Units) -> Iterator[UnitClient]:
    client = UnitClient(units.main.address)
    yield client
    client.close()


@pytest.fixture
def small_client(units: Units) -> Iterator[UnitClient]:
    """A client of the 1 MiB unit, which must be empty before and is emptied after each test."""
    client = UnitClient(units.small.address)
    status = client.ok(UnitStatus())[0].status
    for partition in status["rows"]:
        client.ok(Free(partition))
    yield client
    status = client.ok(UnitStatus())[0].status
    for partition in status["rows"]:
        client.ok(Free(partition))
    client.close()
