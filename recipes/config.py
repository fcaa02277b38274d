"""Recipe configuration: one typed schema, loaded from OmegaConf YAML plus dot-list overrides.

Every recipe command (`recipes.experiments`, `recipes.async_trainer`, `recipes.rollout_worker`,
`recipes.demo`) takes the same overrides, e.g. `trainer.total_steps=40 seed=1
async_training.staleness_threshold=0.3`. verl's async knobs keep verl's names under
`async_training`; Sluice's consumption bound is `max_staleness` (η).

How they map onto Sluice's staleness control (`tq.StalenessConfig`):

- samples per trainer step = `trainer.ppo_mini_batch_size` prompts × `rollout.group_size`
  responses × `async_training.require_batches`;
- a new weight version every `async_training.trigger_parameter_sync_step` steps, so the
  controller's `consumer_batch_size` is samples per step × that;
- the admission budget's η is `async_training.staleness_threshold` when set (verl's fraction),
  else `max_staleness`; `max_staleness` is also the bound checked on every consumed sample
  (None: unbounded, as in verl).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import transfer_queue as tq

__all__ = [
    "AsyncTraining",
    "ClusterSettings",
    "ModelConfig",
    "RecipeConfig",
    "RolloutConfig",
    "TaskConfig",
    "TrainerConfig",
    "command_line",
    "load",
    "reporting_errors",
    "to_yaml",
]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass
class AsyncTraining:
    """verl's fully-async knobs, with verl's names."""

    trigger_parameter_sync_step: int = 1
    """Trainer steps between two weight publications (one version per publication)."""
    staleness_threshold: float | None = None
    """Fraction of a version's samples that may be produced ahead (None: use `max_staleness`)."""
    require_batches: int = 1
    """Mini-batches gathered per trainer step."""
    partial_rollout: bool = False
    """Interrupt generation at a token boundary when a new version arrives, swap, resume."""


@dataclass
class TaskConfig:
    """Digit reversal: answers as long as the prompt's digits, so generation has a tail."""

    min_digits: int = 2
    max_digits: int = 8


@dataclass
class ModelConfig:
    """The policy: `tiny` (plain torch, built here) or `qwen2` (transformers, random init)."""

    family: str = "tiny"
    device: str = "cpu"
    """Where the policy, the trainer and the torch/hf engine live: `cpu`, `cuda` or `cuda:N`.
    On CUDA the rollout workers put CUDA batches, the trainer reads them onto its device, and
    with `rollout.transport=auto` the weights flow over `cuda_ipc`."""
    d_model: int = 64
    layers: int = 2
    heads: int = 4


@dataclass
class RolloutConfig:
    """The rollout workers: engine, how many, and the shape of their generation batches."""

    engine: str = "torch"
    """Generation engine: `torch` (tiny transformer, KV cache), `hf` (transformers), `vllm`."""
    workers: int = 1
    """Rollout worker processes."""
    prompts_per_batch: int = 8
    """Prompts a worker takes per generation batch (each answered `group_size` times)."""
    group_size: int = 8
    temperature: float = 1.0
    transport: str = "auto"
    """Weight-sync transport, named for both sides (`shm`, `tcp`, `cuda_ipc`, ...). `auto`: the
    trainer publishes over `cuda_ipc` when `model.device` is CUDA, else over its host transports,
    and the workers take the best one it offers."""


@dataclass
class TrainerConfig:
    """The trainer: run length, mini-batch size (verl's unit), optimizer and loss."""

    total_steps: int = 200
    ppo_mini_batch_size: int = 32
    """Prompts per mini-batch (verl's unit before multiplying by the group size)."""
    lr: float = 3e-3
    loss: str = "decoupled"
    """`decoupled` (AReaL: behaviour-weighted, clipped against the proximal policy) or `ppo`."""
    clip_eps: float = 0.2
    behaviour_weight_cap: float = 1.0
    """Truncation of the decoupled loss's importance weight pi_prox / pi_behaviour."""
    batch_timeout: float = 120.0
    """Seconds the trainer waits for a step's samples before it gives up."""


@dataclass
class ClusterSettings:
    """The cluster `recipes.experiments` and `recipes.demo` start (ignored against `--address`)."""

    units: int = 2
    capacity: str = "256MiB"
    lease_timeout: float = 30.0
    grant_timeout: float = 30.0
    stale_policy: str = "drop"


@dataclass
class RecipeConfig:
    """One run: the staleness bound, verl's async knobs, and each part's settings."""

    name: str = "run"
    mode: str = "async"
    """`async`: trainer and rollout workers as processes around a cluster; `colocated`: one
    process generates then trains, no Sluice (the co-located synchronous baseline)."""
    seed: int = 0
    max_staleness: int | None = 2
    out_dir: str = ""
    """Where the trainer writes `steps.jsonl` and the workers their records ("" = nowhere)."""
    async_training: AsyncTraining = field(default_factory=AsyncTraining)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    @property
    def samples_per_step(self) -> int:
        return self.trainer.ppo_mini_batch_size * self.rollout.group_size * self.async_training.require_batches

    @property
    def prompts_per_step(self) -> int:
        return self.trainer.ppo_mini_batch_size * self.async_training.require_batches

    @property
    def device(self) -> torch.device:
        """`model.device` as a `torch.device` (checked when the config was loaded)."""
        return torch.device(self.model.device)

    @property
    def publisher_transport(self) -> str:
        """The transport the trainer publishes weights over (see `RolloutConfig.transport`)."""
        if self.rollout.transport == "auto" and self.device.type == "cuda":
            return "cuda_ipc"
        return self.rollout.transport

    def staleness(self) -> tq.StalenessConfig:
        """The cluster's staleness settings for this run."""
        at = self.async_training
        return tq.StalenessConfig.from_verl(
            self.trainer.ppo_mini_batch_size * self.rollout.group_size,
            require_batches=at.require_batches,
            trigger_parameter_sync_step=at.trigger_parameter_sync_step,
            staleness_threshold=at.staleness_threshold,
            partial_rollout=at.partial_rollout,
            max_staleness=self.max_staleness,
        )


def load(configs: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> RecipeConfig:
    """Merge YAML files (later wins) and `key=value` overrides onto the defaults.

    A bare name such as `fully_async` is looked up in `recipes/configs/`. The run's `name`
    defaults to the last file's stem. Raises `tq.SchemaError` for an unknown key, a value of
    the wrong type, or an unreadable file.
    """
    merged = OmegaConf.structured(RecipeConfig)
    try:
        for item in configs:
            path = _resolve(item)
            merged = OmegaConf.merge(merged, {"name": path.stem}, OmegaConf.load(path))
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
    except (OmegaConfBaseException, OSError) as exc:
        raise tq.SchemaError(f"bad recipe configuration: {exc}") from exc
    cfg: RecipeConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    _validate(cfg)
    return cfg


def command_line(
    prog: str, doc: str | None, argv: Sequence[str] | None, worker: bool = False
) -> tuple[argparse.Namespace, RecipeConfig]:
    """Parse `--address A [--worker-id N] [CONFIG.yaml ...] [key=value ...]` (the recipe commands)."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])
    parser.add_argument("--address", required=True, help="the controller's address (printed by `sluice serve`)")
    if worker:
        parser.add_argument("--worker-id", type=int, default=0, help="this worker's number among the run's workers")
    parser.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value")
    args = parser.parse_intermixed_args(argv)
    files = [i for i in args.items if "=" not in i]
    return args, load(files, [i for i in args.items if "=" in i])


def reporting_errors(prog: str, run: Callable[[], int]) -> int:
    """`run()`'s exit status; a Sluice error ends the command with one line naming its type, its
    cause and the fix (status 1), not a traceback."""
    try:
        return run()
    except tq.SluiceError as exc:
        print(f"{prog}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


def to_yaml(cfg: RecipeConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _resolve(item: str | Path) -> Path:
    path = Path(item)
    if path.exists():
        return path
    named = CONFIG_DIR / f"{path.stem}.yaml"
    if named.exists():
        return named
    raise tq.SchemaError(f"no config file {item!s} (nor {named})")


def _validate(cfg: RecipeConfig) -> None:
    choices = {
        "mode": (cfg.mode, ("async", "colocated")),
        "model.family": (cfg.model.family, ("tiny", "qwen2")),
        "rollout.engine": (cfg.rollout.engine, ("torch", "hf", "vllm")),
        "trainer.loss": (cfg.trainer.loss, ("decoupled", "ppo")),
        "cluster.stale_policy": (cfg.cluster.stale_policy, ("drop", "keep", "requeue")),
    }
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise tq.SchemaError(f"{key}={value!r}: choose one of {', '.join(allowed)}")
    positive = {
        "trainer.total_steps": cfg.trainer.total_steps,
        "trainer.ppo_mini_batch_size": cfg.trainer.ppo_mini_batch_size,
        "rollout.workers": cfg.rollout.workers,
        "rollout.prompts_per_batch": cfg.rollout.prompts_per_batch,
        "rollout.group_size": cfg.rollout.group_size,
        "async_training.require_batches": cfg.async_training.require_batches,
        "async_training.trigger_parameter_sync_step": cfg.async_training.trigger_parameter_sync_step,
    }
    for key, value in positive.items():
        if value <= 0:
            raise tq.SchemaError(f"{key} must be > 0, got {value}")
    if not 1 <= cfg.task.min_digits <= cfg.task.max_digits:
        raise tq.SchemaError(
            f"need 1 <= task.min_digits <= task.max_digits, got {cfg.task.min_digits}, {cfg.task.max_digits}"
        )
    _check_device(cfg.model.device)
    if (cfg.rollout.engine == "torch") != (cfg.model.family == "tiny"):
        raise tq.SchemaError(
            f"rollout.engine={cfg.rollout.engine} with model.family={cfg.model.family}: the torch engine drives "
            "model.family=tiny; hf and vllm drive model.family=qwen2"
        )


def _check_device(device: str) -> None:
    """Raises `tq.SchemaError` unless `device` is the CPU or a CUDA device this process has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise tq.SchemaError(f"model.device={device!r} is not a device: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise tq.SchemaError(f"model.device={device!r}: choose cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise tq.SchemaError(f"model.device={device!r}: this machine has no CUDA device (use model.device=cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise tq.SchemaError(f"model.device={device!r}: this machine has {torch.cuda.device_count()} CUDA devices")
