"""This host's identity, for deciding whether two processes can share memory, and which
shared-memory files belong to a cluster."""

from __future__ import annotations

import os
import socket

__all__ = ["host_id", "arena_path", "open_arena"]


def host_id() -> str:
    """Hostname plus boot id: processes reporting the same id can map each other's /dev/shm files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def arena_path(cluster_id: str, unit_id: int) -> str:
    """Where unit `unit_id` of cluster `cluster_id` keeps its arena (the only path a client maps)."""
    return f"/dev/shm/sluice-{cluster_id}-u{unit_id}"


def open_arena(cluster_id: str, unit_id: int, shm_path: str, capacity: int) -> int | None:
    """A read-write descriptor of a unit's arena, or None unless the path a unit advertised is
    exactly its cluster's arena file: no other name, no symlink, owned by this user and big
    enough. A client never maps (and writes into) any other file a peer names."""
    expected = arena_path(cluster_id, unit_id)
    if shm_path != expected:
        return None
    try:
        fd = os.open(expected, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_size < capacity:
        os.close(fd)
        return None
    return fd
