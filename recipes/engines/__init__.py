"""Generation engines behind one interface (`base.Engine`): `torch` (the recipe's tiny
transformer), `hf` (a transformers causal LM), `vllm` (vLLM's `LLM`, where it installs)."""

from __future__ import annotations

import torch

from ..config import RecipeConfig
from ..policy import build_policy
from .base import Engine, Generation

__all__ = ["Engine", "Generation", "make_engine"]


def make_engine(cfg: RecipeConfig, model: torch.nn.Module | None = None) -> Engine:
    """The engine `cfg.rollout.engine` names, generating with `model` (default: a new copy of
    the run's initial policy; the co-located baseline passes the model it trains)."""
    name, temperature = cfg.rollout.engine, cfg.rollout.temperature
    if name == "vllm":
        from .vllm_engine import VllmEngine

        return VllmEngine(cfg)
    model = build_policy(cfg) if model is None else model
    if name == "torch":
        from .torch_engine import TorchEngine

        return TorchEngine(model, temperature)
    from .hf_engine import HFEngine

    return HFEngine(model, temperature)
