"""This host's identity, for deciding whether two processes can share memory, and which
shared-memory files belong to a cluster."""

from __future__ import annotations

import os
import socket

__all__ = ["host_id", "arena_path", "open_arena", "reachable"]


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


_WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


def reachable(endpoint: str, toward: str | None = None) -> str:
    """`endpoint` (`tcp://host:port`) as others can reach it: a wildcard host (0.0.0.0 binds
    every interface but reaches none) becomes this machine's IP on the route to `toward`'s host
    (or the default route), found without sending anything; else the IP of this machine's name."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host not in _WILDCARDS:
        return endpoint
    ip = ""
    peer = toward.partition("://")[2].rpartition(":")[0] if toward else "192.0.2.1"  # TEST-NET-1: the default route
    if peer not in _WILDCARDS:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((peer, 9))  # UDP connect: a routing lookup, no packet
                ip = probe.getsockname()[0]
        except OSError:
            ip = ""
    if not ip:
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
    return f"{scheme}://{ip}:{port}"
