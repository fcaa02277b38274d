"""An in-process controller over a journal, for tests that call its handlers directly and then
restart it from that journal."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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


def state(ctl: Controller) -> dict:
    """What a replay must give back: the ledger's tables (live rows) and the key indexes."""
    ledger = ctl.ledger
    out = {
        "version": ctl.clock.current,
        "next": ledger.next_index,
        "units": sorted(ledger.units),
        "bytes": ledger.unit_bytes,
    }
    for name, part in ledger.partitions.items():
        live = np.flatnonzero(part.alive[: part.n])
        out[name] = {
            "sealed": part.sealed,
            "gidx": part.gidx[live].tolist(),
            "committed": part.committed[live].tolist(),
            "v": (part.v_first[live].tolist(), part.v_last[live].tolist()),
            "ready": {f: r[live].tolist() for f, r in part.ready.items()},
            "field_bytes": {f: b[live].tolist() for f, b in part.field_bytes.items()},
            "consumed": {t: s.consumed[live].tolist() for t, s in part.tasks.items()},
        }
    out["keys"] = {
        name: {k: (index.index[k], index.tags[k]) for k in index.live_keys()} for name, index in ctl.keys.live().items()
    }
    return out
