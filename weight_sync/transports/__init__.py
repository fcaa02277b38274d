"""Transports: one module per way of moving bytes, one small interface (`base.Transport`).

`shm` (same host, shared memory), `tcp` (raw sockets, relay trees), `ucx` (ucxx; RDMA where
there is some; optional), `nixl` (NIXL one-sided reads of the publisher's staging; optional),
`torch` (torch.distributed broadcast), `cuda_ipc` (same host, GPU staging opened through CUDA IPC). Each registers itself by
name; `resolve` turns a name (or "auto") into instances, `auto_choice` picks one per peer.
"""

from __future__ import annotations

from . import cuda_ipc, nixl, shm, tcp, torch_dist, ucx  # noqa: F401 - importing registers them
from .base import Job, MapTransport, Source, Transport, get, names, register

__all__ = ["Transport", "MapTransport", "Job", "Source", "register", "get", "names", "resolve", "AUTO_ORDER"]

AUTO_ORDER = ("cuda_ipc", "shm", "ucx", "tcp")
"""What "auto" offers (publisher) and prefers, in order (subscriber): cuda_ipc when co-located
with CUDA tensors on both sides, shm when co-located, else ucx when installed, else tcp. A
publisher stages for cuda_ipc only once a subscriber leases over it (`gpu_mirror`)."""


def resolve(transport: str | Transport | list) -> list[Transport]:
    """Instances for `transport`: a name, an instance, a list of either, or "auto" (every
    available transport of `AUTO_ORDER`), for either side. Raises `ValueError` for unknown or
    unavailable ones."""
    if isinstance(transport, (list, tuple)):
        return [t for item in transport for t in resolve(item)]
    if isinstance(transport, Transport):
        return [transport]
    if transport == "auto":
        return [get(name)() for name in AUTO_ORDER if get(name).is_available()]
    cls = get(transport)
    if not cls.is_available():
        raise ValueError(
            f"transport {transport!r} is not available here (install its extra, e.g. sluice-rl[{transport}])"
        )
    return [cls()]
