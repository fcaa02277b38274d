"""`transfer_queue.host`'s pieces for commands and the processes they start, over real processes
and real signals: `exit_on_signals`, `stop_processes`."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import transfer_queue as tq
from tests.helpers import alive, eventually

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

_STUBBORN = (
    "import os, signal, time; "
    "signal.signal(signal.SIGTERM, lambda *_: os.write(2, b'term\\n')); "  # one write: lines from both stay whole
    "print('up', flush=True); time.sleep(600)"
)
_STOPPER = f"""
import subprocess, sys
from transfer_queue.host import exit_on_signals, stop_processes
exit_on_signals()
procs = [subprocess.Popen([sys.executable, "-c", {_STUBBORN!r}], stdout=subprocess.PIPE, text=True) for _ in range(2)]
for proc in procs:
    proc.stdout.readline()
print(*(proc.pid for proc in procs), flush=True)
stop_processes(procs, 600)
"""


def test_a_second_signal_during_a_stop_kills_every_process_still_running():
    """Two children that outlast SIGTERM, a stop that would wait 600 s for them, and a second
    Ctrl-C: the stop SIGKILLs both before the command exits, none is left to run on."""
    stopper = subprocess.Popen(
        [sys.executable, "-c", _STOPPER], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    children: list[int] = []
    try:
        children = [int(pid) for pid in stopper.stdout.readline().split()]
        assert len(children) == 2, stopper.stderr.read()
        assert [stopper.stderr.readline().strip() for _ in children] == ["term", "term"]  # both asked to stop
        stopper.send_signal(signal.SIGINT)
        stopper.wait(30)
        eventually(lambda: not [pid for pid in children if alive(pid)], 5, "both children killed")
    finally:
        stopper.kill()
        for pid in children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


_COMMAND = """
import atexit, time
atexit.register(print, "a library's exit hook", flush=True)  # one registered before, as imports do
from transfer_queue.host import exit_on_signals
exit_on_signals()
try:
    print("ready", flush=True)
    time.sleep(600)
finally:
    print("unwound", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_command_unwinds_on_a_signal_then_ends_by_it(sig):
    """Its `finally` blocks run, then every exit hook (one a library registered earlier too:
    `multiprocessing` ends its children there), then it dies of the signal, as its parent sees
    (a shell says 128 + the signal's number); SIGINT too where it came ignored, as in a
    script's background job."""
    command = subprocess.Popen(
        [sys.executable, "-c", _COMMAND],
        cwd=ROOT,
        env=ENV,
        text=True,
        stdout=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert command.stdout.readline() == "ready\n"
        command.send_signal(sig)
        assert command.communicate(timeout=30)[0] == "unwound\na library's exit hook\n"
        assert command.returncode == -sig
    finally:
        command.kill()


def test_ctrl_c_stops_a_shell_loop_that_runs_a_command():
    """bash goes on after a child that exited 130, and stops only when its child died of the
    SIGINT that a terminal's Ctrl-C sends to the whole foreground group: the loop stops at once."""
    loop = subprocess.Popen(
        ["bash", "-c", 'for i in 1 2; do "$PYTHON" -c "$COMMAND"; done; echo after'],
        cwd=ROOT,
        env={**ENV, "PYTHON": sys.executable, "COMMAND": _COMMAND},
        text=True,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert loop.stdout.readline() == "ready\n"
        os.killpg(loop.pid, signal.SIGINT)
        assert loop.communicate(timeout=30)[0] == "unwound\na library's exit hook\n"
        assert loop.returncode == -signal.SIGINT
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone with its children, as it should be
            os.killpg(loop.pid, signal.SIGKILL)


def test_exit_on_signals_off_the_main_thread_changes_nothing():
    """A command's `main` called from a thread: the main thread's handlers stand, nothing raises."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    raised: list[BaseException] = []

    def call() -> None:
        try:
            tq.exit_on_signals()
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert not raised and {sig: signal.getsignal(sig) for sig in before} == before
