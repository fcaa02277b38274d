"""Sluice's weight-sync channel: trainer weights to every rollout worker, versioned and whole.

The face is `WeightPublisher` (trainer side) and `WeightSubscriber` (rollout side). Behind it:

- `layout`    boxes and `Layout`s: which elements of a global tensor a local shard holds
- `mapping`   `TPShard`/`FlatShard` (who holds what), `NameMapping` (trainer names to inference
              names, fusing q/k/v and gate/up: `LLAMA`, `QWEN`)
- `manifest`  what a publisher rank stages: one `Entry` (name, dtype, layout, bucket, offset)
              per tensor
- `buckets`   assigning tensors to fixed-size buckets and packing them, bucket by bucket
- `plan`      the reshard plan: intersections of what ranks hold and what a subscriber needs
- `staging`   pre-faulted shared segments and the slots (with leases) that hold versions
- `protocol`  control-plane messages and the ZeroMQ request/reply loop
- `transports/`  shm, tcp, ucx, torch: one small interface and a registry (`base`), the
              byte-stream protocol tcp and ucx share (`stream`)
- `publisher`, `subscriber`  the two sides, built from the above; the subscriber's calls to
              the publisher ranks are `ranks`, its receiver strategy per transport mode
              is `receivers` (mapped) or `background` (reads, image)
"""

from __future__ import annotations

from .layout import Layout
from .mapping import LLAMA, LLAMA_TP_DIMS, QWEN, FlatShard, NameMapping, TPShard
from .publisher import WeightPublisher
from .subscriber import WeightSubscriber
from .transports import Transport, register
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
    "TorchTransport",
]
