"""The rollout worker: prompts in, scored rollouts out, inside the staleness budget.

Per batch it `acquire`s `prompts_per_batch × group_size` generation slots (admission control:
the budget opens as the trainer consumes and publishes), makes sure its engine holds at least
the grant's weight version, leases prompts from the prompt partition, generates `group_size`
responses per prompt, scores them, and `put`s prompts, responses, token log-probs and rewards
with the policy version, one GRPO group per prompt. New weights are applied through
`WeightSubscriber` only at safe points: between batches, or, with
`async_training.partial_rollout`, at the token boundary where a new version arrived
(`versions()` events): the generation stops there, swaps the weights, resumes from prompt +
tokens so far under the new ones, and the samples record the version span (first, last).

Several workers may run at once (`--worker-id` tells them apart). A worker stops when the
trainer announces it is done (after applying the final version) or the prompts run out; then it
seals the train partition, so that a trainer waiting for more samples than are left learns it
at once. A batch that outlived its prompts' lease (`cluster.lease_timeout`), some of whose
prompts another worker leased meanwhile, is logged and counted (`RolloutStats.late_acks`, in
`run.json`'s `rollout`), and the worker goes on.

Everything that uses the subscriber or the engine's weights (applies, generations, and the
subscriber's `close`) runs on one thread the worker owns, one call after another: the
subscriber is used from one thread at a time, and a `run` cancelled mid-apply (Ctrl-C) closes it
only once that apply is over. That thread waits only for weights that exist (the trainer's
first, announced under `WEIGHTS_KEY`, or a version the controller announced), and a generation
whose await is cancelled stops at its next token step: a stopped worker waits at most for
the apply or the token step under way.

    python -m recipes.rollout_worker --address tcp://127.0.0.1:41000 [--worker-id N] [CONFIG.yaml] [key=value ...]
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from transfer_queue.host import STOP_SIGNALS, stop_while_loading

stop_while_loading(__name__)  # before the heavy imports

import msgspec  # noqa: E402
import torch  # noqa: E402

import transfer_queue as tq  # noqa: E402
from weight_sync import WeightSubscriber  # noqa: E402

from .channels import PROMPTS, ROLLOUT_TASK, STOP_KEY, TRAIN, WEIGHTS_KEY, RolloutStats, rollout_key  # noqa: E402
from .config import RecipeConfig, command_line, reporting_errors  # noqa: E402
from .engines import make_engine  # noqa: E402
from .task import PAD, DigitReversal  # noqa: E402

__all__ = ["RolloutWorker", "main"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_FOREVER = 1e6
"""Timeout for waits that end by an event (budget, stop), not by time."""
WEIGHT_TIMEOUT = 120.0
"""Seconds to wait for the trainer's first weights (`WEIGHTS_KEY`), and for a weight version
the controller already announced."""


class RolloutWorker:
    """One rollout worker process's loop against the cluster at `address`."""

    def __init__(self, cfg: RecipeConfig, address: str, worker_id: int = 0):
        torch.set_num_threads(1)
        self.cfg, self.address = cfg, address
        self.task = DigitReversal(cfg.task)
        self.engine = make_engine(cfg)
        self.subscriber = WeightSubscriber(address, dict(self.engine.weights()), transport=cfg.rollout.transport)
        self.stats = RolloutStats(worker_id)
        self.device = self.engine.device
        """Where prompts are read onto, rollouts generated and put from (`model.device` for the
        torch and hf engines): CUDA tensors go straight into `put`."""
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed * 1009 + worker_id)
        self.latest = -1
        """The newest version the controller announced (partial rollout compares it with the
        engine's at every token boundary)."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollout-worker-{worker_id}")
        """The one thread that applies, generates and closes the subscriber (`_in_thread`); the
        event loop only reads the subscriber's `version`, an int."""

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> RolloutStats:
        """Produce until the trainer says stop or the prompts run out; the stats at the end. A worker
        runs once: its thread ends with it.

        However it ends (cancelled included), it closes the subscriber on the worker's thread,
        after the apply or generation still running there: that is how long cleanup can wait,
        and it is bounded. An apply waits only for a version that exists (the trainer's first,
        once announced, or one the controller announced): its transfer, each step of which the
        subscriber bounds by its `timeout` (30 s). A cancelled generation stops at its next token
        step (`_generated`).

        Raises:
            tq.TimeoutError: the trainer published no weights within `WEIGHT_TIMEOUT`.
        """
        client = await tq.connect_async(self.address)
        stop = asyncio.ensure_future(client.lookup(STOP_KEY, timeout=_FOREVER))
        watcher = (
            asyncio.ensure_future(self._watch_versions(client)) if self.cfg.async_training.partial_rollout else None
        )
        try:
            # waited for here, where a stop cancels it, not on the thread, where it would hold the stop up
            first = await self._idle(client.lookup(WEIGHTS_KEY, timeout=WEIGHT_TIMEOUT))
            if first is None:
                raise tq.TimeoutError(f"the trainer published no weights within {WEIGHT_TIMEOUT:g} s")
            await self._idle(self._in_thread(self._apply, msgspec.msgpack.decode(first, type=int)))
            while not stop.done():
                if not await self._batch(client, stop):
                    break
            await self._idle(self._follow_until_stop(client, stop))
            final = msgspec.msgpack.decode(stop.result(), type=int)
            await self._idle(self._in_thread(self._apply, final))
            self.stats.finished = True
            await client.announce(rollout_key(self.stats.worker, done=True), msgspec.msgpack.encode(self.stats))
        finally:
            # queued first, so that a second cancellation while the client closes cannot skip
            # it; the thread ends once the close (the last call it is given) has run
            closed = asyncio.get_running_loop().run_in_executor(self._thread, self.subscriber.close)
            self._thread.shutdown(wait=False)
            for task in (stop, watcher):
                if task is not None:
                    task.cancel()
                    with suppress(BaseException):
                        await task
            await client.close()
            await asyncio.shield(closed)  # a cancelled await leaves the queued close in place
        if self.cfg.out_dir:
            path = Path(self.cfg.out_dir, f"rollout-{self.stats.worker}.json")
            path.write_text(json.dumps(msgspec.to_builtins(self.stats), indent=1))
        return self.stats

    async def _batch(self, client: tq.AsyncClient, stop: asyncio.Future) -> bool:
        """Generate and put one batch; False when there is nothing left to do."""
        cfg = self.cfg.rollout
        grant = await self._idle(
            _unless(client.acquire(cfg.prompts_per_batch * cfg.group_size, timeout=_FOREVER), stop)
        )
        if grant is None:
            return False
        async with grant:
            if self.subscriber.version < grant.version:
                await self._idle(self._in_thread(self._apply, grant.version))
            meta = await self._idle(
                client.get_meta(["prompts"], cfg.prompts_per_batch, ROLLOUT_TASK, PROMPTS, timeout=_FOREVER)
            )
            if not len(meta):
                # The prompts are sealed and drained, each acked only after its samples were put:
                # no sample will come any more. Sealing the train partition says so, and a
                # trainer still waiting for a batch gets what is left at once, not at its timeout.
                await client.seal(TRAIN)
                return False
            prompts = (await client.get_data(meta, device=self.device))["prompts"]
            start = time.perf_counter()
            rollouts = await self._generated(prompts)
            groups = [i for i in meta.indexes for _ in range(cfg.group_size)]
            for rows, span in rollouts.by_span():
                td = rollouts.select(rows)
                await client.put(
                    td, partition=TRAIN, policy_version=span, groups=[groups[r] for r in rows], grant=grant
                )
            try:
                await client.ack(meta)
            except tq.LeaseExpiredError as exc:
                # the generation outlived the prompts' lease and another worker leased some of
                # them meanwhile: both generate them (each rollout a sample of its own), and
                # this one's are put already; going on loses nothing, dying loses a worker
                self.stats.late_acks += 1
                log.warning("worker %d: late ack of prompts %s: %s", self.stats.worker, meta.indexes, exc)
            self.stats.busy_s += time.perf_counter() - start
        self.stats.samples += rollouts.n
        self.stats.batches += 1
        self.stats.tokens += int(rollouts.lengths.sum())
        self.stats.spans += int((rollouts.last > rollouts.first).sum())
        await client.announce(rollout_key(self.stats.worker), msgspec.msgpack.encode(self.stats))
        return True

    async def _follow_until_stop(self, client: tq.AsyncClient, stop: asyncio.Future) -> None:
        """Out of prompts before the trainer is done: keep taking its new versions until it says
        stop. Raises `tq.TimeoutError` if no version comes for `trainer.batch_timeout` seconds."""
        while not stop.done():
            newer = await _unless(
                client.wait_version(self.subscriber.version + 1, timeout=self.cfg.trainer.batch_timeout), stop
            )
            if newer is not None:
                await self._in_thread(self._apply, newer)

    async def _idle(self, awaitable):  # noqa: ANN001, ANN202 - times a wait as idle
        start = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.stats.idle_s += time.perf_counter() - start

    async def _watch_versions(self, client: tq.AsyncClient) -> None:
        async for version in client.versions(after=max(self.subscriber.version, 0)):
            self.latest = version

    async def _generated(self, prompts: torch.Tensor) -> Rollouts:
        """`_generate(prompts)` on the worker's thread. Cancelled (the worker stopped, or this
        batch), the generation stops at its next token step rather than finishing the batch."""
        cancelled = threading.Event()
        try:
            return await self._in_thread(self._generate, prompts, cancelled.is_set)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def _in_thread(self, call: Callable[..., T], *args: object) -> T:
        """`call(*args)` on the worker's thread, after whatever runs there. Cancelling the
        await leaves a call already running to finish there (a thread cannot be stopped)."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, call, *args)

    # -- on the worker's thread ----------------------------------------------------------------

    def _apply(self, version: int) -> None:
        """Hold at least `version`: wait for it, or take anything newer already complete. A
        transfer that failed is tried once more, which pulls the newest version whole (an
        apply that outlasted its lease while the trainer staged a newer version in its slot,
        a connection lost); a second failure ends the worker (a publisher gone stays gone)."""
        before = self.subscriber.version
        start = time.perf_counter()
        for last in (False, True):
            try:
                if self.subscriber.version < version:
                    self.subscriber.wait(version, timeout=WEIGHT_TIMEOUT)
                self.subscriber.poll()
                break
            except tq.WeightSyncError as exc:
                if last or isinstance(exc, tq.GpuStagingStoppedError):  # the latter: no transport left
                    raise
                self.stats.weight_retries += 1
                log.warning("worker %d: weight transfer failed (%s); trying again", self.stats.worker, exc)
        if self.subscriber.version != before:
            self.engine.weights_applied()
            self.stats.weight_apply_s += time.perf_counter() - start
        self.stats.version = self.subscriber.version

    def _generate(self, prompts: torch.Tensor, cancelled: Callable[[], bool] = lambda: False) -> Rollouts:
        """`group_size` responses per prompt; with partial rollout, swap weights mid-way.

        Raises:
            asyncio.CancelledError: `cancelled()` turned True; the engine stopped at the token
                step where it did (`Engine.generate`'s `interrupt`), the batch unfinished.
        """
        group, width = self.cfg.rollout.group_size, self.task.max_new_tokens
        prefixes = prompts.repeat_interleave(group, 0)
        out = Rollouts.empty(prefixes, width, self.subscriber.version)
        partial = self.cfg.async_training.partial_rollout

        def interrupt() -> bool:
            return cancelled() or (partial and self.latest > self.subscriber.version)

        while True:
            live = torch.nonzero(~out.finished).squeeze(1)
            done = int(out.lengths[live[0]])  # live rows are aligned: same tokens so far
            prefix = torch.cat([prefixes[live], out.tokens[live, :done]], dim=1)
            gen = self.engine.generate(prefix, width - done, self.generator, interrupt)
            n = gen.tokens.shape[1]
            out.tokens[live, done : done + n] = gen.tokens
            out.logprobs[live, done : done + n] = gen.logprobs
            out.lengths[live] += gen.lengths
            out.finished[live] = gen.finished
            out.last[live] = self.subscriber.version
            if bool(out.finished.all()):
                break
            if cancelled():
                raise asyncio.CancelledError(f"generation cancelled after {done + n} of up to {width} tokens")
            self._apply(self.latest)
        out.rewards = self.task.rewards(prefixes, out.tokens)
        return out


async def _unless(call: Awaitable[T], stop: asyncio.Future) -> T | None:
    """`call`'s result, or None if `stop` completes first; the client then withdraws the call
    at the service (and gives back a grant it won meanwhile)."""
    task = asyncio.ensure_future(call)
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return None


class Rollouts:
    """A batch of responses being generated, then scored; rows are prompt-major groups."""

    def __init__(self, prompts: torch.Tensor, tokens, logprobs, lengths, finished, first, last):  # noqa: ANN001
        self.prompts, self.tokens, self.logprobs = prompts, tokens, logprobs
        self.lengths, self.finished, self.first, self.last = lengths, finished, first, last
        self.rewards = torch.zeros(len(prompts), device=prompts.device)

    @classmethod
    def empty(cls, prompts: torch.Tensor, width: int, version: int) -> Rollouts:
        """No tokens yet for each row of `prompts`, on their device."""
        n, device = len(prompts), prompts.device
        return cls(
            prompts,
            torch.full((n, width), PAD, dtype=torch.long, device=device),
            torch.zeros((n, width), dtype=torch.float32, device=device),
            torch.zeros(n, dtype=torch.long, device=device),
            torch.zeros(n, dtype=torch.bool, device=device),
            torch.full((n,), version, dtype=torch.long, device=device),
            torch.full((n,), version, dtype=torch.long, device=device),
        )

    @property
    def n(self) -> int:
        return len(self.prompts)

    def by_span(self) -> list[tuple[list[int], tuple[int, int]]]:
        """Rows grouped by their (first, last) version span, one `put` each."""
        spans: dict[tuple[int, int], list[int]] = {}
        for row, (a, b) in enumerate(zip(self.first.tolist(), self.last.tolist())):
            spans.setdefault((a, b), []).append(row)
        return [(rows, span) for span, rows in spans.items()]

    def select(self, rows: list[int]) -> dict[str, torch.Tensor]:
        """The rows as the columns the trainer reads; responses and log-probs are ragged."""
        idx = torch.tensor(rows, device=self.prompts.device)
        lengths = self.lengths[idx].tolist()
        return {
            "prompts": self.prompts[idx],
            "responses": torch.nested.nested_tensor(
                [self.tokens[r, :n] for r, n in zip(rows, lengths)], layout=torch.jagged
            ),
            "logprobs": torch.nested.nested_tensor(
                [self.logprobs[r, :n] for r, n in zip(rows, lengths)], layout=torch.jagged
            ),
            "rewards": self.rewards[idx],
        }


_PROG = "python -m recipes.rollout_worker"


async def _until_signal(work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; SIGINT, SIGTERM or SIGHUP cancels it, at an await, so it unwinds in
    order; then, `tq.exit_on_signals`' handlers back, the signal is raised again for them to
    take: `SystemExit(128 + signal)` and, at exit, the process ending by that signal, as
    outside the loop. Raised inside the loop, that exception would end whichever task was
    running, cut short."""
    loop, task, got = asyncio.get_running_loop(), asyncio.ensure_future(work), []

    def stop(sig: int) -> None:
        got.append(sig)
        task.cancel()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if not got:
            raise
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        tq.exit_on_signals()
    signal.raise_signal(got[0])
    raise AssertionError("unreachable: exit_on_signals' handler raised SystemExit")


def main(argv: Sequence[str] | None = None) -> int:
    tq.exit_on_signals()
    return reporting_errors(_PROG, lambda: _run(argv))


def _run(argv: Sequence[str] | None) -> int:
    args, cfg = command_line(_PROG, __doc__, argv, worker=True)
    stats = asyncio.run(_until_signal(RolloutWorker(cfg, args.address, args.worker_id).run()))
    print(json.dumps(msgspec.to_builtins(stats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
