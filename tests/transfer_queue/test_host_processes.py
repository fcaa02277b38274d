"""`transfer_queue.host`'s pieces for commands and the processes they start, over real processes
and real signals: `stop_processes`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

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
