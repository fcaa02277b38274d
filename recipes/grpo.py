"""GRPO advantages and the policy losses: AReaL's decoupled PPO and plain PPO.

Both are token-level and masked to response tokens. With rollouts from older weights, plain
PPO's ratio pi_theta / pi_behaviour drifts far from 1 and its clip zeroes the gradient; the
decoupled loss (Fu et al., AReaL, 2025) clips against the proximal policy (the trainer's weights
at the start of the step) and corrects for the behaviour policy with an importance weight
pi_prox / pi_behaviour instead, truncated at `weight_cap` (1.0 by default: V-trace's rho-bar,
which never amplifies a stale token; AReaL masks tokens above 5, which on the digit task
destabilised 2 of 3 seeds at 2 versions of lag).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossInputs", "group_advantages", "policy_loss"]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Rewards normalised within each consecutive group of `group_size` samples."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True)
    return ((grouped - mean) / (std + eps)).view(-1)


@dataclass
class LossInputs:
    logprobs: torch.Tensor
    """[b, t] under the weights being trained (with grad)."""
    behaviour: torch.Tensor
    """[b, t] recorded by the rollout engine when it sampled."""
    proximal: torch.Tensor
    """[b, t] under the trainer's weights at the start of the step (no grad)."""
    advantages: torch.Tensor
    """[b] one per sample, broadcast over its tokens."""
    mask: torch.Tensor
    """[b, t] True on response tokens."""


def policy_loss(x: LossInputs, kind: str, clip_eps: float, weight_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-mean loss and statistics (`clip_frac`, `behaviour_weight` mean)."""
    adv = x.advantages[:, None]
    anchor = x.proximal if kind == "decoupled" else x.behaviour
    ratio = torch.exp(x.logprobs - anchor)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    surrogate = -torch.minimum(ratio * adv, clipped * adv)
    weight = torch.ones_like(ratio)
    if kind == "decoupled":
        weight = torch.exp(x.proximal - x.behaviour).clamp(max=weight_cap)
        surrogate = surrogate * weight
    mask = x.mask.float()
    tokens = mask.sum().clamp(min=1)
    loss = (surrogate * mask).sum() / tokens
    with torch.no_grad():
        clip_frac = (((ratio - clipped).abs() > 0).float() * mask).sum() / tokens
        stats = {"clip_frac": float(clip_frac), "behaviour_weight": float((weight * mask).sum() / tokens)}
    return loss, stats
