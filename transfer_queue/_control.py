"""What every client shares, without torch: the controller-only flows.

A client operation is a *flow* (`_flows`): a generator that yields a list of `Call`s (sent in
parallel) and receives their decoded replies, until it returns the result. The flows are
written once (`ControlCore` here, `ClientCore` adds the data plane); `_drivers` drives them
over blocking or asyncio channels. Neither driver runs a hidden event loop or thread.
`_control_client.ControlClient` drives them for processes that have no business loading torch.
"""

from __future__ import annotations

import operator
from typing import Any

from ._flows import CONTROLLER, Call, Flow, Give, Plan, Run
from .wire.errors import SchemaError, SluiceError
from .wire.messages import (
    LEASE,
    AbortPut,
    Announce,
    CommitWrite,
    GrantReply,
    Lookup,
    LookupReply,
    MetaReply,
    Nack,
    PutPlan,
    Release,
    Reply,
    Seal,
    SetVersion,
    Status,
    StatusReply,
    UnitInfo,
    VersionReply,
    WaitVersion,
    WriteReply,
)
from .wire.meta import BatchMeta
from .wire.rpc import (
    GRACE,
    AsyncChannel,
    AsyncLocalChannel,
    Channel,
    Codec,
    Credentials,
    LocalChannel,
    Message,
    Ok,
    check,
    credentials_from_env,
)

__all__ = ["ControlCore", "as_int", "count", "INT64"]


class ControlCore:
    """The cluster's address and units, and the flows that talk to the controller only."""

    def __init__(self, address: str, credentials: Credentials | None = None, timeout: float = GRACE):
        self.address = address
        self.credentials = credentials if credentials is not None else credentials_from_env()
        """CurveZMQ keys for a cluster bound beyond loopback (default: `SLUICE_CREDENTIALS`)."""
        self.timeout = timeout
        """Seconds to wait for a reply to a request that has no timeout of its own."""
        self.codec = Codec(Reply)
        self.units: dict[int, UnitInfo] = {}
        self.lanes: dict[str, str] = {}
        """Service address -> its local lane (`rpc.LocalChannel`), for the services on this
        client's host that have one (learned on connect)."""
        self.features: frozenset[str] = frozenset()
        """The features (`wire.messages.FEATURES`) the controller granted this client on connect:
        a new field of a request goes only to a controller that granted its feature."""

    def target_address(self, target: int) -> str:
        if target == CONTROLLER:
            return self.address
        unit = self.units.get(target)
        if unit is None:
            raise SchemaError(f"unknown storage unit {target}; the cluster has {sorted(self.units)}")
        return unit.address

    def channel(self, target: int) -> Channel | LocalChannel:
        """A new blocking channel to `target` (drivers keep one per address): over its local
        lane when it is on this host and the lane can be reached, else over ZeroMQ."""
        address, options = self.target_address(target), self.channel_options(target)
        lane = self.lanes.get(address)
        if lane:
            try:
                return LocalChannel(lane, self.codec, name=options["name"], hint=options["hint"])
            except SluiceError:  # gone, not this user's, or accepting nobody: ZeroMQ decides the rest
                del self.lanes[address]
        return Channel(address, self.codec, **options)

    def async_channel(self, target: int) -> AsyncChannel | AsyncLocalChannel:
        """`channel`'s asyncio twin (call it in the event loop)."""
        address, options = self.target_address(target), self.channel_options(target)
        lane = self.lanes.get(address)
        if lane:
            try:
                return AsyncLocalChannel(lane, self.codec, name=options["name"], hint=options["hint"])
            except SluiceError:  # as in `channel`
                del self.lanes[address]
        return AsyncChannel(address, self.codec, **options)

    def channel_options(self, target: int) -> dict[str, Any]:
        name = "the controller" if target == CONTROLLER else f"storage unit {target}"
        hint = (
            " (restart the cluster)"
            if target == CONTROLLER
            else " (the controller retires it and counts its samples lost)"
        )
        return {"name": f"{name} at {self.target_address(target)}", "hint": hint, "credentials": self.credentials}

    def lease_of(self, meta: BatchMeta) -> int:
        """The lease an `Ack` or `Nack` of `meta` names: its own, or 0 (any) for a controller
        that did not grant `LEASE` (it would refuse the field)."""
        return meta.lease_id if LEASE in self.features else 0

    def undo(self, reply: Any) -> Message | None:
        """The request that gives back what an abandoned reply holds (a lease, a grant, a put's
        rows, arena space)."""
        if isinstance(reply, MetaReply) and len(reply.meta):
            meta = reply.meta
            return Nack(meta.partition, meta.task, list(meta.indexes), self.lease_of(meta))
        if isinstance(reply, GrantReply):
            return Release(reply.grant_id, reply.n)
        if isinstance(reply, WriteReply) and reply.token:  # arena space reserved for a write
            return CommitWrite(reply.token, abort=True)
        if isinstance(reply, PutPlan) and reply.indexes and reply.partition:  # a put placed, never written
            return AbortPut(reply.partition, reply.indexes)
        return None

    def one(self, target: int, msg: Message, expected: type, wait: float | None = None) -> Flow:
        """The flow of one request: its reply, checked (`rpc.check`)."""
        replies = yield [Call(target, msg, (), self.timeout if wait is None else wait)]
        return check(replies[0][0], expected)

    def seal(self, partition: str) -> Flow:
        yield from self.one(CONTROLLER, Seal(partition), Ok)

    def status(self) -> Flow:
        return (yield from self.one(CONTROLLER, Status(), StatusReply)).status

    def set_version(self, version: int) -> Flow:
        return (yield from self.one(CONTROLLER, SetVersion(count("version", version, 0)), VersionReply)).version

    def get_version(self) -> Flow:
        return (yield from self.one(CONTROLLER, WaitVersion(-1, 0.0), VersionReply)).version

    def wait_version(self, version: int, timeout: float) -> Flow:
        after = count("version", version, 0) - 1
        return (yield from self.one(CONTROLLER, WaitVersion(after, timeout), VersionReply, timeout + GRACE)).version

    def versions_after(self, after: int, timeout: float) -> Flow:
        """Every version set after `after`, oldest first, waiting up to `timeout` for one."""
        return (yield from self.one(CONTROLLER, WaitVersion(after, timeout), VersionReply, timeout + GRACE)).history

    def versions(self, after: int | None, timeout: float) -> Plan:
        """The plan of the clients' `versions`: every version set after `after` (None: the
        version when it starts), in order, none skipped."""
        if after is None:
            after = yield Run(self.get_version())
        while True:
            for version in (yield Run(self.versions_after(after, timeout))):
                yield Give(version)
                after = version

    def announce(self, key: str, value: bytes) -> Flow:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SchemaError(f"announce takes bytes, got {type(value).__name__}; encode it (e.g. str.encode())")
        yield from self.one(CONTROLLER, Announce(key, bytes(value)), Ok)

    def lookup(self, key: str, timeout: float) -> Flow:
        return (yield from self.one(CONTROLLER, Lookup(key, timeout), LookupReply, timeout + GRACE)).value


# -- argument checks shared by the flows ---------------------------------------------------

INT64 = 1 << 63


def as_int(value: Any) -> int | None:
    """`value` as an int if it is one (Python, numpy or a one-element torch integer), else None."""
    try:
        return operator.index(value)
    except TypeError:
        return None


def count(name: str, value: Any, low: int, high: int = INT64 - 1) -> int:
    """`value` as an int in low..high; `SchemaError` saying so otherwise, before anything is sent."""
    number = as_int(value)
    if number is None or not low <= number <= high:
        raise SchemaError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return number
