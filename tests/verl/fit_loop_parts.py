"""CPU stand-ins for the GPU-bound collaborators of verl 0.9.1's V1 `PPOTrainer`, used by
test_fit_loop.py. Each replaces one thing that needs a GPU, at the narrowest seam verl offers:

- the LLM server (and so the model's generation): `EchoAgentLoop`, registered as an agent loop
  the way verl registers `single_turn_agent`, answers each prompt with tokens derived from it,
  stamped with the weight version the server holds (`LLMServer.version`);
- the reward model: `RuleReward` answers the `compute_score.remote(data)` call verl's agent loop
  worker makes on its reward loop worker actors;
- the worker groups' model calls: `CpuActor` has the methods of verl's `ActorRolloutRefWorker`
  that the trainer calls, registered with verl's own `register` (so verl's `tqbridge` wraps them),
  and `LocalWorkerGroup` runs them in this process through verl's own dispatch and collect
  functions (`BatchData.chunk`/`concat`, each rank's chunk put into Ray's object store) where
  `RayWorkerGroup` would run them in Ray actors holding GPUs;
- the weight-sync manager: `CheckpointManager` moves the trainer's step into `LLMServer.version`.

What still runs as verl wrote it: `AgentLoopWorkerTQ.generate_sequences`, `_run_prompt`,
`_run_agent_loop`, `_compute_score` and `_agent_loop_postprocess` (unwrapped from `@ray.remote`,
each worker on its own event loop thread, as a Ray actor's loop would be).
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn
from verl.single_controller.base.decorator import register as register_method
from verl.single_controller.base.worker_group import WorkerGroup
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
from verl.utils import tensordict_utils as tu

from transfer_queue._tensors import is_non_tensor

ECHO_AGENT = "sluice_cpu_echo"


class LLMServer:
    """What the rollout replicas hold: the weight version they generate with. (A plain class:
    hydra's `instantiate` would turn a dataclass argument into a config copy.)"""

    def __init__(self) -> None:
        self.version = 0
        self.generated = 0


@register(ECHO_AGENT)
class EchoAgentLoop(AgentLoopBase):
    """Answers a prompt `"t1 t2 ..."` with its tokens reversed plus the session id (so the
    responses of one group differ in length), as the weights of `server.version` would."""

    def __init__(self, trainer_config: Any, server_manager: LLMServer, **kwargs: Any):
        self.config = trainer_config.config
        self.server = server_manager

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        prompt_ids = [int(t) for t in kwargs["raw_prompt"][-1]["content"].split()]
        response_ids = prompt_ids[::-1] + [7] * (1 + int(kwargs["session_id"]))
        version = self.server.version
        self.server.generated += 1
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            response_mask=[1] * len(response_ids),
            response_logprobs=[-0.5] * len(response_ids),
            num_turns=2,
            metrics={},
            extra_fields={"min_global_steps": version, "max_global_steps": version},
        )


class _Remote:
    def __init__(self, fn: Any):
        self.remote = fn


class RuleReward:
    """verl's reward loop worker actor, answered in process: reward 1 when the response
    starts with the prompt's last token."""

    def __init__(self) -> None:
        self.compute_score = _Remote(self._score)

    async def _score(self, data: Any) -> dict[str, Any]:
        prompt = data.batch["prompts"][-1]
        response = data.batch["responses"][-1]
        last = int(prompt[int(data.non_tensor_batch["prompt_len"][-1]) - 1])
        return {"reward_score": float(int(response[0]) == last), "reward_extra_info": {}}


_WorkerTQ = AgentLoopWorkerTQ.__ray_metadata__.modified_class  # the class under @ray.remote


class AgentLoopWorker(_WorkerTQ):
    """verl's `AgentLoopWorkerTQ` on its own event loop thread, with the LLM server and reward
    worker above in place of the Ray actors and GPU replicas its constructor would reach."""

    def __init__(self, config: Any, server: LLMServer, reward: RuleReward):
        self.config = config
        self.llm_client = server
        self.teacher_client = None
        self.reward_loop_worker_handles = [reward]
        self.tokenizer = self.processor = self.hf_model_type = self.dataset_cls = None
        self.mm_processor_kwargs = {}
        self.distillation_enabled = False
        self.tools = []
        self.background_tasks: set[asyncio.Task] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-loop-worker", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Cancel the unfinished agent loops, shut the loop down as `asyncio.run` would, close it."""

        async def drain() -> None:
            for task in list(self.background_tasks):
                task.cancel()
            await asyncio.gather(*self.background_tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()


class AgentLoopManager:
    """verl's `AgentLoopManagerTQ.generate_sequences`: chunk the prompts over the workers and
    hand each its chunk without waiting for the trajectories."""

    def __init__(self, workers: list[AgentLoopWorker]):
        self.agent_loop_workers = workers

    def generate_sequences(self, prompts: TensorDict) -> None:
        chunks = prompts.chunk(len(self.agent_loop_workers))
        futures = [
            asyncio.run_coroutine_threadsafe(w.generate_sequences(c), w.loop)
            for w, c in zip(self.agent_loop_workers, chunks, strict=False)
        ]
        for f in futures:
            f.result(timeout=60)


@dataclass
class ActorCall:
    """What one data-parallel rank of the actor received: the method, the fields and rows of its
    TensorDict (after verl's tqbridge read them from the store) and the batch-level info."""

    method: str
    rank: int
    fields: set[str]
    rows: int
    info: dict[str, Any] = field(default_factory=dict)


class CpuActor:
    """The actor's model calls on one data-parallel rank: log-probs and entropy from the token
    ids (no model), an update that only reports metrics."""

    def __init__(self, rank: int, calls: list[ActorCall]):
        self.rank = rank
        self.calls = calls

    def _record(self, method: str, data: TensorDict) -> None:
        fields = {k for k, v in data.items() if isinstance(v, torch.Tensor) and not is_non_tensor(v)}
        keys = set(data.keys())
        info = {k: data.get_non_tensor(k) for k in ("global_batch_size", "temperature") if k in keys}
        self.calls.append(ActorCall(method, self.rank, fields, int(data.batch_size[0]), info))

    @register_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_dispatch_info(self, mesh_name: str) -> int:
        return self.rank

    @register_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_collect_info(self, mesh_name: str) -> bool:
        return True

    # separate_async keeps the weights that computed old_log_probs (pi_old) while it updates
    @register_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_model_to_cpu(self, slot: int) -> None:
        self.calls.append(ActorCall("save_model_to_cpu", self.rank, set(), 0, {"slot": slot}))

    @register_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def restore_model_from_cpu(self, slot: int) -> None:
        self.calls.append(ActorCall("restore_model_from_cpu", self.rank, set(), 0, {"slot": slot}))

    @register_method(dispatch_mode=Dispatch.ONE_TO_ALL)
    def clear_cpu_model(self, slot: int) -> None:
        self.calls.append(ActorCall("clear_cpu_model", self.rank, set(), 0, {"slot": slot}))

    @register_method(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        self._record("compute_log_prob", data)
        ids = data["input_ids"]
        values = -(ids.values().float() % 5 + 1) / 10
        nested = torch.nested.nested_tensor_from_jagged(values, ids.offsets())
        return TensorDict({"log_probs": nested, "entropy": nested.abs()}, batch_size=data.batch_size)

    @register_method(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        self._record("update_actor", data)
        advantages = data["advantages"].values()
        metrics = {"pg_loss": [float(advantages.abs().mean())], "mfu": [0.0]}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


class LocalWorkerGroup(WorkerGroup):
    """verl's `WorkerGroup` over in-process workers: each registered method runs verl's dispatch
    function, calls every rank in turn, and runs verl's collect function, as `RayWorkerGroup`'s
    `func_generator` does around its Ray calls."""

    def __init__(self, workers: list[CpuActor]):
        super().__init__(resource_pool=None)
        self._workers = workers
        self._bind_worker_method(type(workers[0]), _func_generator)

    @property
    def world_size(self) -> int:
        return len(self._workers)

    def execute_all(self, method_name: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call every rank with its share; Ray object references (verl's dispatch puts each
        rank's chunk into Ray's object store) are resolved first, as a Ray actor call does."""
        return [
            getattr(w, method_name)(*(_resolved(a[i]) for a in args), **{k: _resolved(v[i]) for k, v in kwargs.items()})
            for i, w in enumerate(self._workers)
        ]


def _resolved(value: Any) -> Any:
    return ray.get(value) if isinstance(value, ray.ObjectRef) else value


def _func_generator(group, method_name, dispatch_fn, collect_fn, execute_fn, blocking):
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = dispatch_fn(group, *args, **kwargs)
        return collect_fn(group, execute_fn(method_name, *args, **kwargs))

    return call


class CheckpointManager:
    """verl's `CheckpointEngineManager` for colocated replicas: `update_weights(step)` makes the
    replicas generate with the trainer's weights of `step`; the others pause and resume them."""

    def __init__(self, server: LLMServer):
        self.server = server
        self.updates: list[int] = []

    def update_weights(self, global_steps: int) -> dict:
        self.server.version = global_steps
        self.updates.append(global_steps)
        return {}

    def sleep_replicas(self) -> None:
        pass

    def abort_replicas(self, reject_request: bool = False) -> None:
        pass

    def resume_generation_replicas(self) -> None:
        pass


def prompts(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Rows of a dataset as verl's RLHF dataloader yields them (chat messages, index)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(count):
        tokens = rng.integers(10, 50, size=3 + i % 4).tolist()
        rows.append({"raw_prompt": [{"role": "user", "content": " ".join(map(str, tokens))}], "index": i})
    return rows


class DataLoader:
    """Batches of `batch_size` prompts as numpy columns, the shape verl's collate gives."""

    def __init__(self, rows: list[dict[str, Any]], batch_size: int):
        self.rows, self.batch_size = rows, batch_size

    def __iter__(self):
        for start in range(0, len(self.rows) - self.batch_size + 1, self.batch_size):
            part = self.rows[start : start + self.batch_size]
            raw = np.empty(len(part), dtype=object)
            raw[:] = [r["raw_prompt"] for r in part]
            yield {"raw_prompt": raw, "index": np.array([r["index"] for r in part])}
