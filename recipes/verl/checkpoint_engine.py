"""`SluiceCheckpointEngine`: verl's trainer-to-rollout weight sync over Sluice's weight channel.

Registered in verl's `CheckpointEngineRegistry` as `sluice`; select it with
`actor_rollout_ref.rollout.checkpoint_engine.backend=sluice` and
`...checkpoint_engine.custom_backend_module=recipes.verl.checkpoint_engine` (so every verl worker
imports this module before building its engine), as `config/sluice_ppo.yaml` does.

Trainer side (`send_weights`): every rank drains verl's per-tensor generator (for FSDP it
all-gathers, a collective); rank 0 (`is_master`) publishes the full tensors as version
`global_steps` with a `weight_sync.WeightPublisher`, which also records the version at the
controller, so Sluice's staleness budget follows the weights actually shipped. Before the first
version it announces each tensor's name, dtype and shape at the controller.

Rollout side (`receive_weights`): a `weight_sync.WeightSubscriber` over receive buffers shaped
from that announcement waits for the version and yields `(name, tensor)` to verl's server
adapter; a version is only ever yielded whole.

The engine reaches the cluster at `address` (engine kwarg) or, by default, the one
`transfer_queue` runs for verl (`tq.get_client().address`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import msgspec
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

import transfer_queue as tq
from weight_sync import WeightPublisher, WeightSubscriber
from weight_sync.manifest import dtype_name, dtype_of

__all__ = ["SluiceCheckpointEngine"]


def _shapes_key(name: str) -> str:
    return f"recipes.verl/{name}/shapes"


@CheckpointEngineRegistry.register("sluice")
class SluiceCheckpointEngine(CheckpointEngine):
    """verl `CheckpointEngine` whose bytes travel through Sluice's `weight_sync`.

    Args:
        bucket_size: bytes per staging bucket (verl's `update_weights_bucket_megabytes`).
        is_master: this trainer rank publishes (rank 0); other ranks only drain the generator.
        address: the Sluice controller; default: the cluster of `tq.get_client()`.
        transport: `weight_sync` transport ("auto", "shm", "tcp", "ucx", "torch").
        name: the weight channel's name (one per model).
        timeout: seconds a receiver waits for a version.
    """

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        address: str | None = None,
        transport: str = "auto",
        name: str = "policy",
        timeout: float = 600.0,
    ):
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.address = address or tq.get_client().address
        self.transport = transport
        self.name = name
        self.timeout = timeout
        self.rank = 0
        self._publisher: WeightPublisher | None = None
        self._subscriber: WeightSubscriber | None = None
        self._targets: dict[str, torch.Tensor] = {}
        self._sent = -1

    # -- verl's topology hooks: Sluice needs no process group --------------------------------

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate per step; the metadata is the controller's address."""
        return {"address": self.address}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Each worker only needs its rank: publishers and subscribers meet at the controller."""
        return {"rank": list(range(actor_wg_world_size))}, {"rank": list(range(rollout_world_size))}

    def init_process_group(self, rank: int = 0, **kwargs: Any) -> None:
        """Record this worker's rank (no collective group is formed)."""
        self.rank = rank

    def finalize(self) -> None:
        """Keep the publisher/subscriber for the next step (their buffers are reused)."""

    def close(self) -> None:
        """Release the publisher's staging segments and the subscriber's receiver."""
        for side in (self._publisher, self._subscriber):
            if side is not None:
                side.close()
        self._publisher = self._subscriber = None

    # -- trainer side ---------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: int | None = None) -> dict:
        """Publish `weights` as version `global_steps` (default: one more than the last sent).

        Returns verl metrics: publish seconds and bytes, and for the newest earlier version the
        rollout pulled, the bytes its pulls put on the wire and the fraction of bytes that
        changed against its base (deltas). Raises `weight_sync`'s errors.
        """
        start = time.perf_counter()
        tensors = {name: tensor.detach().to("cpu") for name, tensor in weights}
        version = self._sent + 1 if global_steps is None else int(global_steps)
        self._sent = version
        if not self.is_master:
            return {}
        if self._publisher is None:
            self._publisher = WeightPublisher(
                self.address, self.transport, name=self.name, bucket_bytes=max(self.bucket_size, 1 << 20)
            )
            shapes = {n: [dtype_name(t.dtype), list(t.shape)] for n, t in tensors.items()}
            with tq.connect(self.address) as client:
                client.announce(_shapes_key(self.name), msgspec.msgpack.encode(shapes))
        await asyncio.to_thread(self._publisher.publish, tensors, version)
        metrics = {
            "sluice/weight_sync/publish_s": time.perf_counter() - start,
            "sluice/weight_sync/bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        }
        pulled = [s for s in self._publisher.stats() if s.version < version and s.requested]
        if pulled:  # the newest earlier version the rollout pulled: its pulls have ended by now
            metrics["sluice/weight_sync/wire_bytes"] = pulled[-1].sent
            metrics["sluice/weight_sync/density"] = pulled[-1].density
        return metrics

    # -- rollout side ---------------------------------------------------------------------

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Wait for version `global_steps` or newer (default: any newer than the last received)
        and yield every `(name, tensor)` of the newest whole version (a rollout worker skips
        versions it was too slow to take). Raises `tq.TimeoutError` after `timeout` seconds."""
        if self._subscriber is None:
            await asyncio.to_thread(self._open_subscriber)
        want = self._subscriber.version + 1 if global_steps is None else int(global_steps)
        await asyncio.to_thread(self._subscriber.wait, want, self.timeout)
        for name, tensor in self._targets.items():
            yield name, tensor

    def _open_subscriber(self) -> None:
        with tq.connect(self.address) as client:
            raw = client.lookup(_shapes_key(self.name), timeout=self.timeout)
        if raw is None:
            raise tq.TimeoutError(f"no trainer published weights {self.name!r} within {self.timeout} s")
        shapes = msgspec.msgpack.decode(raw)
        self._targets = {n: torch.empty(shape, dtype=dtype_of(dtype)) for n, (dtype, shape) in shapes.items()}
        self._subscriber = WeightSubscriber(
            self.address, self._targets, transport=self.transport, name=self.name, timeout=self.timeout
        )
