"""Peers of another release on one cluster (a rolling upgrade): the messages the local lane
changed (`Hello`, `HelloReply`, `RegisterUnit`'s answer) in the shapes peers before the lane
decode, and theirs in ours. Every peer refuses a field it does not know (`_Before` below is
the `Message` of those before the lane; ours also sends no field at its default), so a new field
or reply type reaches a peer only when its request asked for it."""

from __future__ import annotations

from typing import Union

import msgspec
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from transfer_queue.wire.errors import ProtocolError
from transfer_queue.wire.messages import (
    FEATURES,
    LANE,
    LEASE,
    Ack,
    ClusterConfig,
    Free,
    Hello,
    HelloReply,
    MetaReply,
    Nack,
    Registered,
    RegisterUnit,
    Reply,
    StorageRequest,
    UnitInfo,
)
from transfer_queue.wire.rpc import Channel, Codec, Ok, error_reply, pack_prefix

# -- the shapes of a release before the local lane (09c9613) --------------------------------


class _Before(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


class OldOk(_Before, tag="ok", frozen=True):
    pass


class OldErrorReply(_Before, tag="error", frozen=True):
    code: str
    message: str


class OldHello(_Before, tag="hello", frozen=True):
    pass


class OldUnitInfo(msgspec.Struct, frozen=True):
    unit_id: int
    address: str
    capacity: int
    shm_path: str = ""
    host_id: str = ""


class OldRegisterUnit(_Before, tag="register_unit", frozen=True):
    unit: OldUnitInfo
    secret: str = ""


class OldHelloReply(_Before, tag="hello_reply", frozen=True):
    cluster_id: str
    config: ClusterConfig
    units: list[OldUnitInfo]
    version: int


OldReply = Union[OldOk, OldErrorReply, OldHelloReply]
"""What a unit or client before the lane decodes of the controller's answers (those used here)."""

OldRequest = Union[OldHello, OldRegisterUnit]
"""What a controller before the lane decodes of these requests."""

CONFIG = ClusterConfig(num_storage_units=1, storage_capacity=1 << 30)


def _as(kind: object, msg: msgspec.Struct) -> object:
    return msgspec.msgpack.Decoder(kind).decode(msgspec.msgpack.encode(msg))


# -- struct shapes, both ways ---------------------------------------------------------------


def test_hello_and_its_reply_decode_both_ways_unless_features_are_asked_for():
    assert _as(OldRequest, Hello()) == OldHello()  # a client that cannot ask is understood
    assert _as(Hello, OldHello()) == Hello(features=[])
    with pytest.raises(msgspec.ValidationError, match="features"):  # why the client asks again without
        _as(OldRequest, Hello([LANE]))
    plain = HelloReply("c", CONFIG, [UnitInfo(0, "tcp://h:1", 1, local="local:u")], 3)
    assert _as(OldReply, plain) == OldHelloReply("c", CONFIG, [OldUnitInfo(0, "tcp://h:1", 1)], 3)
    assert _as(HelloReply, OldHelloReply("c", CONFIG, [], 3)) == HelloReply("c", CONFIG, [], 3, "", "", [])
    with pytest.raises(msgspec.ValidationError, match="host_id"):  # why only a client that asks gets them
        _as(OldReply, HelloReply("c", CONFIG, [], 3, "host", "local:c", [LANE]))


def test_register_unit_and_its_answers_decode_both_ways():
    unit = UnitInfo(0, "tcp://h:1", 1, "/dev/shm/a", "host", "local:u")
    assert _as(OldRequest, RegisterUnit(unit, "s")) == OldRegisterUnit(
        OldUnitInfo(0, "tcp://h:1", 1, "/dev/shm/a", "host"), "s"
    )
    assert _as(RegisterUnit, OldRegisterUnit(OldUnitInfo(0, "a", 1), "s")) == RegisterUnit(UnitInfo(0, "a", 1), "s")
    assert _as(Reply, OldOk()) == Ok()  # what a controller before the lane answers a new unit
    with pytest.raises(msgspec.ValidationError, match="registered"):  # why only a unit with a lane gets it
        _as(OldReply, Registered("host", "local:c"))


def test_a_field_the_receiver_does_not_know_is_a_protocol_error():
    """A misspelt field is refused, not dropped: dropped, `Free(indices=...)` would free the
    whole partition and `CommitWrite(abrt=True)` would commit instead of aborting."""
    for union, body in [
        (StorageRequest, {"op": "free", "partition": "p", "indices": [1]}),
        (StorageRequest, {"op": "commit_write", "token": 3, "abrt": True}),
        (Reply, {"op": "registered", "host_id": "h", "local": "local:c", "added_later": [1, 2]}),
    ]:
        with pytest.raises(ProtocolError, match="unknown field") as refused:
            Codec(union).decode([pack_prefix(5), msgspec.msgpack.encode(body)])
        assert refused.value.request_id == 5


def test_a_field_at_its_default_is_not_sent():
    """What lets a peer of the release before decode a message that gained a field."""
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(Free("p"))) == {"op": "free", "partition": "p"}


# -- a controller of this release and peers of the one before -----------------------------


def test_a_client_before_the_lane_says_hello_to_this_controller(cluster):
    """Over a real controller: the hello of a client before the lane gets the reply it knows."""
    channel = Channel(cluster.address, Codec(OldReply), timeout=10)
    try:
        hello = channel.call(OldHello())
        assert isinstance(hello, OldHelloReply) and [u.unit_id for u in hello.units] == [0, 1]
    finally:
        channel.close()


def test_a_unit_before_the_lane_registers_with_this_controller(cluster):
    """Over a real controller: a unit before the lane (unit 0 coming back) is answered with the
    `Ok` it knows."""
    channel = Channel(cluster.address, Codec(OldReply), timeout=10)
    ours = Channel(cluster.address, Codec(Reply), timeout=10)
    try:
        unit = ours.call(Hello()).units[0]
        old = OldUnitInfo(unit.unit_id, unit.address, unit.capacity, unit.shm_path, unit.host_id)
        assert isinstance(channel.call(OldRegisterUnit(old, cluster.secret)), OldOk)
    finally:
        channel.close()
        ours.close()


def test_a_unit_with_a_lane_is_told_the_controllers(cluster):
    channel = Channel(cluster.address, Codec(Reply), timeout=30)
    try:
        hello = channel.call(Hello([LANE]))
        assert hello.features == [LANE] and hello.local.startswith("local:") and hello.host_id
        unit = hello.units[0]
        assert unit.local.startswith("local:")
        assert channel.call(RegisterUnit(unit, cluster.secret)) == Registered(hello.host_id, hello.local)
        assert channel.call(Hello()) == HelloReply(hello.cluster_id, hello.config, hello.units, hello.version)
    finally:
        channel.close()


def test_the_controller_grants_only_the_features_it_supports(cluster):
    """A client of a later release asks for features this controller does not know: they are
    not granted (nor refused), so that client sends none of their fields."""
    channel = Channel(cluster.address, Codec(Reply), timeout=30)
    try:
        assert channel.call(Hello([LANE, "from_a_later_release"])).features == [LANE]
        later = channel.call(Hello(["from_a_later_release"]))
        assert later.features == [] and later.local == "" and later.host_id == ""
    finally:
        channel.close()
    with tq.connect(cluster.address) as client:
        assert client._core.features == FEATURES


def test_an_old_controllers_refusal_of_the_features_question_is_a_protocol_error_for_that_hello():
    """A controller before features answers `Hello(features=...)` as any message it cannot
    decode: a `ProtocolError` reply to that request, which the client's hello takes as "no
    features" (test_flows: it says hello again without asking)."""
    with pytest.raises(ProtocolError) as refused:
        Codec(OldRequest).decode(Codec(Reply).encode(7, Hello([LANE])))
    assert refused.value.request_id == 7 and error_reply(refused.value).code == "protocol"


def test_acks_name_their_lease_only_to_a_controller_that_granted_it(cluster):
    """`Ack.lease_id` and `Nack.lease_id` are fields a controller before `LEASE` refuses: a
    client names the lease only where it was granted, and elsewhere sends neither field (the
    old behaviour: the ack ends whatever lease holds the samples)."""
    with tq.connect(cluster.address) as client:
        client.put(TensorDict({"x": torch.arange(4)}, batch_size=[4]))
        meta = client.get_meta(["x"], 4, task="t", timeout=5)
        assert LEASE in client._core.features and meta.lease_id != 0
        for flow in (client._core.ack(meta), client._core.nack(meta), client._core.undo(MetaReply(meta))):
            msg = flow if isinstance(flow, (Ack, Nack)) else next(flow)[0].msg
            assert msg.lease_id == meta.lease_id
        client._core.features = FEATURES - {LEASE}  # what a controller of the release before grants
        for flow in (client._core.ack(meta), client._core.nack(meta), client._core.undo(MetaReply(meta))):
            msg = flow if isinstance(flow, (Ack, Nack)) else next(flow)[0].msg
            assert msg.lease_id == 0 and b"lease_id" not in Codec(Reply).encode(1, msg)[1]
        client.ack(meta)  # without its lease, as before
        assert client.status()["partitions"]["train"]["tasks"]["t"]["consumed"] == 4
