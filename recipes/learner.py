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
    """The policy being trained (on `model.device`; batches must be there too), its optimizer,
    and the loss the config names."""

    def __init__(self, cfg: RecipeConfig):
        self.cfg = cfg
        self.model = build_policy(cfg).train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.trainer.lr)

    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """Proximal log-probs under the weights at the start of the step, then one optimizer
        update per mini-batch (`async_training.require_batches` of them, verl's unit); the
        statistics averaged over the updates."""
        cfg = self.cfg
        tokens = torch.cat([batch.prompts, batch.responses], dim=1)
        start = batch.prompts.shape[1] - 1
        mask = torch.arange(batch.responses.shape[1], device=tokens.device)[None, :] < batch.lengths[:, None]
        temperature = cfg.rollout.temperature
        updates = torch.arange(len(batch), device=tokens.device).chunk(cfg.async_training.require_batches)
        proximal = None
        if len(updates) > 1:
            with torch.no_grad():
                proximal = token_logprobs(
                    sequence_logits(self.model, tokens)[:, start:-1], batch.responses, temperature
                )
        advantages = group_advantages(batch.rewards, cfg.rollout.group_size)
        totals: dict[str, float] = {}
        for rows in updates:  # whole groups: mini-batches are multiples of the group size
            logprobs = token_logprobs(
                sequence_logits(self.model, tokens[rows])[:, start:-1], batch.responses[rows], temperature
            )
            # one update: the weights at the start of the step are the ones being differentiated
            prox = logprobs.detach() if proximal is None else proximal[rows]
            loss, stats = policy_loss(
                LossInputs(logprobs, batch.behaviour[rows], prox, advantages[rows], mask[rows]),
                cfg.trainer.loss,
                cfg.trainer.clip_eps,
                cfg.trainer.behaviour_weight_cap,
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            for key, value in {"loss": float(loss.detach()), **stats}.items():
                totals[key] = totals.get(key, 0.0) + value / len(updates)
        return totals
