"""What the process tests share: a forkserver context whose workers import torch once, a
group of subscriber processes and the events they report, and the checks on their summaries."""

from __future__ import annotations

import glob
import multiprocessing as mp
import time

from tests.helpers import eventually

from .workers import kill, publisher, subscriber

CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["tests.weight_sync.workers"])  # workers fork from a process that imported torch once


def publisher_transport(name: str, subscribers: int):
    """A picklable spec (`workers.transport_of` builds it): torch needs the group's size."""
    return ("torch", {"world_size": subscribers + 1}) if name == "torch" else name


class Subscribers:
    """Subscriber processes and the events they report."""

    def __init__(
        self, n: int, endpoint: str | None, transport, address: str | None = None, first_id: int = 0, **kwargs
    ):
        self.out = CTX.Queue()
        self.stop = CTX.Event()
        self.procs = [
            CTX.Process(
                target=subscriber,
                args=(self.out, self.stop, first_id + i, address, endpoint, transport, dict(kwargs)),
                daemon=True,
            )
            for i in range(n)
        ]
        self.ids = [first_id + i for i in range(n)]
        self.latest = {i: -1 for i in self.ids}
        self.errors = {i: 0 for i in self.ids}
        for p in self.procs:
            p.start()

    def _drain(self, timeout: float) -> tuple | None:
        try:
            event = self.out.get(timeout=timeout)
        except Exception:  # noqa: BLE001 - queue.Empty
            return None
        if event[0] == "applied":
            self.latest[event[1]] = event[2]
        elif event[0] == "error":
            self.errors[event[1]] += 1
        return event

    def wait_applied(self, version: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while min(self.latest.values()) < version:
            assert time.monotonic() < deadline, f"subscribers hold {self.latest}, waited for {version}"
            self._drain(0.2)

    def wait_errors(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while min(self.errors.values()) < 1:
            assert time.monotonic() < deadline, f"subscribers saw no error: {self.errors}"
            self._drain(0.2)

    def finish(self, timeout: float = 60.0) -> dict[int, dict]:
        self.stop.set()
        summaries: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(summaries) < len(self.procs):
            assert time.monotonic() < deadline, "subscribers did not finish"
            event = self._drain(0.5)
            if event is not None and event[0] == "done":
                summaries[event[1]] = event[2]
        for p in self.procs:
            p.join(10)
        return summaries


def publisher_killed_mid_version(transport, publisher_kwargs: dict, subscriber_transport, **subscriber_kwargs) -> None:  # noqa: ANN001 - transport specs
    """Kill the trainer (a publisher process) while version 2 is half staged and half sent:
    both subscribers report `WeightSyncError` and keep version 1, exactly."""
    commands, out = CTX.Queue(), CTX.Queue()
    proc = CTX.Process(target=publisher, args=(out, commands, None, transport, publisher_kwargs), daemon=True)
    proc.start()
    try:
        _, endpoint = out.get(timeout=60)
        # the subscribers' own timeout (5 s) is well inside the wait for their error (60 s):
        # with 30 s each, one that had not started on version 2 raced the test and sometimes lost
        subs = Subscribers(2, endpoint, subscriber_transport, timeout=5.0, **subscriber_kwargs)
        commands.put(("publish", 1))
        subs.wait_applied(1)
        commands.put(("publish", 2, True))
        while out.get(timeout=30)[0] != "stalled":
            pass
        kill(proc)
        subs.wait_errors(timeout=60)
        for summary in subs.finish().values():
            assert 2 not in summary["applied"]
            check(summary, 1)
    finally:
        if proc.is_alive():
            kill(proc)


def check(summary: dict, final: int) -> None:
    assert summary["errors"] == [] or all("WeightSyncError" in e for e in summary["errors"]), summary["errors"]
    assert not summary["mixed"], "a subscriber held a mix of versions"
    assert not summary["moved"], "a tensor was reallocated"
    assert summary["applied"] == sorted(set(summary["applied"])), summary["applied"]
    assert summary["final"] == final and summary["exact"]


def no_segments_left() -> None:
    assert not glob.glob("/dev/shm/*sluice*weights*")


def counted(pub, version: int, pulls: int) -> dict:  # noqa: ANN001 - a WeightPublisher
    """The publisher's stats by version, once it has counted `pulls` pulls (delta or whole) of
    `version`: a pull is counted when its stream ends on the publisher's side, which can be
    just after the subscriber has received it all and returned from `wait`."""

    def look() -> dict | None:
        stats = {s.version: s for s in pub.stats()}
        got = stats.get(version)
        return stats if got is not None and got.delta_pulls + got.whole_pulls >= pulls else None

    return eventually(look, 30, f"{pulls} pulls of version {version} counted")
