"""A Hugging Face `transformers` causal LM behind the same interface (its own KV cache)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import TokenLoopEngine

__all__ = ["HFEngine"]


class HFEngine(TokenLoopEngine):
    name = "hf"

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0):
        super().__init__(temperature)
        self.model = model.eval()

    def weights(self) -> Mapping[str, torch.Tensor]:
        return self.model.state_dict()

    def _prefill(self, prefixes: torch.Tensor, max_len: int) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=prefixes, use_cache=True)
        return out.logits[:, -1], [out.past_key_values]

    def _decode(self, tokens: torch.Tensor, state: Any) -> torch.Tensor:
        out = self.model(input_ids=tokens[:, None], past_key_values=state[0], use_cache=True)
        state[0] = out.past_key_values
        return out.logits[:, -1]
