"""vLLM's offline `LLM` behind the engine interface, with weights swapped in place.

The engine saves the run's initial Qwen2 (`build_policy(cfg)`, the same config and seed the
trainer builds; nothing is downloaded) to a temporary directory and starts `vllm.LLM` on it
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so vLLM's own parameters live in the
rollout worker's memory. `weights()` returns views of them under Hugging Face names (each
`q_proj`/`k_proj`/`v_proj` is a row block of vLLM's fused `qkv_proj`, `gate_proj`/`up_proj`
of `gate_up_proj`, as `weight_sync.QWEN` binds them): a `WeightSubscriber` copies a published
version straight into vLLM's tensors, with no staging copy and nothing pickled.
`vllm_weights()` gives the same tensors under vLLM's fused names, for a subscriber with
`mapping=QWEN`.

Why a worker-side callable rather than `reload_weights`/`load_weights`: vLLM's CPU backend
packs every linear layer for oneDNN (or sgl-kernel) after loading and drops the plain weight,
so the stock reload routes fail on CPU. At start, `LLM.collective_rpc` runs `_keep_weights`
in the worker: it gives every packed layer its plain weight back (from the initial state
dict) and re-packs keeping it. After a new version was copied in, `weights_applied()` runs
`_repack` (vLLM's `dispatch_cpu_unquantized_gemm` on every packed layer). Prefix caching is
off, so no KV block computed under old weights is reused.

Interrupt granularity: one token. `generate` drives `LLMEngine.step()` itself (one decode
step per call for every running row) and checks `interrupt()` after each step; on True it
aborts the rows still running and returns them with `finished=False`, cut to the tokens
every unfinished row has (the rows stay aligned, as the rollout worker requires). Without
`interrupt` it is one `LLM.generate` call; the rollout worker always passes one (a stop ends its
batch at the next step).

Side effects of running vLLM in this process: it seeds the process's global RNGs with
`cfg.seed`, and its CPU worker replaces `torch.set_num_threads` by a no-op (set threads
before building the engine, as the rollout worker does).

Limits: vLLM's CPU attention supports head sizes 32, 64, 80, ... (`d_model / heads`; the
recipe's default Qwen2, d_model 64 with 4 heads, has 16: use `model.heads=2`), and the
unpacked copy of every linear weight is kept beside the packed one (twice the memory of
the linear layers; fine for the tiny policies here).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from weight_sync import QWEN, TPShard

from ..config import RecipeConfig
from ..policy import MAX_POSITIONS, build_policy
from ..task import EOS, PAD
from .base import Engine, Generation

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams

__all__ = ["VllmEngine", "CPU_HEAD_SIZES"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM 0.32's CPU attention backend runs (`CPUAttentionBackend`)."""


class VllmEngine(Engine):
    """vLLM's `LLM` on the run's tiny Qwen2, in this process; see the module docstring.

    Raises `ValueError` for a model vLLM's CPU backend cannot run here (not `qwen2`, or an
    unsupported head size), `RuntimeError` if vLLM's worker runs in another process
    (then its tensors could not be updated in place), and `ImportError` without vLLM.
    """

    name = "vllm"
    temperature: float
    """Sampling temperature of the next `generate` calls (0: greedy); default `rollout.temperature`."""

    def __init__(self, cfg: RecipeConfig, temperature: float | None = None, kv_cache_bytes: int = 64 << 20):
        m = cfg.model
        if m.family != "qwen2":
            raise ValueError(f"the vllm engine runs model.family=qwen2, not {m.family!r}")
        if m.d_model % m.heads or m.d_model // m.heads not in CPU_HEAD_SIZES:
            raise ValueError(
                f"vLLM's CPU attention has no kernel for head size {m.d_model / m.heads:g} "
                f"(model.d_model={m.d_model}, model.heads={m.heads}); it supports {CPU_HEAD_SIZES}, e.g. model.heads=2"
            )
        self.temperature = cfg.rollout.temperature if temperature is None else temperature
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker, and its tensors, in this process
        from vllm import LLM

        policy = build_policy(cfg)
        initial = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self._dir = tempfile.TemporaryDirectory(prefix="sluice-vllm-")
        policy.save_pretrained(self._dir.name)
        del policy
        self.llm: LLM = LLM(
            model=self._dir.name,
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_POSITIONS,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",  # log-probs of the distribution sampled from
            enable_prefix_caching=False,
            kv_cache_memory_bytes=kv_cache_bytes,
        )
        pid, fused = self.llm.collective_rpc(_keep_weights, args=(initial,))[0]
        if pid != os.getpid():
            raise RuntimeError(
                "vLLM's worker runs in another process; the engine needs VLLM_ENABLE_V1_MULTIPROCESSING=0"
            )
        self._fused: dict[str, torch.Tensor] = fused
        shapes = {name: tuple(t.shape) for name, t in initial.items()}
        self._views = {b.source: b.view for b in QWEN.bind(shapes, fused, TPShard())}
        self._ids = itertools.count()

    def weights(self) -> Mapping[str, torch.Tensor]:
        """Views of vLLM's parameters under Hugging Face names (what the trainer publishes)."""
        return self._views

    def vllm_weights(self) -> Mapping[str, torch.Tensor]:
        """The same parameters under vLLM's fused names (a subscriber with `mapping=QWEN`)."""
        return self._fused

    def weights_applied(self) -> None:
        """Re-pack the CPU kernels from the updated weights (~ms for the tiny policy)."""
        self.llm.collective_rpc(_repack)

    def generate(
        self,
        prefixes: torch.Tensor,
        max_new_tokens: int,
        generator: torch.Generator,
        interrupt: Callable[[], bool] | None = None,
    ) -> Generation:
        """Sample up to `max_new_tokens` after each row; see the module docstring for `interrupt`.

        Each row gets its own sampling seed drawn from `generator`, so a run is reproducible.
        """
        b = prefixes.shape[0]
        seeds = torch.randint(0, 2**31 - 1, (b,), generator=generator).tolist()
        prompts: list[Any] = [{"prompt_token_ids": row} for row in prefixes.tolist()]
        params = [self._params(max_new_tokens, s, stream=interrupt is not None) for s in seeds]
        if interrupt is None:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            rows = [(list(o.outputs[0].token_ids), _logprobs(o.outputs[0]), True) for o in outs]
        else:
            rows = self._stepped(prompts, params, interrupt)
        return _generation(rows, max_new_tokens)

    def _params(self, max_tokens: int, seed: int, stream: bool) -> SamplingParams:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            seed=seed,
            logprobs=0,  # the sampled token's own log-prob
            stop_token_ids=[EOS],
            detokenize=False,
            output_kind=RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY,
        )

    def _stepped(
        self, prompts: list[Any], params: list[SamplingParams], interrupt: Callable[[], bool]
    ) -> list[tuple[list[int], list[float], bool]]:
        """Drive the engine one step at a time, stopping at the first step `interrupt` is True."""
        from vllm.inputs import tokens_input

        engine = self.llm.llm_engine
        ids = [f"sluice-{next(self._ids)}" for _ in prompts]
        wanted = set(ids)
        latest: dict[str, Any] = {}
        for rid, prompt, p in zip(ids, prompts, params):
            engine.add_request(rid, tokens_input(prompt["prompt_token_ids"]), p)  # rendered: token ids as they are
        try:
            while len(latest) < len(ids) or not all(o.finished for o in latest.values()):
                for out in engine.step():
                    if out.request_id in wanted:  # not a row an earlier call aborted
                        latest[out.request_id] = out
                if len(latest) == len(ids) and interrupt():
                    break
        finally:
            running = [rid for rid in ids if rid not in latest or not latest[rid].finished]
            if running:
                engine.abort_request(running)
        rows = []
        for rid in ids:
            c = latest[rid].outputs[0] if rid in latest and latest[rid].outputs else None
            tokens, lps = (list(c.token_ids), _logprobs(c)) if c is not None else ([], [])
            rows.append((tokens, lps, rid in latest and latest[rid].finished))
        cut = min((len(t) for t, _, done in rows if not done), default=None)
        if cut is not None:  # unfinished rows keep the tokens all of them have
            rows = [(t, lp, True) if done else (t[:cut], lp[:cut], False) for t, lp, done in rows]
        return rows


def _logprobs(completion: Any) -> list[float]:
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def _generation(rows: list[tuple[list[int], list[float], bool]], width: int) -> Generation:
    b = len(rows)
    n = max((len(t) for t, _, _ in rows), default=0)
    tokens = torch.full((b, n), PAD, dtype=torch.long)
    logprobs = torch.zeros((b, n), dtype=torch.float32)
    lengths = torch.zeros(b, dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    for i, (t, lp, done) in enumerate(rows):
        tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        logprobs[i, : len(lp)] = torch.tensor(lp, dtype=torch.float32)
        lengths[i] = len(t)
        finished[i] = done or len(t) >= width
    return Generation(tokens, logprobs, lengths, finished)


# -- run inside vLLM's worker through LLM.collective_rpc (here: in this process) -------------


def _packed_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Layers vLLM's CPU backend runs through a packed GEMM (`cpu_linear`), by prefix."""
    return {name: mod for name, mod in model.named_modules() if hasattr(mod, "cpu_linear") and hasattr(mod, "weight")}


def _keep_weights(worker: Any, initial: Mapping[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
    """Give each packed layer its plain weight back (from `initial`, HF names) and re-pack it
    keeping the weight. Returns this process's id and vLLM's parameters by name, the
    vocab-padded ones cut to the real vocabulary."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    model = worker.model_runner.model
    packed = _packed_layers(model)
    shapes = {name: tuple(t.shape) for name, t in initial.items()}
    for prefix, layer in packed.items():
        if layer.weight.numel() == 0:  # packed and dropped: rebuild it at its fused shape
            name = f"{prefix}.weight"
            fused = _fused_shape(name, shapes)
            layer.weight = torch.nn.Parameter(torch.zeros(fused, dtype=layer.weight.dtype), requires_grad=False)
    params = dict(model.named_parameters())
    targets = {
        name: p.data[: shapes[name][0]] if name in shapes and p.shape[0] > shapes[name][0] else p.data
        for name, p in params.items()
    }
    with torch.no_grad():
        for b in QWEN.bind(shapes, targets, TPShard()):
            b.view.copy_(initial[b.source])
    for layer in packed.values():
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    return os.getpid(), targets


def _fused_shape(name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            blocks = [shapes[name.replace(fused, p)] for p in parts]
            return (sum(s[0] for s in blocks), *blocks[0][1:])
    return shapes[name]


def _repack(worker: Any) -> None:
    """Re-run the CPU backend's packing of every packed layer from its (updated) weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for layer in _packed_layers(worker.model_runner.model).values():
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
