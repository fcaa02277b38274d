"""The task, the policies and the generation engines, in one process."""

from __future__ import annotations

import pytest
import torch

from recipes.config import load
from recipes.engines import make_engine
from recipes.policy import build_policy, sequence_logits, token_logprobs
from recipes.task import EOS, PAD, SEP, DigitReversal


@pytest.fixture
def task():
    return DigitReversal(load(["sync"]).task)


def test_prompts_have_one_length_and_answers_vary(task):
    prompts = task.prompts(256, torch.Generator().manual_seed(0))
    assert prompts.shape == (256, task.prompt_len) and bool((prompts[:, -1] == SEP).all())
    answer_lengths = (task.targets(prompts) != PAD).sum(1)
    assert answer_lengths.min() == task.min_digits + 1 and answer_lengths.max() == task.max_digits + 1


def test_reward_is_one_for_the_answer_and_diluted_by_running_on(task):
    prompts = task.prompts(16, torch.Generator().manual_seed(1))
    target = task.targets(prompts)
    assert torch.equal(task.rewards(prompts, target), torch.ones(16))
    digits = torch.tensor([[PAD] * (task.max_digits - 3) + [1, 2, 3, SEP]])
    right_then_more = torch.tensor([[3, 2, 1, 7, 7, 7, 7, 7, EOS]])  # no EOS where it belongs
    assert task.rewards(digits, right_then_more).item() == pytest.approx(3 / 9)
    assert task.rewards(digits, torch.tensor([[3, 2, 1, EOS] + [PAD] * 5])).item() == 1.0


@pytest.mark.parametrize("overrides", [[], ["rollout.engine=hf", "model.family=qwen2"]], ids=["torch", "hf"])
def test_behaviour_logprobs_match_what_the_trainer_computes(task, overrides):
    """KV-cache sampling records the same log-probs a full forward gives: on-policy samples have
    importance weight 1, so any drift would bias every step."""
    cfg = load(["sync"], overrides)
    engine = make_engine(cfg)
    prompts = task.prompts(8, torch.Generator().manual_seed(2))
    gen = engine.generate(prompts, task.max_new_tokens, torch.Generator().manual_seed(3))
    assert bool(gen.finished.all())
    model = build_policy(cfg)
    tokens = torch.cat([prompts, gen.tokens], dim=1)
    with torch.no_grad():
        full = token_logprobs(sequence_logits(model, tokens)[:, prompts.shape[1] - 1 : -1], gen.tokens)
    mask = torch.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
    assert torch.allclose(full[mask], gen.logprobs[mask], atol=1e-4)
    assert bool((gen.tokens[~mask] == PAD).all())


def test_interrupt_stops_at_a_token_boundary_and_generation_resumes(task):
    cfg = load(["fully_async"])
    engine = make_engine(cfg)
    prompts = task.prompts(4, torch.Generator().manual_seed(4))
    calls = []

    def interrupt() -> bool:
        calls.append(1)
        return len(calls) == 2  # after the second token

    gen = engine.generate(prompts, task.max_new_tokens, torch.Generator().manual_seed(5), interrupt)
    live = ~gen.finished
    assert bool(live.any()) and bool((gen.lengths[live] == 2).all())
    rest = engine.generate(
        torch.cat([prompts[live], gen.tokens[live, :2]], 1), task.max_new_tokens - 2, torch.Generator().manual_seed(6)
    )
    assert bool(rest.finished.all()) and bool((rest.lengths <= task.max_new_tokens - 2).all())
