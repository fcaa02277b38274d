"""Bad input gets a typed error and loses nothing; backpressure; hostile bytes are never run."""

from __future__ import annotations

import glob
import os
import pickle
import threading
import time

import pytest
import torch
import zmq
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import eventually, unit_status
from tests.peers import peer, raw
from transfer_queue.wire.rpc import pack_prefix


def _td(n: int, **fields) -> TensorDict:
    return TensorDict(fields or {"x": torch.zeros(n, 4)}, batch_size=[n])


def test_schema_violations_are_typed_and_change_nothing(client):
    client.put(_td(2))
    with pytest.raises(tq.SchemaError, match="float32"):
        client.put(_td(2, x=torch.zeros(2, 4, dtype=torch.int64)))
    with pytest.raises(tq.SchemaError, match="x"):
        client.put(_td(2, x=torch.zeros(2, 5)))
    with pytest.raises(ValueError):  # SchemaError is also a ValueError
        client.put(TensorDict({}, batch_size=[0]))
    with pytest.raises(tq.SchemaError):
        client.get_meta(["x"], 0, task="t")
    with pytest.raises(tq.SchemaError):
        client.put(TensorDict({"x": torch.zeros(2, 4, dtype=torch.complex64)}, batch_size=[2]))
    assert client.status()["partitions"]["train"]["samples"] == 2
    meta = client.get_meta(["x"], 2, task="t", timeout=5)
    with pytest.raises(tq.SchemaError, match="no field"):
        client.get_data(meta, fields=["nope"])
    with pytest.raises(tq.SchemaError):
        client.ack(
            meta.__class__(**{**{f: getattr(meta, f) for f in meta.__struct_fields__}, "indexes": [999999, 999998]})
        )


def test_put_into_a_sealed_partition_is_refused(client):
    client.put(_td(1))
    client.seal("train")
    with pytest.raises(tq.SealedError):
        client.put(_td(1))
    meta = client.get_meta(["x"], 5, task="t", timeout=5)
    assert len(meta) == 1  # sealed: the remainder comes at once
    client.ack(meta)
    assert len(client.get_meta(["x"], 5, task="t", timeout=5)) == 0  # drained


def test_full_storage_pushes_back_then_recovers():
    with tq.init(num_storage_units=1, storage_capacity="8MiB") as cluster, cluster.connect() as client:

        def big() -> TensorDict:
            return TensorDict({"x": torch.zeros(16, 65536)}, batch_size=[16])  # 4 MiB

        client.put(big())
        meta = client.put(big())
        started = time.monotonic()
        with pytest.raises(tq.CapacityError):
            client.put(big(), timeout=0.5)
        assert time.monotonic() - started >= 0.4
        with pytest.raises(tq.CapacityError, match="whole capacity"):
            client.put(TensorDict({"x": torch.zeros(40, 65536)}, batch_size=[40]))  # 10 MiB > 8 MiB
        status = client.status()["partitions"]["train"]
        assert status["samples"] == 32, "the refused puts left nothing behind"
        # a blocked put goes through once space is freed
        done = {}
        thread = threading.Thread(target=lambda: done.setdefault("meta", client2.put(big(), timeout=20)))
        client2 = cluster.connect()
        thread.start()
        eventually(lambda: client.status()["counters"]["puts_waiting_for_room"] == 1, 10, "the put waits for room")
        assert thread.is_alive()
        assert unit_status(client.units[0].address)["pending_writes"] == 0, "no frames sent before there is room"
        client.clear(meta)
        thread.join(20)
        assert len(done["meta"]) == 16
        client2.close()


@pytest.mark.parametrize("target", ["controller", "unit"])
def test_garbage_and_pickle_are_rejected_and_never_executed(cluster, client, tmp_path, target):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    address = cluster.address if target == "controller" else client.units[0].address
    channel = peer(address)
    payloads = [
        [b"\x00garbage"],
        [pack_prefix(1), pickle.dumps(Exploit())],
        [pickle.dumps(Exploit())],
        [pack_prefix(2), b"\xa5hello"],
        [b"XYZ\x01" + bytes(8), b"{}"],
    ]
    for frames in payloads:
        _, reply, _ = raw(channel, frames)
        assert reply.code == "protocol", reply
    channel.close()
    assert not marker.exists()
    # still serving
    client.put(_td(2))
    assert client.status()["counters"]["requests_rejected"] >= (len(payloads) if target == "controller" else 0)


def test_shutdown_leaves_no_process_and_no_shared_memory():
    cluster = tq.init(num_storage_units=2, storage_capacity="16MiB")
    procs = list(cluster.backend.procs)
    assert glob.glob(f"/dev/shm/sluice-{cluster.cluster_id}-*")
    with cluster.connect() as client:
        client.put(_td(4))
    cluster.shutdown()
    assert all(p.poll() is not None for p in procs)
    assert not glob.glob(f"/dev/shm/sluice-{cluster.cluster_id}-*")
    cluster.shutdown()  # twice is fine
    assert not cluster.alive


def test_closed_client_says_so(cluster):
    client = tq.connect(cluster.address)
    client.close()
    with pytest.raises(tq.ClosedError, match="closed"):
        client.status()
    with pytest.raises(tq.ClosedError):
        client.put(_td(2))
    control = tq.ControlClient(cluster.address)
    assert control.version == 0
    control.close()
    with pytest.raises(tq.ClosedError):
        control.status()


async def test_closed_async_client_says_so(cluster):
    client = await tq.connect_async(cluster.address)
    await client.close()
    assert client.closed
    with pytest.raises(tq.ClosedError):
        await client.get_meta(["x"], 1, task="t", timeout=0.1)


def test_foreign_errors_become_sluice_errors(cluster, client):
    """ZeroMQ's errors and builtin ValueError/TypeError raised inside a call surface as `tq.*`
    errors (the original chained as `__cause__`)."""
    with pytest.raises(tq.ServiceError) as info:
        tq.connect("tcp://127.0.0.1:notaport")
    assert isinstance(info.value.__cause__, zmq.ZMQError)
    meta = client.put(_td(2))
    with pytest.raises(tq.SchemaError) as info:
        client.get_data(meta, fields=5)  # not a sequence of names
    assert isinstance(info.value.__cause__, TypeError)
