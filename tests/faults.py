"""Helpers for fault tests: wait on observable state, ask units for their status, run a
producer that stops (or is killed) in the middle of a put."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import eventually
from tests.peers import peer
from transfer_queue.wire.messages import UnitStatus

__all__ = ["ROOT", "eventually", "unit_status", "stalled_producer"]

ROOT = str(Path(__file__).resolve().parents[1])


def unit_status(address: str, timeout: float = 10.0) -> dict:
    """A storage unit's own `status()` over a fresh channel."""
    channel = peer(address)
    try:
        return channel.call(UnitStatus(), timeout).status
    finally:
        channel.close()


STALLED_PRODUCER = r"""
import sys
import torch
from tensordict import TensorDict
import transfer_queue as tq
from transfer_queue.wire.messages import CommitPut

client = tq.connect(sys.argv[1], use_shm=sys.argv[2] == "shm")
flow = client._core.put(TensorDict({"x": torch.ones(16, 4096)}, batch_size=[16]), timeout=1.0)
calls = next(flow)
while True:  # drive the put up to its CommitPut and send all but that: the data sits on the units
    replies = []
    for c in calls:
        channel = client._channel(c.target)
        if isinstance(c.msg, CommitPut):
            break
        if c.notice:
            channel.post(c.msg, c.data)
            replies.append((None, []))
        else:
            replies.append(channel.reply(channel.send(c.msg, c.data)))
    else:
        calls = flow.send(replies)
        continue
    break
print("WRITTEN", flush=True)
sys.stdin.read()
"""


def stalled_producer(address: str, via: str) -> subprocess.Popen:
    """A producer process whose put is written to the units but never committed; it prints
    `WRITTEN` and then waits for the test to kill it."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", STALLED_PRODUCER, address, via],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert line.strip() == "WRITTEN", f"the producer did not get its put written: {line!r}"
    return proc
