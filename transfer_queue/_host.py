"""This host's identity, for deciding whether two processes can share memory."""

from __future__ import annotations

import socket

__all__ = ["host_id"]


def host_id() -> str:
    """Hostname plus boot id: processes reporting the same id can map each other's /dev/shm files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"
