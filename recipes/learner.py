"""One GRPO optimizer step on a batch of scored rollouts, whoever brought them.

The async trainer feeds it batches streamed from Sluice; the co-located baseline feeds it what
it just generated. Rows must come in whole groups, `group_size` consecutive rows per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import RecipeConfig
from .grpo import LossInputs, group_advantages, policy_loss
from .policy import build_policy, sequence_logits, token_logprobs

__all__ = ["Learner", "RolloutBatch"]


@dataclass
class RolloutBatch:
    prompts: torch.Tensor
    """int64 [b, prompt_len]."""
    responses: torch.Tensor
    """int64 [b, w], PAD after each response."""
    behaviour: torch.Tensor
    """float32 [b, w]: the rollout engine's log-probs of the response tokens."""
    rewards: torch.Tensor
    lengths: torch.Tensor
    """int64 [b]: response tokens per row."""

    def __len__(self) -> int:
        return len(self.rewards)


class Learner:
    """The policy being trained, its optimizer, and the loss the config names."""

    def __init__(self, cfg: RecipeConfig):
        self.cfg = cfg
        self.model = build_policy(cfg).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.trainer.lr)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Proximal log-probs under the current weights, then one step on the loss; statistics."""
        t = self.cfg.trainer
        tokens = torch.cat([batch.prompts, batch.responses], dim=1)
        start = batch.prompts.shape[1] - 1
        mask = torch.arange(batch.responses.shape[1])[None, :] < batch.lengths[:, None]
        temperature = self.cfg.rollout.temperature
        with torch.no_grad():
            proximal = token_logprobs(sequence_logits(self.model, tokens)[:, start:-1], batch.responses, temperature)
        logprobs = token_logprobs(sequence_logits(self.model, tokens)[:, start:-1], batch.responses, temperature)
        advantages = group_advantages(batch.rewards, self.cfg.rollout.group_size)
        loss, stats = policy_loss(
            LossInputs(logprobs, batch.behaviour, proximal, advantages, mask), t.loss, t.clip_eps, t.behaviour_weight_cap
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach()), **stats}
