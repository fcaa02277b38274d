"""One process holds as many clients as the OS lets it open files (not ZeroMQ's default 1,023
sockets), and a process out of sockets or files is told which limit it hit."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from tests.faults import ROOT

CLIENTS = textwrap.dedent(
    """
    import sys
    import msgspec
    import transfer_queue as tq
    from transfer_queue.wire.meta import BatchMeta
    address, n = sys.argv[1], int(sys.argv[2])
    meta = msgspec.json.decode(sys.argv[3], type=BatchMeta)
    clients = []
    try:
        for _ in range(n):
            client = tq.connect(address, use_shm=False)  # a socket to the controller (its Hello)
            clients.append(client)
            assert client.get_data(meta)["x"].tolist() == [0, 1]  # and one to the unit of the samples
    except tq.CapacityError as exc:
        print(f"REFUSED after {len(clients)}: {exc}")
        sys.exit(3)
    print(f"CONNECTED {len(clients)}")
    """
)


def _run(cluster, n: int, limit: int | None) -> subprocess.CompletedProcess:
    """`n` clients in one new process (its open-file limit lowered to `limit`)."""
    with cluster.connect(use_shm=False) as client:
        client.put({"x": torch.arange(2)})
        meta = client.get_meta(["x"], 2, task="t", timeout=10)

    def lower() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-c", CLIENTS, cluster.address, str(n), msgspec.json.encode(meta).decode()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lower,
    )


def test_a_process_out_of_files_is_told_which_limit(cluster):
    done = _run(cluster, 1_000, 256)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "open-file limit (RLIMIT_NOFILE soft 256, hard 256" in done.stdout


FIRST_FILE_REFUSED = textwrap.dedent(
    """
    import os
    import resource
    import sys
    import transfer_queue as tq
    import transfer_queue._client  # imported now: an import opens its file
    connect = tq.connect
    files = len(os.listdir("/proc/self/fd")) - 1  # the listing's own is closed again
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        connect(sys.argv[1])
    except tq.CapacityError as exc:
        print(f"REFUSED: {exc}")
        sys.exit(3)
    """
)


def test_a_client_refused_its_first_file_is_told_which_limit(cluster):
    """A blocking client's first descriptor (its wake-up, before any socket) refused: the same
    `CapacityError` as a refused socket, not the OS's error."""
    done = subprocess.run(
        [sys.executable, "-c", FIRST_FILE_REFUSED, cluster.address],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "can open no more files: it hit its open-file limit (RLIMIT_NOFILE soft" in done.stdout


@pytest.mark.slow
def test_a_thousand_clients_in_one_process(cluster):
    """1,200 clients, each with a socket to the controller and one to a unit: 2,400 sockets."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 8_000:
        pytest.skip("the hard open-file limit is too low for 1,200 clients")
    done = _run(cluster, 1_200, None)
    assert done.returncode == 0 and "CONNECTED 1200" in done.stdout, done.stdout + done.stderr
