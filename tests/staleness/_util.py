"""Small helpers shared by the staleness tests (importable by spawned producer processes)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import torch
from tensordict import TensorDict

import transfer_queue as tq


def rows(n: int, start: int = 0) -> TensorDict:
    """`n` samples with one int64 field `x` = start, start+1, ..."""
    return TensorDict({"x": torch.arange(start, start + n, dtype=torch.int64)}, batch_size=[n])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admission(client: tq.Client) -> dict:
    return client.status()["admission"]


def budget_limit(status: dict, eta: float, batch: int) -> int:
    """AReaL's cap on accepted + running at the status's version."""
    return int((eta + status["version"] + 1) * batch + 1e-9)


def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait (test side only) for a condition on the controller's state; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
