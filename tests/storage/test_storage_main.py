"""`python -m storage` as a process: registration with a controller, and a clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import msgspec
import numpy as np
import zmq
from storage_harness import REPO, UnitClient, Units

from transfer_queue.wire.messages import ControllerRequest, ErrorReply, Ok, RegisterUnit, UnitStatus, Write
from transfer_queue.wire.meta import FieldSpec
from transfer_queue.wire.rpc import Codec, pack_prefix


def _registration(controller: zmq.Socket) -> tuple[list, RegisterUnit]:
    assert controller.poll(30_000), "the unit never registered"
    identity, *frames = controller.recv_multipart()
    request_id, msg, data = Codec(ControllerRequest).decode(frames)
    assert isinstance(msg, RegisterUnit) and data == []
    return [identity, pack_prefix(request_id)], msg


def test_unit_registers_then_announces(units: Units) -> None:
    head, msg = _registration(units.controller_ok)
    unit = msg.unit
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    assert unit.unit_id == 7 and unit.capacity == 2 << 20
    assert unit.shm_path == units.registered.shm_path and os.path.exists(unit.shm_path)
    assert unit.host_id.endswith(":" + boot) and unit.address.startswith("tcp://127.0.0.1:")
    units.controller_ok.send_multipart([*head, msgspec.msgpack.encode(Ok())])
    assert units.registered.address == unit.address  # announced only after the controller's Ok
    client = UnitClient(unit.address)
    assert client.ok(UnitStatus())[0].status["unit_id"] == 7
    client.close()


def test_refused_registration_exits_non_zero_and_cleans_up(units: Units) -> None:
    head, _msg = _registration(units.controller_no)
    units.controller_no.send_multipart([*head, msgspec.msgpack.encode(ErrorReply("schema", "unit 8 is taken"))])
    assert units.refused.proc.wait(15) == 1
    assert "unit 8 is taken" in units.refused.err()
    assert units.refused.proc.stdout.read() == b""  # never announced
    assert not os.path.exists(units.refused.shm_path)


def test_unanswered_registration_times_out(units: Units) -> None:
    assert units.unanswered.proc.wait(30) == 1
    assert "did not answer the registration within 1.0 s" in units.unanswered.err()
    assert not os.path.exists(units.unanswered.shm_path)


def test_sigterm_unlinks_the_arena(units: Units) -> None:
    unit = units.term
    client = UnitClient(unit.address)
    client.ok(Write("p", [0, 1], {"x": FieldSpec("float32", (1000,))}), [np.ones(2000, np.float32)])
    assert os.path.exists(unit.shm_path)
    client.close()
    assert unit.stop(signal.SIGTERM) == 0
    assert not os.path.exists(unit.shm_path)
    assert unit.err() == ""


def test_a_second_unit_with_the_same_name_is_refused(units: Units, main_client: UnitClient) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "storage",
            "--unit-id",
            "0",
            "--capacity",
            "1MiB",
            "--cluster-id",
            units.main.cluster_id,
        ],
        cwd=REPO,
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 1 and proc.stdout == b""
    assert b"exists" in proc.stderr
    assert os.path.exists(units.main.shm_path)  # the running unit's arena is untouched
    assert main_client.ok(UnitStatus())[0].status["unit_id"] == 0


def test_a_unit_takes_a_write_and_serves_a_read_on_two_io_threads(units: Units) -> None:
    """Two ZeroMQ I/O threads (created before any socket): a producer's frames arriving and a
    consumer's leaving, on two connections, do not take turns on one thread."""
    assert units.main.address  # announced: its sockets exist
    tasks = f"/proc/{units.main.proc.pid}/task"
    names = []
    for tid in os.listdir(tasks):
        with open(f"{tasks}/{tid}/comm") as f:
            names.append(f.read().strip())
    assert sorted(n for n in names if n.startswith("ZMQbg/IO")) == ["ZMQbg/IO/0", "ZMQbg/IO/1"], names
