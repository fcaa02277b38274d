"""The generation-engine interface the rollout worker drives, and the token loop it shares.

An engine continues token prefixes by sampling, returns each sampled token's log-probability
under the sampling distribution (the behaviour policy the trainer corrects for), and exposes
its weights as tensors that `WeightSubscriber` updates in place. `generate` checks
`interrupt` at every token boundary: when it returns True, generation stops there and the
unfinished rows come back with `finished=False`, so a partial rollout can swap weights and
resume from prompt + tokens so far.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..task import EOS, PAD

__all__ = ["Engine", "Generation", "TokenLoopEngine"]


@dataclass
class Generation:
    """What one `generate` call produced, per row."""

    tokens: torch.Tensor
    """int64 [b, n]: sampled tokens, PAD after a row's end."""
    logprobs: torch.Tensor
    """float32 [b, n]: log-probability of each sampled token (0 after a row's end)."""
    lengths: torch.Tensor
    """int64 [b]: tokens each row produced in this call."""
    finished: torch.Tensor
    """bool [b]: the row emitted EOS or reached its token limit."""


class Engine(ABC):
    """A generation engine behind one interface (plain torch, transformers, vLLM)."""

    name: str

    @property
    def device(self) -> torch.device:
        """Where `generate` takes its prefixes and generator and returns its results."""
        return torch.device("cpu")

    @abstractmethod
    def weights(self) -> Mapping[str, torch.Tensor]:
        """The tensors a `WeightSubscriber` updates in place (trainer names)."""

    def weights_applied(self) -> None:
        """Called after a new version was copied into `weights()` (e.g. to re-pack kernels)."""

    @abstractmethod
    def generate(
        self,
        prefixes: torch.Tensor,
        max_new_tokens: int,
        generator: torch.Generator,
        interrupt: Callable[[], bool] | None = None,
    ) -> Generation:
        """Sample up to `max_new_tokens` after each row of `prefixes` (int64 [b, t], one length,
        on the engine's device; `generator` on the same device); the results are on it too."""


class TokenLoopEngine(Engine):
    """Sampling one token at a time over a KV cache; subclasses give prefill and decode."""

    model: torch.nn.Module

    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    @property
    def device(self) -> torch.device:
        """The model's device (`model.device`)."""
        return next(self.model.parameters()).device

    @abstractmethod
    def _prefill(self, prefixes: torch.Tensor, max_len: int) -> tuple[torch.Tensor, Any]:
        """Logits [b, vocab] after the prefixes, and the cache state to decode from."""

    @abstractmethod
    def _decode(self, tokens: torch.Tensor, state: Any) -> torch.Tensor:
        """Logits [b, vocab] after appending `tokens` [b]."""

    @torch.no_grad()
    def generate(self, prefixes, max_new_tokens, generator, interrupt=None) -> Generation:
        b, device = prefixes.shape[0], prefixes.device
        tokens = torch.full((b, max_new_tokens), PAD, dtype=torch.long, device=device)
        logprobs = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        done = torch.zeros(b, dtype=torch.bool, device=device)
        logits, state = self._prefill(prefixes, prefixes.shape[1] + max_new_tokens)
        for t in range(max_new_tokens):
            logp = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            live = ~done
            tokens[live, t] = nxt[live]
            logprobs[live, t] = logp.gather(1, nxt[:, None]).squeeze(1)[live]
            lengths += live.long()
            done |= nxt == EOS
            if bool(done.all()) or t + 1 == max_new_tokens:
                done[:] = True
                break
            if interrupt is not None and interrupt():
                break
            logits = self._decode(nxt, state)
        return Generation(tokens, logprobs, lengths, done)
