"""The default engine: the recipe's own `TinyTransformer`, in plain torch, with its KV cache."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..policy import KVCache, TinyTransformer
from .base import TokenLoopEngine

__all__ = ["TorchEngine"]


class TorchEngine(TokenLoopEngine):
    name = "torch"

    def __init__(self, model: TinyTransformer, temperature: float = 1.0):
        super().__init__(temperature)
        self.model = model.eval()

    def weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.state_dict()

    def _prefill(self, prefixes: torch.Tensor, max_len: int) -> tuple[torch.Tensor, KVCache]:
        cache = self.model.new_cache(prefixes.shape[0], max_len)
        return self.model(prefixes, cache)[:, -1], cache

    def _decode(self, tokens: torch.Tensor, state: KVCache) -> torch.Tensor:
        return self.model(tokens[:, None], state)[:, -1]
