"""Sluice's weight-sync channel: trainer weights to every rollout worker, versioned and whole.

The face is `WeightPublisher` (trainer side) and `WeightSubscriber` (rollout side). Behind it:
who holds what and how names map (`layout`, `mapping`), what a rank stages and how
(`manifest`, `buckets`, `staging`), the reshard plan (`plan`), the control plane on the RPC
kernel (`protocol`, `coordinator`), the subscriber's receivers (`ranks`, `receivers`,
`background`), validation (`checksum`), deltas against the previous version (`delta`), and
`transports/` behind one small interface. One line per module: docs/architecture.md, "The
module map"; how to use it: docs/weight-sync.md.
"""

from __future__ import annotations

from .layout import Layout
from .mapping import LLAMA, LLAMA_TP_DIMS, QWEN, FlatShard, NameMapping, TPShard
from .publisher import WeightPublisher
from .subscriber import WeightSubscriber
from .transports import Transport, register
from .transports.cuda_ipc import CudaIpcTransport
from .transports.nixl import NixlTransport
from .transports.shm import ShmTransport
from .transports.tcp import TcpTransport
from .transports.torch_dist import TorchTransport
from .transports.ucx import UcxTransport

__all__ = [
    "WeightPublisher",
    "WeightSubscriber",
    "Layout",
    "TPShard",
    "FlatShard",
    "NameMapping",
    "LLAMA",
    "QWEN",
    "LLAMA_TP_DIMS",
    "Transport",
    "register",
    "ShmTransport",
    "TcpTransport",
    "UcxTransport",
    "NixlTransport",
    "CudaIpcTransport",
    "TorchTransport",
]
