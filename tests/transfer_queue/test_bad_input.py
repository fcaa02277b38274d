"""Every bad input found by hand (issue 9) gets a typed `tq.*` error that says what to do, and
changes nothing; invalid UTF-8 on the wire is a counted `ProtocolError`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.peers import peer, raw
from transfer_queue.wire.rpc import pack_prefix


def _td(n: int = 2) -> TensorDict:
    return TensorDict({"x": torch.zeros(n, 4)}, batch_size=[n])


BAD_PUTS = {
    "arbitrary objects (no pickle)": lambda c: c.put({"x": [object(), object()]}),
    "list of tensors (ragged rows)": lambda c: c.put({"x": [torch.zeros(3), torch.zeros(4)]}),
    "int field": lambda c: c.put({"x": 5}),
    "int field after a tensor": lambda c: c.put({"y": torch.zeros(2), "x": 5}),
    "0-dim tensor": lambda c: c.put({"x": torch.tensor(1.0)}),
    "strided nested tensor": lambda c: c.put({"x": torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)])}),
    "field of shape (8, 0)": lambda c: c.put(TensorDict({"y": torch.zeros(8, 0)}, batch_size=[8])),
    "policy_version 2**70": lambda c: c.put(_td(), policy_version=2**70),
    "policy_version -7": lambda c: c.put(_td(), policy_version=-7),
    "policy_version span -1": lambda c: c.put(_td(), policy_version=(-1, 3)),
    "partition ''": lambda c: c.put(_td(), partition=""),
    "groups 2**70": lambda c: c.put(_td(), groups=[0, 2**70]),
}

BAD_CALLS = {
    "get_meta batch_size 2**70": lambda c: c.get_meta(["x"], 2**70, task="t"),
    "get_meta lease_timeout -1": lambda c: c.get_meta(["x"], 1, task="t", lease_timeout=-1),
    "get_meta partition ''": lambda c: c.get_meta(["x"], 1, task="t", partition=""),
    "set_version 2**70": lambda c: c.set_version(2**70),
    "wait_version 2**70": lambda c: c.wait_version(2**70, timeout=1),
    "acquire 2**70": lambda c: c.acquire(2**70),
    "announce str": lambda c: c.announce("key", "str"),
    "seal ''": lambda c: c.seal(""),
}


@pytest.mark.parametrize("name", list(BAD_PUTS) + list(BAD_CALLS))
def test_bad_input_is_a_schema_error_and_changes_nothing(shared_cluster, name):
    with tq.connect(shared_cluster.address) as client:
        before = client.status()
        with pytest.raises(tq.SchemaError) as info:
            {**BAD_PUTS, **BAD_CALLS}[name](client)
        assert len(str(info.value)) > 20
        after = client.status()
        assert after["partitions"] == before["partitions"]
        assert after["counters"]["open_puts"] == 0


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (
            "list of tensors (ragged rows)",
            r"field 'x' is a list of tensors; .*torch\.nested\.nested_tensor\(\[\.\.\.\], layout=torch\.jagged\).*torch\.stack",
        ),
        (
            "int field",
            r"field 'x' is of type int; a field holds one row per sample: a tensor .* a jagged nested tensor .* a list",
        ),
        ("int field after a tensor", r"field 'x' is of type int; a field holds one row per sample"),
    ],
)
def test_a_value_that_is_no_field_is_named_with_what_a_field_holds(client, name, says):
    with pytest.raises(tq.SchemaError, match=says):
        BAD_PUTS[name](client)


def test_chunk_zero_is_a_schema_error(client):
    meta = client.put(_td(4))
    with pytest.raises(tq.SchemaError, match=">= 1"):
        meta.chunk(0)
    parts = meta.chunk(chunks=3)  # TransferQueue's name for it; verl passes it by keyword
    assert [len(m) for m in parts] == [2, 1, 1]
    assert [i for m in parts for i in m.indexes] == meta.indexes


def test_unknown_field_of_a_sealed_empty_partition_is_a_schema_error_at_once(client):
    """No put can bring a field to a sealed partition without samples: new samples are refused
    and new columns need samples. Anywhere else an unknown field may still come (below)."""
    meta = client.put(_td(2), partition="done")
    client.seal("done")
    client.clear(meta)
    started = time.monotonic()
    with pytest.raises(tq.SchemaError, match=r"\['nope'\] that partition 'done' never had"):
        client.get_meta(["nope"], 1, task="t", partition="done", timeout=30)
    assert time.monotonic() - started < 5


def test_unknown_field_is_named_at_the_deadline(client):
    client.put(_td(2))
    with pytest.raises(tq.TimeoutError, match=r"\['nope'\] that no put has brought yet"):
        client.get_meta(["nope"], 1, task="t", timeout=0.5)
    # a field that a later put brings (here: new columns of the same samples) is waited for
    meta = client.get_meta(["x"], 2, task="writer", timeout=5)
    client.seal("train")
    with ThreadPoolExecutor(1) as pool:

        def wait_for_y():
            with tq.connect(client.address) as other:
                return other.get_meta(["y"], 2, task="t", timeout=30)

        later = pool.submit(wait_for_y)
        client.put(TensorDict({"y": torch.ones(2, 1)}, batch_size=[2]), meta=meta)
        assert len(later.result(30)) == 2


def test_invalid_utf8_is_a_counted_protocol_error(cluster, client):
    channel = peer(cluster.address)
    body = msgspec.msgpack.encode({"op": "lookup", "key": "k"}).replace(b"\xa1k", b"\xa1\xff")
    before = client.status()["counters"]["requests_rejected"]
    for i in range(20):
        rid, reply, _ = raw(channel, [pack_prefix(i), body])
        assert reply.code == "protocol" and "undecodable" in reply.message, reply
        assert rid == i  # answered under its own id: the caller's wait ends with this error
    channel.close()
    assert client.status()["counters"]["requests_rejected"] == before + 20
