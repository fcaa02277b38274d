"""GRPO advantages and the two policy losses."""

from __future__ import annotations

import pytest
import torch

from recipes.grpo import LossInputs, group_advantages, policy_loss


def test_advantages_are_normalised_within_each_group():
    rewards = torch.tensor([0.0, 1.0, 0.0, 1.0, 5.0, 5.0, 5.0, 7.0])
    adv = group_advantages(rewards, 4).view(2, 4)
    assert torch.allclose(adv.mean(1), torch.zeros(2), atol=1e-6)
    assert adv[0, 1] > 0 > adv[0, 0] and adv[1, 3] > 0 > adv[1, 0]


def _inputs(stale_shift: float) -> LossInputs:
    torch.manual_seed(0)
    proximal = -torch.rand(4, 6)
    return LossInputs(
        logprobs=proximal.clone().requires_grad_(True),
        behaviour=proximal - stale_shift,
        proximal=proximal,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        mask=torch.ones(4, 6, dtype=torch.bool),
    )


def test_on_policy_the_two_losses_agree():
    a, b = _inputs(0.0), _inputs(0.0)
    loss_a, stats = policy_loss(a, "decoupled", 0.2, 5.0)
    loss_b, _ = policy_loss(b, "ppo", 0.2, 5.0)
    assert torch.allclose(loss_a, loss_b) and stats["behaviour_weight"] == 1.0
    loss_a.backward(), loss_b.backward()
    assert torch.allclose(a.logprobs.grad, b.logprobs.grad)


def test_on_stale_data_plain_ppo_clips_every_token_while_the_decoupled_loss_still_learns():
    """Behaviour log-probs 1 nat below the current policy: plain PPO's ratio e^1 is outside the
    clip for positive advantages and its gradient vanishes there; the decoupled loss clips against
    the proximal policy and keeps a (capped) gradient."""
    ppo, dec = _inputs(1.0), _inputs(1.0)
    loss_ppo, ppo_stats = policy_loss(ppo, "ppo", 0.2, 1.0)
    loss_dec, dec_stats = policy_loss(dec, "decoupled", 0.2, 1.0)
    loss_ppo.backward(), loss_dec.backward()
    positive = torch.tensor([True, False, True, False])
    assert ppo_stats["clip_frac"] == 1.0 and dec_stats["clip_frac"] == 0.0
    assert bool((ppo.logprobs.grad[positive] == 0).all())
    assert bool((dec.logprobs.grad[positive] != 0).all())
    assert dec_stats["behaviour_weight"] == 1.0  # pi_prox / pi_behaviour = e, truncated at the cap


def test_the_behaviour_weight_is_truncated_at_the_cap():
    _, stats = policy_loss(_inputs(1.0), "decoupled", 0.2, 5.0)
    assert stats["behaviour_weight"] == pytest.approx(torch.exp(torch.tensor(1.0)).item())
    _, stats = policy_loss(_inputs(-1.0), "decoupled", 0.2, 1.0)  # the policy moved away: weight 1/e
    assert stats["behaviour_weight"] == pytest.approx(torch.exp(torch.tensor(-1.0)).item())
