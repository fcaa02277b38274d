"""The policies the recipes train: a tiny causal transformer in plain torch, or a small Qwen2.

`TinyTransformer` is built here from a few numbers (nothing downloaded): pre-norm blocks,
learned positions, and a preallocated KV cache for generation. `build_policy` also builds a
randomly initialised `transformers` Qwen2 from a local config, for the `hf` and `vllm` engines.
Both give next-token logits for a whole sequence through `sequence_logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import RecipeConfig
from .task import VOCAB

__all__ = ["KVCache", "TinyTransformer", "build_policy", "param_count", "sequence_logits", "token_logprobs"]

MAX_POSITIONS = 64


class KVCache:
    """Keys and values of every layer for a batch, preallocated to `max_len` positions."""

    def __init__(
        self,
        layers: int,
        batch: int,
        heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ):
        shape = (batch, heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.length = 0


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is None:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = cache.length
            cache.keys[layer][:, :, start : start + t] = k
            cache.values[layer][:, :, start : start + t] = v
            keys = cache.keys[layer][:, :, : start + t]
            values = cache.values[layer][:, :, : start + t]
            # a prefill attends causally; one decoded token attends to everything cached
            att = F.scaled_dot_product_attention(q, keys, values, is_causal=t > 1)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """A causal transformer language model over the task's 13-token vocabulary."""

    def __init__(self, d_model: int = 64, layers: int = 2, heads: int = 4, vocab: int = VOCAB):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads = heads
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(MAX_POSITIONS, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        d, w = self.embed.embedding_dim, self.embed.weight
        return KVCache(len(self.blocks), batch, self.heads, d // self.heads, max_len, w.dtype, w.device)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits [b, t, vocab]; with `cache`, `tokens` continue the cached positions."""
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, cache, layer)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.head(self.norm(x))


def build_policy(cfg: RecipeConfig) -> nn.Module:
    """The run's policy, initialised from `cfg.seed` on the CPU (trainer and workers build the
    same one, whatever their device) and moved to `model.device`."""
    torch.manual_seed(cfg.seed)
    return _build(cfg).to(cfg.device)


def _build(cfg: RecipeConfig) -> nn.Module:
    m = cfg.model
    if m.family == "tiny":
        return TinyTransformer(m.d_model, m.layers, m.heads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=m.d_model,
        intermediate_size=4 * m.d_model,
        num_hidden_layers=m.layers,
        num_attention_heads=m.heads,
        num_key_value_heads=max(1, m.heads // 2),
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = None
    return model


def sequence_logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token logits [b, t, vocab] for whole sequences, for either family."""
    if isinstance(model, TinyTransformer):
        return model(tokens)
    return model(input_ids=tokens, use_cache=False).logits


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each of `tokens` [b, t] under `logits` [b, t, vocab]."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
