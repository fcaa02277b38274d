"""An in-process controller over a journal, for tests that call its handlers directly and then
restart it from that journal."""

from __future__ import annotations

from pathlib import Path

from controllers.service import Controller
from transfer_queue.wire.messages import ClusterConfig


def journaled_controller(path: Path, cluster_id: str) -> Controller:
    """A one-unit controller journaling to `path` (replaying it first if it exists)."""
    return Controller(
        ClusterConfig(num_storage_units=1, storage_capacity=1 << 30, journal=str(path)),
        "tcp://127.0.0.1:*",
        cluster_id=cluster_id,
        secret="s",
    )


def stop(ctl: Controller) -> None:
    """Close what the controller opened without running its loop: pinger, journal, sockets."""
    if ctl.links.pinger is not None:
        ctl.links.pinger.cancel()
    ctl.journal.close()
    for channel in ctl.links.channels.values():
        channel.close()
    ctl.sock.close(linger=0)
