"""The async trainer loop: stream whole GRPO groups, correct for staleness, publish weights.

Each step takes `require_batches` mini-batches of whole groups (`grpo_group` sampler) that are
no staler than `max_staleness`, computes group advantages, recomputes the proximal log-probs
under the current weights, takes one optimizer step on the decoupled (or plain) PPO loss, acks
and clears the samples, and every `trigger_parameter_sync_step` steps publishes the weights as
a new version through `weight_sync`. It also feeds the prompt partition for the whole run, tells
the rollout workers when its first weights are published (`WEIGHTS_KEY`) and, when done, to
stop (`STOP_KEY`, holding the final version). A step
the workers can no longer fill (they used up the prompts and sealed the train partition) ends
the run at once with `tq.UnsatisfiableError` naming the likely cause.

Run on its own against `sluice serve` (a rollout worker started the same way completes it):

    python -m recipes.async_trainer --address tcp://127.0.0.1:41000 [CONFIG.yaml] [key=value ...]

Every step prints one JSON object (the `steps.jsonl` record) on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from transfer_queue.host import stop_while_loading

stop_while_loading(__name__)  # before the heavy imports

import msgspec  # noqa: E402
import torch  # noqa: E402

import transfer_queue as tq  # noqa: E402
from weight_sync import WeightPublisher  # noqa: E402

from . import config as config_mod  # noqa: E402
from .channels import (  # noqa: E402
    FIELDS,
    PROMPT_SLACK,
    PROMPTS,
    STOP_KEY,
    TRAIN,
    TRAIN_TASK,
    WEIGHTS_KEY,
    RolloutStats,
    rollout_key,
)
from .config import RecipeConfig  # noqa: E402
from .learner import Learner, RolloutBatch  # noqa: E402
from .records import RunLog, StepRecord  # noqa: E402
from .task import PAD, DigitReversal  # noqa: E402

__all__ = ["AsyncTrainer", "main"]


class AsyncTrainer:
    """The trainer side of an async GRPO run against the cluster at `address`."""

    def __init__(self, cfg: RecipeConfig, address: str):
        torch.set_num_threads(1)
        self.cfg = cfg
        self.task = DigitReversal(cfg.task)
        self.learner = Learner(cfg)
        self.client = tq.connect(address)
        # staging allocated (and registered with CUDA) now, not in the first publish
        self.publisher = WeightPublisher(address, transport=cfg.publisher_transport, model=self.learner.model)
        self.version = 0
        self.prompts_fed = 0
        self.consumed: set[int] = set()
        self.consumed_after: list[int] = []  # len(consumed) after each step: an interrupted run's totals are its last
        self.duplicates = 0
        self._rollout_seen: dict[int, RolloutStats] = {}

    def feed_prompts(self) -> None:
        """Put every prompt the run may need into the prompt partition, and seal it."""
        n = (
            int(self.cfg.trainer.total_steps * self.cfg.prompts_per_step * PROMPT_SLACK)
            + self.cfg.rollout.prompts_per_batch
        )
        gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        prompts = self.task.prompts(n, gen)
        for start in range(0, n, 1024):
            self.client.put({"prompts": prompts[start : start + 1024]}, partition=PROMPTS)
        self.client.seal(PROMPTS)
        self.prompts_fed = n

    def run(self, on_step: Callable[[StepRecord], None] | None = None) -> dict[str, Any]:
        """Train `trainer.total_steps` steps; returns the run's totals (also in `run.json`). A
        signal that stops it mid-way still leaves `run.json`, with the totals of the steps it
        finished, each worker's statistics as last announced, and `interrupted` true."""
        self.feed_prompts()
        self.publisher.publish(self.learner.model.state_dict(), version=self.version)
        self.client.announce(WEIGHTS_KEY, msgspec.msgpack.encode(self.version))
        start = time.perf_counter()
        samples = 0
        with RunLog(self.cfg.out_dir, on_step) as log:
            try:
                for step in range(1, self.cfg.trainer.total_steps + 1):
                    samples = log.write(self.step(step, start, samples)).samples
            except (KeyboardInterrupt, SystemExit):  # a signal (`tq.exit_on_signals`): keep what the steps made
                seen = [msgspec.to_builtins(stats) for stats in self._rollout_seen.values()]
                last = log.last  # the totals of the steps finished, not of the one stopped
                done = (
                    (last.time_s, last.samples, last.version, self.consumed_after[last.step - 1])
                    if last
                    else (0, 0, 0, 0)
                )
                log.finish({**self.totals(*done), "rollout": seen}, interrupted=True)
                raise
            finally:
                self.client.announce(STOP_KEY, msgspec.msgpack.encode(self.version))
            wall = time.perf_counter() - start
            workers = self._wait_for_workers()  # first: no put is in flight when totals are taken
            return log.finish({**self.totals(wall, samples, self.version, len(self.consumed)), "rollout": workers})

    def step(self, step: int, start: float, samples_before: int) -> StepRecord:
        cfg, at = self.cfg, self.cfg.async_training
        t0 = time.perf_counter()
        metas = [
            self.client.get_meta(
                FIELDS,
                cfg.trainer.ppo_mini_batch_size * cfg.rollout.group_size,
                TRAIN_TASK,
                TRAIN,
                sampler="grpo_group",
                group_size=cfg.rollout.group_size,
                max_staleness=cfg.max_staleness,
                timeout=cfg.trainer.batch_timeout,
            )
            for _ in range(at.require_batches)
        ]
        waited = time.perf_counter() - t0
        got, need = sum(len(meta) for meta in metas), self.cfg.samples_per_step
        if got < need:  # the train partition was sealed: the rollout workers ran out of prompts
            raise self._ran_out(step, got, need)
        batches = [self.client.get_data(meta, device=self.cfg.device) for meta in metas]
        rollouts, spans = self._batch(metas, batches)
        staleness = Counter(self.version - first for first, _ in spans)  # versions behind the weights trained
        stats = self.learner.step(rollouts)
        for meta in metas:
            self.client.ack(meta)
            self.client.clear(meta)
            self._count_consumed(meta.indexes)
        self.consumed_after.append(len(self.consumed))
        sync_s = 0.0
        if step % at.trigger_parameter_sync_step == 0:
            self.version += 1
            t_sync = time.perf_counter()
            self.publisher.publish(self.learner.model.state_dict(), version=self.version)
            # the controller's bound must count from this version before the next batch is served
            self.client.wait_version(self.version, timeout=self.cfg.trainer.batch_timeout)
            sync_s = time.perf_counter() - t_sync
        now = time.perf_counter()
        return StepRecord.of(
            step,
            rollouts,
            stats,
            elapsed=now - start,
            step_s=now - t0,
            samples=samples_before + len(rollouts),
            trainer_idle=waited / (now - t0),
            rollout_idle=self._rollout_idle(),
            version=self.version,
            staleness=staleness,
            spans=spans,
            weight_sync_s=sync_s,
        )

    def _ran_out(self, step: int, got: int, need: int) -> tq.UnsatisfiableError:
        """The error for a step the rollout workers can no longer fill, with the likely cause: a
        cluster that lets rollout run further ahead than this run's `max_staleness` keeps."""
        dropped = self.client.status()["staleness"]["dropped"]
        eta, bound = self.client.config.admission_staleness, self.cfg.max_staleness
        cause = (
            f"{dropped} samples were dropped as staler than this run's max_staleness={bound}, because the cluster "
            f"lets rollout run {'any number of' if eta is None else f'{eta:g}'} versions ahead: start the cluster "
            f"with `sluice serve --max-staleness {bound}` to match the run"
            if dropped
            else "none was dropped, so another consumer of the prompts took them"
        )
        return tq.UnsatisfiableError(
            f"step {step} got {got} of its {need} samples: the rollout workers used up all {self.prompts_fed} prompts "
            f"and sealed the train partition; {cause}"
        )

    def _batch(self, metas: list[tq.BatchMeta], batches: list[Any]) -> tuple[RolloutBatch, list[tuple[int, int]]]:
        """The mini-batches as one `RolloutBatch` with groups contiguous, and each row's span."""
        parts, spans = [], []
        for meta, batch in zip(metas, batches):
            order = sorted(range(len(meta)), key=lambda i: meta.groups[i])
            parts.append([x[order] for x in _dense(batch, self.task.max_new_tokens)])
            spans.extend((meta.policy_versions[i], meta.version_last[i]) for i in order)
        return RolloutBatch(*(torch.cat(cols) for cols in zip(*parts))), spans

    def _count_consumed(self, indexes: Sequence[int]) -> None:
        for i in indexes:
            if i in self.consumed:
                self.duplicates += 1
            self.consumed.add(i)

    def _rollout_idle(self) -> float | None:
        """Fraction of wall time the rollout workers waited since the last step (mean over them)."""
        fractions = []
        for worker in range(self.cfg.rollout.workers):
            raw = self.client.lookup(rollout_key(worker))
            if raw is None:
                continue
            now = msgspec.msgpack.decode(raw, type=RolloutStats)
            before = self._rollout_seen.get(worker)
            self._rollout_seen[worker] = now
            if before is None:
                continue
            busy, idle = now.busy_s - before.busy_s, now.idle_s - before.idle_s
            if busy + idle > 0:
                fractions.append(idle / (busy + idle))
        return round(sum(fractions) / len(fractions), 4) if fractions else None

    def _wait_for_workers(self) -> list[dict[str, Any]]:
        """Keep the weights served until every worker took the final version and left; a worker
        silent for `cluster.lease_timeout` is presumed dead. Returns their final statistics."""
        final = []
        for worker in range(self.cfg.rollout.workers):
            raw = self.client.lookup(rollout_key(worker, done=True), timeout=self.cfg.cluster.lease_timeout)
            if raw is not None:
                final.append(msgspec.to_builtins(msgspec.msgpack.decode(raw, type=RolloutStats)))
        return final

    def totals(self, wall_s: float, samples: int, version: int, consumed: int) -> dict[str, Any]:
        """The run's bookkeeping: what was produced, consumed, dropped and left over; `wall_s`,
        `samples`, `version` and `consumed` as of the run's end or (interrupted) its last step."""
        status = self.client.status()
        train = status["partitions"].get(TRAIN, {"samples": 0})
        return {
            "name": self.cfg.name,
            "wall_s": round(wall_s, 3),
            "samples": samples,
            "samples_per_s": round(samples / wall_s, 3) if wall_s else 0.0,
            "final_version": version,
            "consumed": consumed,
            "duplicates": self.duplicates,
            "produced": status["counters"]["samples_put"] - self.prompts_fed,
            "dropped": status["staleness"]["dropped"],
            "left": train["samples"],
            "max_staleness": self.cfg.max_staleness,
            "served_staleness": status["staleness"]["histogram"],
        }

    def close(self) -> None:
        self.publisher.close()
        self.client.close()


def _dense(batch: Any, width: int) -> tuple[torch.Tensor, ...]:
    """The columns of a `RolloutBatch`: responses and behaviour log-probs padded to `width`."""
    responses, logprobs = batch["responses"], batch["logprobs"]
    if responses.is_nested:
        lengths = responses.offsets().diff()
        responses = responses.to_padded_tensor(PAD, output_size=(len(lengths), width))
        logprobs = logprobs.to_padded_tensor(0.0, output_size=(len(lengths), width))
    else:
        lengths = torch.full((responses.shape[0],), responses.shape[1], dtype=torch.long, device=responses.device)
        responses = torch.nn.functional.pad(responses, (0, width - responses.shape[1]), value=PAD)
        logprobs = torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1]))
    return batch["prompts"], responses, logprobs, batch["rewards"], lengths


_PROG = "python -m recipes.async_trainer"


def main(argv: Sequence[str] | None = None) -> int:
    tq.exit_on_signals()
    return config_mod.reporting_errors(_PROG, lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args, cfg = config_mod.command_line(_PROG, __doc__, argv)
    trainer = AsyncTrainer(cfg, args.address)
    try:
        totals = trainer.run(lambda r: print(json.dumps(asdict(r)), flush=True))
    finally:
        trainer.close()
    print(json.dumps({"totals": totals}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
