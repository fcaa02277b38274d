"""The synthetic task: reverse a string of digits, with a verifiable, dense reward.

A prompt is `max_digits` tokens, the digits left-padded with PAD, then SEP; the answer is the
digits reversed, then EOS. Prompts all have the same length (batched generation needs no
attention mask), while answers are as long as the digits: 2-9 tokens by default, so a batch's
generation has a tail, as real rollouts do. The reward is the fraction of answer positions
(EOS included) the response gets right, over the longer of answer and response, so a policy
that learns the task, and stops where it should, earns 1.0.
"""

from __future__ import annotations

import torch

from .config import TaskConfig

__all__ = ["EOS", "PAD", "SEP", "VOCAB", "DigitReversal"]

SEP, EOS, PAD = 10, 11, 12
VOCAB = 13


class DigitReversal:
    """Prompts and rewards for digit reversal with `min_digits`..`max_digits` digits."""

    def __init__(self, cfg: TaskConfig):
        self.min_digits, self.max_digits = cfg.min_digits, cfg.max_digits

    @property
    def prompt_len(self) -> int:
        return self.max_digits + 1

    @property
    def max_new_tokens(self) -> int:
        return self.max_digits + 1

    def prompts(self, n: int, generator: torch.Generator) -> torch.Tensor:
        """`n` prompts, int64 [n, prompt_len]."""
        lengths = torch.randint(self.min_digits, self.max_digits + 1, (n,), generator=generator)
        digits = torch.randint(0, 10, (n, self.max_digits), generator=generator)
        pad = torch.arange(self.max_digits).expand(n, -1) < (self.max_digits - lengths)[:, None]
        body = digits.masked_fill(pad, PAD)
        return torch.cat([body, torch.full((n, 1), SEP)], dim=1)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """The right answers, int64 [n, max_new_tokens], PAD after EOS."""
        body = prompts[:, : self.max_digits]  # digits right-aligned after the PADs: flipped, they lead
        out = torch.full((len(prompts), self.max_new_tokens), PAD, dtype=torch.long, device=prompts.device)
        out[:, : self.max_digits] = body.flip(1)
        out[torch.arange(len(prompts), device=prompts.device), (body != PAD).sum(1)] = EOS
        return out

    def rewards(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Positions right over the longer of answer and response, float32 [n]: a response that
        runs past the answer's EOS is diluted. `responses` is [n, t], PAD after each response."""
        target = self.targets(prompts)
        width = min(responses.shape[1], target.shape[1])
        answer = target != PAD
        right = (responses[:, :width] == target[:, :width]) & answer[:, :width]
        longer = torch.maximum(answer.sum(1), (responses != PAD).sum(1))
        return (right.sum(1).float() / longer.float()).to(torch.float32)
