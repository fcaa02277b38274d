"""Real storage-unit processes and a kernel channel to them, for the storage tests.

Units start as `python -m storage` subprocesses. Starting one costs seconds (imports), so the
session fixture starts every unit the tests need at once and each test reads the address only
when it needs it; tests keep to their own partitions (or free what they wrote).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from tests.peers import raw
from transfer_queue._launch import storage_command
from transfer_queue.host import arena_path
from transfer_queue.wire.errors import error_from_code
from transfer_queue.wire.messages import ErrorReply, Reply
from transfer_queue.wire.rpc import Channel, Codec

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 60.0


class UnitProcess:
    """One `python -m storage` subprocess; `address` waits for its announce line."""

    def __init__(self, capacity: int, unit_id: int = 0, controller: str | None = None, extra: Sequence[str] = ()):
        self.unit_id = unit_id
        self.cluster_id = f"test{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.shm_path = arena_path(self.cluster_id, unit_id)
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 (read by err() for the life of the unit)
        cmd = [sys.executable, *storage_command(unit_id, capacity, self.cluster_id, controller, "127.0.0.1"), *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self.stderr)
        self._address: str | None = None
        self.lines: list[str] = []

    @property
    def address(self) -> str:
        if self._address is None:
            line = self.readline(START_TIMEOUT)
            assert line.startswith("SLUICE_STORAGE "), f"unexpected announce {line!r}; stderr: {self.err()}"
            self._address = line.split()[1]
        return self._address

    def readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"storage unit printed nothing within {timeout} s; stderr: {self.err()}"
        line = self.proc.stdout.readline().decode()
        self.lines.append(line)
        return line

    def err(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if os.path.exists(self.shm_path):  # a killed unit cannot clean up after itself
            os.unlink(self.shm_path)


class UnitClient(Channel):
    """A kernel channel to a storage unit, with what the storage tests ask of it: replies by id
    or in arrival order, whether one is still pending, and raw frames (through `tests.peers`)."""

    def __init__(self, address: str):
        super().__init__(address, Codec(Reply), name=f"storage unit at {address}")

    def recv(self, rid: int, timeout: float = 10.0) -> tuple[Any, list[Any]]:
        return self.reply(rid, timeout)

    def recv_any(self, timeout: float = 10.0) -> tuple[int, Any, list[Any]]:
        """The next reply in arrival order, whichever request it answers."""
        rid = self.ready(None, timeout)
        if rid is None:
            raise AssertionError(f"no reply within {timeout} s")
        return (rid, *self.reply(rid))

    def pending(self, rid: int, wait: float = 0.0) -> bool:
        """True if no reply to `rid` has arrived (after waiting up to `wait` seconds)."""
        return self.ready(rid, wait) is None

    def send_raw(self, frames: Sequence[Any]) -> tuple[int, Any, list[Any]]:
        """Send `frames` as they are; the unit's decoded answer."""
        return raw(self, frames)

    def ok(self, msg: Any, frames: Sequence[Any] = (), timeout: float = 10.0) -> tuple[Any, list[Any]]:
        """Send `msg` and wait for its reply; an `ErrorReply` raises the error class the unit raised."""
        return raise_for(*self.recv(self.send(msg, frames), timeout))


def raise_for(reply: Any, data: list[Any]) -> tuple[Any, list[Any]]:
    if isinstance(reply, ErrorReply):
        raise error_from_code(reply.code, reply.message)
    return reply, data


class Units:
    """Every unit process of the session, started together."""

    def __init__(self) -> None:
        self.main = UnitProcess(64 << 20)
        self.small = UnitProcess(1 << 20, unit_id=3)
        self.term = UnitProcess(4 << 20, unit_id=5)
        ctx = zmq.Context.instance()
        self.controller_ok = ctx.socket(zmq.ROUTER)
        self.controller_no = ctx.socket(zmq.ROUTER)
        ok_port = self.controller_ok.bind_to_random_port("tcp://127.0.0.1")
        no_port = self.controller_no.bind_to_random_port("tcp://127.0.0.1")
        self.registered = UnitProcess(2 << 20, unit_id=7, controller=f"tcp://127.0.0.1:{ok_port}")
        self.refused = UnitProcess(2 << 20, unit_id=8, controller=f"tcp://127.0.0.1:{no_port}")
        self.unanswered = UnitProcess(
            "1MiB", unit_id=9, controller="tcp://127.0.0.1:9", extra=["--register-timeout", "1"]
        )
        self.all = [self.main, self.small, self.term, self.registered, self.refused, self.unanswered]

    def close(self) -> None:
        for unit in self.all:
            try:
                unit.stop(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            unit.kill()
        self.controller_ok.close(linger=0)
        self.controller_no.close(linger=0)


__all__ = ["UnitProcess", "UnitClient", "Units", "raise_for"]
