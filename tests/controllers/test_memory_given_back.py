"""The controller's memory returns near its idle size once a crowd of clients has left: its
per-connection state and the freed heap of their puts go back to the system, measured on the
real controller process (`RssAnon` from /proc)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import transfer_queue as tq
from controllers.ledger import KEEP_FREED
from tests.helpers import eventually

CLIENTS = 1_000
BOUND_MIB = KEEP_FREED / (1 << 20) + 4.0
"""How far above its idle size the controller may stay once the crowd has left: the freed heap
it keeps for its next allocations (`KEEP_FREED`) and a little more (allocator pools, interned
names); the crowd itself adds over twice that."""


def _anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


async def _crowd(address: str, pid: int) -> float:
    """`CLIENTS` clients connect and put 4 samples each; returns the controller's anonymous
    memory (MiB) while they are all connected, then they leave."""
    clients = [await tq.connect_async(address, use_shm=False) for _ in range(CLIENTS)]
    try:
        await asyncio.gather(*(c.put({"x": torch.zeros(4, 256)}, timeout=60) for c in clients))
        return _anon_mib(pid)
    finally:
        for c in clients:
            await c.close()


@pytest.mark.slow
def test_the_controller_gives_its_memory_back_after_a_crowd_leaves(make_cluster):
    cluster = make_cluster()
    pid = cluster.services[0]["pid"]
    with cluster.connect(use_shm=False) as watcher:
        watcher.status()
        idle = _anon_mib(pid)
        crowded = asyncio.run(_crowd(cluster.address, pid))
        assert crowded - idle > 2 * BOUND_MIB, f"the crowd added only {crowded - idle:.1f} MiB: nothing to give back"
        watcher.clear_partition("train")
        eventually(
            lambda: _anon_mib(pid) <= idle + BOUND_MIB,
            30,
            f"the controller back within {BOUND_MIB} MiB of its idle {idle:.1f} MiB (it held {crowded:.1f})",
        )
