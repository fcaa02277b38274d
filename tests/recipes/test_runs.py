"""The recipes end to end, as users run them: real clusters, real trainer and rollout worker
processes, the invariants read back from `steps.jsonl`, `run.json` and the cluster's status."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from recipes.channels import PROMPTS, ROLLOUT_TASK, STOP_KEY, TRAIN, WEIGHTS_KEY, RolloutStats, rollout_key
from recipes.colocated import run_colocated
from recipes.config import CONFIG_DIR, RecipeConfig, load
from recipes.report import RECORDS, load_steps
from recipes.rollout_worker import RolloutWorker
from tests.helpers import alive, descendants, eventually
from weight_sync import WeightPublisher

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
SMALL = ["trainer.ppo_mini_batch_size=8", "rollout.prompts_per_batch=4", "cluster.capacity=64MiB"]
"""Overrides that keep smoke runs small: 64 samples per step."""
STEP_FIELDS = {
    "step",
    "time_s",
    "samples",
    "reward_mean",
    "samples_per_s",
    "tokens_per_s",
    "trainer_idle",
    "rollout_idle",
    "version",
    "staleness",
    "weight_sync_s",
}


def _python(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, text=True, **popen)


def _lines(proc: subprocess.Popen, until: str, timeout: float) -> list[str]:
    """Lines of `proc`'s stdout up to and including the first that starts with `until`."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if line.startswith(until):
                return seen
    proc.kill()
    raise AssertionError(f"no line starting with {until!r} within {timeout}s; got {seen[-5:]}")


def check_run(run_dir: Path, cfg: RecipeConfig) -> dict:
    """The recipe's invariants for one finished run; returns its totals."""
    steps = load_steps(run_dir)
    totals = json.loads((run_dir / "run.json").read_text())
    assert [s["step"] for s in steps] == list(range(1, cfg.trainer.total_steps + 1))
    assert all(set(s) >= STEP_FIELDS for s in steps)
    assert [s["samples"] for s in steps] == [cfg.samples_per_step * s["step"] for s in steps]
    versions = [s["version"] for s in steps]
    assert versions == sorted(versions) and versions[-1] == totals["final_version"]
    if cfg.max_staleness is not None:  # the bound holds for every consumed sample
        assert max(int(k) for s in steps for k in s["staleness"]) <= cfg.max_staleness
    assert totals["duplicates"] == 0 and totals["consumed"] == totals["samples"] and totals["interrupted"] is False
    if cfg.mode == "async":  # every produced sample consumed once, dropped as stale, or left over
        assert totals["consumed"] + totals["dropped"] + totals["left"] == totals["produced"]
        assert [w["version"] for w in totals["rollout"]] == [totals["final_version"]] * cfg.rollout.workers
    return totals


def test_every_config_runs_through_the_experiment_runner(tmp_path):
    configs = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    _recipe("experiments", *configs, "--out", str(tmp_path), "trainer.total_steps=4", *SMALL, timeout=900)
    for name in configs:
        check_run(tmp_path / name, load([name], ["trainer.total_steps=4", *SMALL]))
    summary = (tmp_path / "summary.md").read_text()
    assert all(f"| {name} |" in summary for name in configs)
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    rows = {r["name"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    assert rows["sync"]["ratio"][0] == 1.0 and rows["sync"]["worst_staleness"] == 0


def _recipe(module: str, *args: str, timeout: float, cwd: Path = ROOT) -> str:
    """`python -m recipes.MODULE ARGS...` from `cwd`, which must succeed; its stdout."""
    run = subprocess.run(
        [sys.executable, "-m", f"recipes.{module}", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


def _fully_async(out: Path, overrides: list[str]) -> None:
    """`python -m recipes.experiments fully_async --out OUT OVERRIDES...`, which must succeed."""
    _recipe("experiments", "fully_async", "--out", str(out), *overrides, timeout=600)


def test_a_transformers_policy_trains_through_the_same_processes(tmp_path):
    """The `hf` engine behind the same interface: a locally built Qwen2, its weights published by
    the trainer and swapped into the worker's model in place, the run's invariants intact."""
    overrides = ["rollout.engine=hf", "model.family=qwen2", "trainer.total_steps=3", *SMALL]
    _fully_async(tmp_path, overrides)
    totals = check_run(tmp_path / "fully_async", load(["fully_async"], overrides))
    assert totals["final_version"] == 3


def test_partial_rollout_swaps_weights_mid_generation_and_records_the_span():
    """A new version arrives while a batch generates: it stops at the token boundary, applies
    the version, resumes under it, and the samples carry (first, last) version spans."""
    cfg = load(["fully_async"], SMALL)
    with tq.init(1, "64MiB") as cluster, tq.connect(cluster.address) as client:
        publisher = WeightPublisher(cluster.address, transport="shm")
        worker = RolloutWorker(cfg, cluster.address)
        try:
            weights = {k: v.clone() for k, v in worker.engine.weights().items()}
            publisher.publish(weights, version=0)
            worker._apply(0)
            for w in weights.values():
                w.add_(0.01)
            publisher.publish(weights, version=1)
            client.wait_version(1)
            worker.latest = 1  # what the `versions()` watcher does when version 1 is announced
            prompts = worker.task.prompts(4, torch.Generator().manual_seed(0))
            rollouts = worker._generate(prompts)
            assert worker.subscriber.version == 1
            assert torch.equal(worker.engine.weights()["head.bias"], weights["head.bias"])
            spans = dict((span, len(rows)) for rows, span in rollouts.by_span())
            assert set(spans) <= {(0, 0), (0, 1)} and spans.get((0, 1), 0) > 0
            for rows, span in rollouts.by_span():
                client.put(rollouts.select(rows), partition=TRAIN, policy_version=span)
            meta = client.get_meta(["responses"], rollouts.n, "check", TRAIN, timeout=10)
            assert sorted(meta.version_spans) == sorted(s for s, n in spans.items() for _ in range(n))
        finally:
            worker.subscriber.close()
            publisher.close()


def test_a_worker_whose_prompts_lease_ran_out_logs_the_late_ack_and_goes_on(caplog):
    """The generation outlives the prompts' lease and another worker leases them meanwhile: the
    ack raises `tq.LeaseExpiredError`, the worker counts it, logs it and takes its next batch."""
    cfg = load(["fully_async"], SMALL)
    n = cfg.rollout.prompts_per_batch
    with tq.init(1, "64MiB") as cluster, tq.connect(cluster.address) as other:
        publisher = WeightPublisher(cluster.address, transport="shm")
        worker = RolloutWorker(cfg, cluster.address)
        generate = worker._generate

        def generate_past_the_lease(prompts: torch.Tensor, *cancelled: Any):  # noqa: ANN202
            # what an expired lease does, without waiting for it: the prompts go back to the
            # pool (a nack naming no lease), and another worker leases them
            other.nack(msgspec.structs.replace(put, task=ROLLOUT_TASK, lease_id=0))
            assert len(other.get_meta(["prompts"], n, ROLLOUT_TASK, PROMPTS, timeout=5)) == n
            return generate(prompts, *cancelled)

        async def two_batches() -> list[bool]:
            client = await tq.connect_async(cluster.address)
            stop = asyncio.get_running_loop().create_future()
            try:
                late = await worker._batch(client, stop)
                worker._generate = generate
                return [late, await worker._batch(client, stop)]
            finally:
                await client.close()

        try:
            publisher.publish(dict(worker.engine.weights()), version=0)
            put = other.put(
                TensorDict({"prompts": worker.task.prompts(n, torch.Generator().manual_seed(0))}, [n]),
                partition=PROMPTS,
            )
            other.put(
                TensorDict({"prompts": worker.task.prompts(n, torch.Generator().manual_seed(1))}, [n]),
                partition=PROMPTS,
            )
            worker._generate = generate_past_the_lease
            with caplog.at_level(logging.WARNING, "recipes.rollout_worker"):
                assert asyncio.run(two_batches()) == [True, True]
        finally:
            worker.subscriber.close()
            publisher.close()
        assert worker.stats.late_acks == 1 and worker.stats.batches == 2
        assert [r.levelno for r in caplog.records] == [logging.WARNING] and "late ack" in caplog.text
        status = other.status()
        assert status["counters"]["samples_ack_refused"] == n
        assert status["partitions"][TRAIN]["samples"] == 2 * n * cfg.rollout.group_size


def test_a_worker_whose_apply_failed_tries_once_more_and_goes_on(monkeypatch, caplog):
    """The worker's first apply outlasts its lease while the trainer stages its next version in
    the only slot: the subscriber refuses to take the copies for version 0 (`WeightSyncError`,
    its version -1), and the worker, instead of ending, tries once more, which applies the
    newest version whole. It counts and logs the retry."""
    from weight_sync import receivers
    from weight_sync.protocol import Latest, RpcClient

    cfg = load(["fully_async"], SMALL)
    real = receivers.copy_each
    staged: list[int] = []

    def copies_outlasting_the_lease(dsts, srcs, non_blocking=False):  # noqa: ANN001, ANN202
        if not staged:
            staged.append(1)
            publisher.publish(dict(worker.engine.weights()), version=1)  # waits for the lease to expire
            # `publish` returns before version 1 is whole: until it is offered, the retry would be
            # offered version 0 and refused its lease, the only slot holding version 1 by then
            with contextlib.closing(RpcClient(publisher.endpoint, timeout=5.0)) as probe:
                eventually(lambda: probe.call(Latest(after=0, timeout=0.0)).version == 1, 30, "version 1 offered")
        return real(dsts, srcs, non_blocking=non_blocking)

    with tq.init(1, "64MiB") as cluster:
        publisher = WeightPublisher(cluster.address, transport="shm", slots=1, lease_timeout=0.5)
        worker = RolloutWorker(cfg, cluster.address)
        try:
            publisher.publish(dict(worker.engine.weights()), version=0)
            monkeypatch.setattr(receivers, "copy_each", copies_outlasting_the_lease)
            with caplog.at_level(logging.WARNING, "recipes.rollout_worker"):
                worker._apply(0)
        finally:
            worker.subscriber.close()
            publisher.close()
    assert staged and worker.stats.weight_retries == 1 and worker.stats.version == 1
    assert "trying again" in caplog.text and "staged again under it" in caplog.text


def test_a_worker_cancelled_mid_apply_closes_its_subscriber_after_the_apply(monkeypatch):
    """`run` is cancelled (as Ctrl-C does) while its first apply is under way: the worker closes
    its subscriber only after that apply, on the thread that applied (a subscriber is used from
    one thread at a time), and nothing there raises. The test records each subscriber call with
    its thread; the apply is held, once in `wait`, until the worker has closed its cluster
    client, which `run`'s cleanup does just before it closes the subscriber."""
    cfg = load(["fully_async"], SMALL)
    calls: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    cleaning_up = threading.Event()
    serial = threading.Lock()  # no real call overlaps another: a close beside a live wait could abort
    running: dict[str, Any] = {}

    def recorded(name: str, real: Callable[..., Any], first: Callable[[], None] = lambda: None) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                first()
                with serial:
                    try:
                        return real(*args, **kwargs)
                    finally:
                        calls.append((name, threading.current_thread().name))
            except BaseException as exc:
                errors.append(exc)
                raise

        return call

    def cancel_the_run_then_hold_until_cleanup() -> None:
        running["loop"].call_soon_threadsafe(running["run"].cancel)
        assert cleaning_up.wait(60), "the cancelled run did not close its cluster client"

    connect = tq.connect_async

    async def connect_observed(address: str) -> tq.AsyncClient:
        client = await connect(address)
        close = client.close

        async def close_observed() -> None:
            await close()
            cleaning_up.set()

        client.close = close_observed
        return client

    async def cancelled_mid_apply() -> None:
        running.update(loop=asyncio.get_running_loop(), run=asyncio.ensure_future(worker.run()))
        with pytest.raises(asyncio.CancelledError):
            await running["run"]

    with tq.init(1, "64MiB") as cluster, tq.connect(cluster.address) as trainer:
        publisher = WeightPublisher(cluster.address, transport="shm")
        worker = RolloutWorker(cfg, cluster.address)
        subscriber = worker.subscriber
        close_subscriber = subscriber.close
        try:
            publisher.publish(dict(worker.engine.weights()), version=0)
            trainer.announce(WEIGHTS_KEY, msgspec.msgpack.encode(0))
            monkeypatch.setattr(tq, "connect_async", connect_observed)
            monkeypatch.setattr(
                subscriber, "wait", recorded("wait", subscriber.wait, cancel_the_run_then_hold_until_cleanup)
            )
            monkeypatch.setattr(subscriber, "poll", recorded("poll", subscriber.poll))
            monkeypatch.setattr(subscriber, "close", recorded("close", subscriber.close))
            asyncio.run(cancelled_mid_apply())
        finally:
            close_subscriber()
            publisher.close()
    thread = calls[0][1]
    assert calls == [("wait", thread), ("poll", thread), ("close", thread)]
    assert thread != threading.main_thread().name and not errors
    assert worker.stats.version == 0  # the apply finished: the engine holds version 0


STOPPED_WITHIN = 10.0
"""Seconds a stopped rollout worker may take to leave (it takes about one; it took 120 s)."""


def test_a_worker_stopped_before_its_trainer_published_leaves_at_once(monkeypatch):
    """A signal reaches a worker whose trainer never published (`_until_signal` cancels `run`):
    it leaves at once, not once its first weight fetch gave up (`WEIGHT_TIMEOUT`, 120 s). The
    test cancels `run` once the worker, waiting for the weights, asked the cluster for the
    trainer's stop (it asks as soon as it waits)."""
    cfg = load(["fully_async"], SMALL)
    connect = tq.connect_async
    waiting = asyncio.Event()

    async def connect_observed(address: str) -> tq.AsyncClient:
        client = await connect(address)
        lookup = client.lookup

        async def lookup_observed(key: str, timeout: float = 30.0) -> bytes | None:
            if key == STOP_KEY:
                waiting.set()
            return await lookup(key, timeout=timeout)

        client.lookup = lookup_observed
        return client

    async def stopped_while_waiting_for_weights() -> None:
        run = asyncio.ensure_future(worker.run())
        await waiting.wait()
        run.cancel()
        await asyncio.wait({run}, timeout=STOPPED_WITHIN)
        assert run.cancelled(), f"the worker was still there {STOPPED_WITHIN:g} s after it was stopped"

    with tq.init(1, "64MiB") as cluster:
        worker = RolloutWorker(cfg, cluster.address)
        monkeypatch.setattr(tq, "connect_async", connect_observed)
        asyncio.run(stopped_while_waiting_for_weights())
    assert worker.stats.version == -1


def test_a_worker_stopped_mid_generation_stops_at_the_next_token_step():
    """`run` cancelled while a batch generates (a signal, `_until_signal`): the generation stops
    at its next token step instead of finishing the batch, and nothing of it is put. The test
    cancels the batch from inside the engine's second decode step and holds that step until the
    cancellation is through; then it counts the decode steps the generation took."""
    cfg = load(["fully_async"], SMALL)
    n = cfg.rollout.prompts_per_batch
    decoded: list[int] = []
    cancelled = threading.Event()
    running: dict[str, Any] = {}

    async def one_batch() -> None:
        client = await tq.connect_async(cluster.address)
        try:
            stop = asyncio.get_running_loop().create_future()  # the trainer's stop: never, here
            running.update(loop=asyncio.get_running_loop(), batch=asyncio.ensure_future(worker._batch(client, stop)))
            running["batch"].add_done_callback(lambda _: cancelled.set())
            with pytest.raises(asyncio.CancelledError):
                await running["batch"]
        finally:
            await client.close()

    with tq.init(1, "64MiB") as cluster, tq.connect(cluster.address) as client:
        publisher = WeightPublisher(cluster.address, transport="shm")
        worker = RolloutWorker(cfg, cluster.address)
        decode = worker.engine._decode

        def decode_observed(tokens: torch.Tensor, state: Any) -> torch.Tensor:
            decoded.append(len(tokens))
            if len(decoded) == 2:
                running["loop"].call_soon_threadsafe(running["batch"].cancel)
                assert cancelled.wait(60), "the batch was not cancelled"
            return decode(tokens, state)

        worker.engine._decode = decode_observed
        try:
            publisher.publish(dict(worker.engine.weights()), version=0)
            client.put(
                TensorDict({"prompts": worker.task.prompts(n, torch.Generator().manual_seed(0))}, [n]),
                partition=PROMPTS,
            )
            asyncio.run(one_batch())
            worker._thread.submit(lambda: None).result(timeout=60)  # the generation is over
        finally:
            worker.subscriber.close()
            publisher.close()
        assert len(decoded) == 2, f"{len(decoded)} decode steps, the last {len(decoded) - 2} after the cancel"
        assert worker.stats.batches == 0 and TRAIN not in client.status()["partitions"]


def test_a_rollout_worker_and_a_trainer_against_sluice_serve_make_a_run(tmp_path):
    cfg = load(["fully_async"], [*SMALL, "trainer.total_steps=5"])
    serve = _python(
        "-m",
        "transfer_queue.cli",
        "serve",
        "--units",
        "2",
        "--capacity",
        "64MiB",
        "--max-staleness",
        str(cfg.max_staleness),
        "--consumer-batch-size",
        str(cfg.staleness().consumer_batch_size),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = _lines(serve, "SLUICE_ADDRESS", 60)[-1].split()[1]
        overrides = [*SMALL, "trainer.total_steps=5", f"out_dir={tmp_path}"]
        worker = _python(
            "-m",
            "recipes.rollout_worker",
            "--address",
            address,
            "fully_async",
            *overrides,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        trainer = _python(
            "-m",
            "recipes.async_trainer",
            "--address",
            address,
            "fully_async",
            *overrides,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
        w_out, w_err = worker.communicate(timeout=120)
        assert worker.returncode == 0, w_err[-3000:]
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["step"] for r in records[:-1]] == [1, 2, 3, 4, 5] and "totals" in records[-1]
        totals = check_run(tmp_path, cfg)
        assert json.loads(w_out.splitlines()[-1])["version"] == totals["final_version"] == 5
        with tq.connect(address) as client:
            status = client.status()
        assert status["partitions"][TRAIN]["tasks"]["actor_update"]["consumed"] == 0  # consumed samples were cleared
        assert status["partitions"][PROMPTS]["sealed"]
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(30)


SLUICE = str(Path(sys.executable).with_name("sluice"))
"""The `sluice` command as installed beside this Python."""
FIRST_RUN = ["trainer.total_steps=4", "async_training.trigger_parameter_sync_step=1"]
"""The trainer's overrides in issue 19's first run; everything else is a default."""


def _first_run(*serve_flags: str) -> tuple[str, subprocess.Popen, subprocess.Popen, subprocess.Popen]:
    """Issue 19's first run as a user types it: `sluice serve --max-staleness 2` (plus
    `serve_flags`), a rollout worker and a trainer against the address it prints, no other flag."""
    serve = subprocess.Popen(
        [SLUICE, "serve", "--max-staleness", "2", *serve_flags],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    address = _lines(serve, "SLUICE_ADDRESS", 60)[-1].split()[1]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    worker = _python("-m", "recipes.rollout_worker", "--address", address, **pipes)
    trainer = _python("-m", "recipes.async_trainer", "--address", address, *FIRST_RUN, **pipes)
    return address, serve, worker, trainer


def _stop(*procs: subprocess.Popen) -> list[str]:
    """Stop `procs` (SIGINT, as Ctrl-C would) and return each one's remaining stderr."""
    errs = []
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            errs.append(proc.communicate(timeout=60)[1])
        except subprocess.TimeoutExpired:
            proc.kill()
            errs.append(proc.communicate()[1])
    return errs


def test_the_first_run_with_every_default_completes():
    """The serve default's consumer batch (64) is below the trainer's 256 samples per step: the
    budget grows to it (logged by serve, shown by status) instead of starving the trainer."""
    address, serve, worker, trainer = _first_run()
    try:
        out, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-3000:]
        w_out, w_err = worker.communicate(timeout=120)
        assert worker.returncode == 0, w_err[-3000:]
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["step"] for r in records[:-1]] == [1, 2, 3, 4]
        assert records[-1]["totals"]["final_version"] == 4 and records[-1]["totals"]["samples"] == 4 * 256
        assert json.loads(w_out.splitlines()[-1])["version"] == 4
        with tq.ControlClient(address) as reader:
            admission = reader.status()["admission"]
        assert admission["consumer_batch_size"] == 256 and admission["configured_consumer_batch_size"] == 64
        assert admission["grown_by"] == "task 'actor_update' on partition 'train' takes 256 samples per version"
    finally:
        (serve_err,) = _stop(serve)
    assert "consumer_batch_size 64 -> 256 (task 'actor_update' on partition 'train' takes 256 samples" in serve_err


@pytest.mark.slow
def test_a_pinned_budget_below_the_trainer_s_batch_fails_the_first_run_at_once():
    """Pinned at the default 64 per version, admission can never let in the trainer's 256: the
    trainer says so and how to fix it, at once rather than at its 120 s batch timeout, and the
    rollout worker it tells to stop exits cleanly."""
    _address, serve, worker, trainer = _first_run("--no-follow-consumers")
    try:
        _out, err = trainer.communicate(timeout=300)
        assert worker.wait(120) == 0
    finally:
        _stop(serve, worker)
    assert trainer.returncode == 1
    (line,) = [x for x in err.splitlines() if x.startswith("python -m recipes.async_trainer: ")]
    assert "UnsatisfiableError: get_meta(task='actor_update', partition='train', batch_size=256)" in line
    assert "pinned at consumer_batch_size=64" in line and "sluice serve --consumer-batch-size 256" in line
    assert "Traceback" not in err


def test_a_run_whose_prompts_run_out_fails_at_once():
    """Someone else takes most of the prompts: the rollout worker uses up the rest, seals the
    train partition, and the trainer's step, which can never fill, fails at once (not at its
    120 s batch timeout) naming the cause; the worker then stops cleanly."""
    serve = _python(
        "-m", "transfer_queue.cli", "serve", "--capacity", "64MiB", "--max-staleness", "2", stdout=subprocess.PIPE
    )
    address = _lines(serve, "SLUICE_ADDRESS", 60)[-1].split()[1]
    overrides = [*SMALL, "trainer.total_steps=2"]  # 64 samples per step from 8 prompts; 28 prompts fed
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    trainer = _python("-m", "recipes.async_trainer", "--address", address, *overrides, **pipes)
    worker = None
    try:
        with tq.connect(address) as thief:
            eventually(lambda: thief.status()["partitions"].get(PROMPTS, {}).get("sealed"), 120, "prompts fed")
            thief.ack(thief.get_meta(["prompts"], 24, ROLLOUT_TASK, PROMPTS, timeout=30))  # 4 prompts left
        worker = _python("-m", "recipes.rollout_worker", "--address", address, *overrides, **pipes)
        _out, err = trainer.communicate(timeout=300)
        assert worker.wait(120) == 0
    finally:
        _stop(serve, *([worker] if worker else []), trainer)
    assert trainer.returncode == 1, err[-3000:]
    (line,) = [x for x in err.splitlines() if x.startswith("python -m recipes.async_trainer: ")]
    assert "UnsatisfiableError: step 1 got 32 of its 64 samples" in line
    assert "used up all 28 prompts and sealed the train partition" in line and "another consumer" in line


def test_a_rollout_worker_killed_mid_generation_does_not_stop_the_run(tmp_path):
    overrides = [
        *SMALL,
        "trainer.total_steps=12",
        "rollout.workers=2",
        "cluster.lease_timeout=3",
        "cluster.grant_timeout=3",
        f"out_dir={tmp_path}",
    ]
    cfg = load(["fully_async"], overrides)
    with (
        tq.init(2, "64MiB", staleness=cfg.staleness(), lease_timeout=3, grant_timeout=3) as cluster,
        tq.connect(cluster.address) as client,
    ):
        workers = [
            _python(
                "-m",
                "recipes.rollout_worker",
                "--address",
                cluster.address,
                "--worker-id",
                str(i),
                "fully_async",
                *overrides,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for i in range(2)
        ]
        trainer = _python(
            "-m",
            "recipes.async_trainer",
            "--address",
            cluster.address,
            "fully_async",
            *overrides,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            _lines(trainer, '{"step": 2,', 300)
            assert client.lookup(rollout_key(1), timeout=60) is not None  # worker 1 is in its loop
            workers[1].kill()
            _out, err = trainer.communicate(timeout=300)
            assert trainer.returncode == 0, err[-3000:]
            assert workers[0].wait(120) == 0
        finally:
            for proc in (trainer, *workers):
                if proc.poll() is None:
                    proc.kill()
        steps = load_steps(tmp_path)
        totals = json.loads((tmp_path / "run.json").read_text())
        assert len(steps) == 12 and totals["duplicates"] == 0
        assert max(int(k) for s in steps for k in s["staleness"]) <= cfg.max_staleness
        assert [w["worker"] for w in totals["rollout"]] == [0]  # the dead worker never said goodbye
        survivor = msgspec.msgpack.decode(client.lookup(rollout_key(0, done=True)), type=RolloutStats)
        assert survivor.version == totals["final_version"] == 12
        admission = client.status()["admission"]
        assert admission["running"] == 0  # the dead worker's grant came back
        assert client.status()["partitions"][PROMPTS]["tasks"][ROLLOUT_TASK]["leased"] == 0


def test_make_demo_prints_the_reward_and_the_plot(tmp_path):
    """`--out` relative to the directory it runs in, not the repository's root its processes run in."""
    stdout = _recipe("demo", "--out", "out", "trainer.total_steps=8", *SMALL, timeout=300, cwd=tmp_path)
    reward = [line for line in stdout.splitlines() if line.startswith("reward ")]
    assert len(reward) == 1 and " -> " in reward[0]
    assert f"plot: {tmp_path / 'out' / 'compare.png'}" in stdout
    assert (tmp_path / "out" / "compare.png").exists() and "worst staleness consumed" in stdout


_RUNNER = """
import os, sys, time
from pathlib import Path
from recipes.experiments import _spawn
child = _spawn("http.server", ["--bind", "127.0.0.1", "0"], min(os.sched_getaffinity(0)), Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_the_experiment_runners_children_die_with_it(tmp_path):
    """A trainer or rollout worker the runner started, in a session of its own, ends when the
    runner is SIGKILLed (no `finally` of its runs), not when it notices its controller gone."""
    runner = _python("-c", _RUNNER, str(tmp_path / "child.log"), stdout=subprocess.PIPE)
    child = 0
    try:
        child = int(runner.stdout.readline())
        runner.kill()
        runner.wait()
        eventually(lambda: not alive(child), 10, "the runner's child gone")
    finally:
        runner.kill()
        if child and alive(child):
            os.kill(child, signal.SIGKILL)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("command", "sig", "to_group"),
    [("demo", signal.SIGINT, False), ("experiments", signal.SIGTERM, False), ("demo", signal.SIGINT, True)],
    ids=["SIGINT", "SIGTERM-runner", "Ctrl-C"],
)
def test_a_run_stops_on_a_signal_with_every_process_it_started_and_keeps_its_record(tmp_path, command, sig, to_group):
    """Started as a script's background job is (SIGINT ignored, so Python raises no
    KeyboardInterrupt of its own), the demo still stops on SIGINT, as the experiment runner on
    SIGTERM: mid-run, it stops its trainer, its rollout worker and its cluster's services, and
    ends by that signal (a shell reports 128 + its number). A terminal's Ctrl-C goes to the whole
    process group: the demo alone takes it and stops the others once, each cleanly (no error
    logged). The run leaves its record: the steps done in `steps.jsonl`, their totals in
    `run.json` marked `interrupted`, and the plot and summary of those steps."""
    args = ("fully_async",) if command == "experiments" else ()
    demo = _python(
        "-m",
        f"recipes.{command}",
        *args,
        "--out",
        str(tmp_path),
        "trainer.total_steps=5000",
        *SMALL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_ignore_sigint,
        start_new_session=to_group,
    )
    run_dir = tmp_path / "fully_async"
    started: list[int] = []
    try:
        eventually(
            lambda: (run_dir / "steps.jsonl").exists() and (run_dir / "steps.jsonl").read_text().count("\n") >= 2,
            180,
            "two steps recorded",
        )
        started = descendants(demo.pid)  # the controller, 2 storage units, the trainer, the rollout worker
        assert len(started) >= 5, started
        if to_group:
            os.killpg(demo.pid, sig)
        else:
            demo.send_signal(sig)
        out, err = demo.communicate(timeout=60)
        assert demo.returncode == -sig, err[-3000:]
        assert not [pid for pid in started if alive(pid)]
    finally:
        demo.kill()
        for pid in started:  # a failing run leaves nothing running on: the demo's services and workers too
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    steps = load_steps(run_dir)
    recorded = [s["step"] for s in steps]
    assert recorded == list(range(1, len(recorded) + 1)) and len(recorded) >= 2
    for log in ("trainer.log", "rollout-0.log"):
        text = (run_dir / log).read_text()
        assert "Error" not in text and "Traceback" not in text, text[-3000:]
    totals = json.loads((run_dir / "run.json").read_text())
    assert totals["interrupted"] is True and totals["samples"] == steps[-1]["samples"] == 64 * len(steps)
    # the totals of the steps finished: neither the time nor the samples of the step it stopped
    assert totals["wall_s"] == round(steps[-1]["time_s"], 3) and totals["consumed"] == totals["samples"]
    assert totals["final_version"] == steps[-1]["version"] and totals["duplicates"] == 0
    assert [w["worker"] for w in totals["rollout"]] == [0]  # its statistics as last announced
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG" and str(tmp_path / "compare.png") in out
    assert "| fully_async (interrupted) |" in (tmp_path / "summary.md").read_text()


def test_a_run_stopped_before_its_first_step_reports_none_of_an_earlier_run_s(tmp_path):
    """An earlier run's records in the same `--out` go when the demo starts: stopped while its
    trainer still loads, it ends by the signal with no steps to report, rather than printing
    and plotting the earlier run's as the steps done (its `run.json` said `interrupted` false)."""
    run_dir = tmp_path / "fully_async"
    run_dir.mkdir()
    for directory in (tmp_path, run_dir):
        for name in RECORDS:
            (directory / name).write_text('{"interrupted": false}\n')  # an earlier run's, in short
    demo = _python("-m", "recipes.demo", "--out", str(tmp_path), *SMALL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # once the trainer loads torch: its spawn is over (a signal inside the fork, in an
        # at-fork callback, is swallowed: docs/recipes.md), the demo reads its records
        eventually(lambda: _trainer_loading(demo.pid), 120, "the trainer loading torch")
        demo.send_signal(signal.SIGTERM)
        out, err = demo.communicate(timeout=60)
    finally:
        demo.kill()
    assert demo.returncode == -signal.SIGTERM, err[-3000:]
    assert "interrupted" not in out and "Traceback" not in err, out + err[-3000:]
    left = [path for directory in (tmp_path, run_dir) for path in map(directory.joinpath, RECORDS) if path.exists()]
    assert left == [], left


def _trainer_loading(pid: int) -> bool:
    """Whether a trainer that process `pid` started has mapped torch's library."""
    for child in descendants(pid):
        try:
            if b"recipes.async_trainer" in Path(f"/proc/{child}/cmdline").read_bytes():
                return "libtorch" in Path(f"/proc/{child}/maps").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def _loading_torch(pid: int) -> bool:
    """Whether process `pid` has mapped torch's library: its `import torch` is under way."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True  # gone already: let the test see how it ended


@pytest.mark.parametrize(
    "command",
    [
        ["demo", "--out", "{tmp}"],
        ["experiments", "fully_async", "--out", "{tmp}"],
        ["async_trainer", "--address", "tcp://127.0.0.1:9"],
        ["rollout_worker", "--address", "tcp://127.0.0.1:9"],
        ["dataflow_demo"],
    ],
    ids=lambda command: command[0],
)
def test_a_command_stops_at_once_on_a_signal_while_it_loads(tmp_path, command):
    """Started as a script's background job is (SIGINT inherited ignored), a command spends
    seconds loading torch before `main` installs its handlers: a SIGINT then ends it at once,
    by that signal, without a traceback and having started nothing. It used to be lost, and the
    demo ran on to its end."""
    module, *args = command
    proc = _python(
        "-m",
        f"recipes.{module}",
        *(a.format(tmp=tmp_path) for a in args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_ignore_sigint,
    )
    try:
        eventually(lambda: _loading_torch(proc.pid), 60, "torch loading")
        assert not descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and not out


def test_a_colocated_run_stopped_by_a_signal_keeps_the_totals_of_its_steps(tmp_path):
    """The co-located baseline runs in the runner's process: a signal mid-run (the `SystemExit`
    `tq.exit_on_signals` raises, here from the step callback) still leaves `run.json`, with the
    totals of the steps done and `interrupted` true (their wall time, not the time to the
    signal, which came 50 ms after step 2), and goes on to end the process."""
    cfg = load(["colocated_sync"], ["trainer.total_steps=50", *SMALL, f"out_dir={tmp_path}"])

    def signal_after_step_two(record: Any) -> None:
        if record.step == 2:
            time.sleep(0.05)  # not a wait: the time between the step's end and the signal
            raise SystemExit(128 + signal.SIGTERM)

    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit):
            run_colocated(cfg, signal_after_step_two)
    finally:
        torch.set_num_threads(threads)  # the run takes every core, as it does in its own process
    totals = json.loads((tmp_path / "run.json").read_text())
    assert totals["interrupted"] is True and totals["final_version"] == 2
    last = load_steps(tmp_path)[-1]
    assert totals["samples"] == totals["consumed"] == 2 * cfg.samples_per_step == last["samples"]
    assert totals["wall_s"] == round(last["time_s"], 3) and totals["samples_per_s"] == round(
        last["samples"] / last["time_s"], 3
    )


def test_the_device_key_runs_the_recipe_through_the_device_paths(tmp_path):
    """`model.device=cpu`, named, goes through the code `model.device=cuda` takes: the trainer
    reads batches with `get_data(device=)`, the worker reads prompts and generates on the
    engine's device and puts from it, weights flow over the transport the config chooses."""
    overrides = ["model.device=cpu", "trainer.total_steps=3", *SMALL]
    _fully_async(tmp_path, overrides)
    cfg = load(["fully_async"], overrides)
    assert check_run(tmp_path / "fully_async", cfg)["final_version"] == 3
    assert "device: cpu" in (tmp_path / "fully_async" / "fully_async.yaml").read_text()


def _demo_on(device: str, tmp_path: Path, *overrides: str) -> str:
    """`make demo`'s command on `device`; its stdout, after checking the lines it prints."""
    stdout = _recipe("demo", "--out", str(tmp_path), f"model.device={device}", *overrides, timeout=600)
    assert len([line for line in stdout.splitlines() if line.startswith("reward ") and " -> " in line]) == 1
    assert "samples/s " in stdout and "worst staleness consumed" in stdout
    print(stdout)  # the reward and samples/s on the GPU, for the log
    return stdout


@pytest.mark.cuda
def test_fully_async_and_sync_runs_on_one_gpu(tmp_path):
    """Item 7 of the GPU issue: the demo, fully async and synchronous (one step off, η = 0), with
    the policy, the trainer and the engine on the GPU and the weights over cuda_ipc."""
    short = ["trainer.total_steps=20", *SMALL]
    _demo_on("cuda", tmp_path / "async", *short)
    _demo_on("cuda", tmp_path / "sync", *short, "name=sync", "max_staleness=0", "async_training.partial_rollout=false")
    cfg = load(["fully_async"], ["model.device=cuda", *short])
    assert cfg.publisher_transport == "cuda_ipc"
    for run_dir in (tmp_path / "async" / "fully_async", tmp_path / "sync" / "sync"):
        assert len(load_steps(run_dir)) == 20


@pytest.mark.slow
def test_fully_async_training_raises_the_reward(tmp_path):
    _recipe("demo", "--out", str(tmp_path), timeout=900)
    steps = load_steps(tmp_path / "fully_async")
    start = sum(s["reward_mean"] for s in steps[:10]) / 10
    end = sum(s["reward_mean"] for s in steps[-10:]) / 10
    assert end > start + 0.3, (start, end)
