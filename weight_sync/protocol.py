"""The weight channel's control plane: its messages, and its client and server over the kernel.

Every publisher rank runs one `rpc.ThreadService` (in a thread of the trainer process). Rank 0
is the coordinator: it knows when a version is complete on every rank, records it in the
controller, and answers `Latest`. Subscribers ask each rank for a `Lease` on a version (which
pins its staging slot) and `Release` it when they have read it; tensor bytes never travel here
(see `transports/`). One tagged union of frozen `rpc.Message` structs; replies are the kernel's
`Ok` and `ErrorReply` plus the few below; nothing is ever pickled. Beyond loopback the control
endpoint is a CurveZMQ server like every data-plane service (`credentials`).

Requests, and what answers them::

    Join(info)                       rank r -> coordinator: here are my endpoints      Ok
    Staged(rank, version, complete)  rank r -> coordinator: I started / finished v     Ok
    Latest(after, complete, timeout, newest version > after (parked until one exists)  Offer
           lease)                    and, with `lease`, rank 0's lease on it
    Confirm(version, timeout)        wait until `version` is complete on every rank    Ok
    Lease(version, ...)              pin the slot holding `version` on this rank       Granted
    Release(lease)                   done reading                                      Ok (error: its slot was staged again, or already released)
    Describe(manifest)               the manifest with this id                         Described
    Slots(transport)                 the slots made so far, described for it, the      SlotList
                                     manifest they were made for, and why the rank
                                     stopped serving it, if it did
    Verify(lease, reads)             checksums of these boxes of the staged snapshot   Checksums
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

import msgspec

from transfer_queue import WeightSyncError
from transfer_queue.wire.rpc import (
    DEAD_AFTER,
    Cancel,
    Channel,
    Codec,
    Credentials,
    ErrorReply,
    LocalChannel,
    Message,
    Ok,
    Pending,
    Ping,
    ThreadService,
    credentials_from_env,
)

from .manifest import Manifest
from .plan import Read

__all__ = [
    "RankInfo",
    "SlotInfo",
    "Join",
    "Staged",
    "Latest",
    "Confirm",
    "Lease",
    "Release",
    "Describe",
    "Slots",
    "Verify",
    "Ok",
    "Offer",
    "Granted",
    "Described",
    "SlotList",
    "Checksums",
    "Pull",
    "RelayPull",
    "Pending",
    "RpcClient",
    "LocalClient",
    "connect",
    "serve",
    "Request",
    "directory_key",
]


def directory_key(name: str) -> str:
    """The controller key under which channel `name`'s coordinator announces its `RankInfo`."""
    return f"weight_sync/{name}"


class RankInfo(msgspec.Struct, frozen=True):
    """Where one publisher rank (or a relaying subscriber) can be reached."""

    rank: int
    world_size: int
    host: str
    """Host identity (hostname and boot id): equal hosts may share memory."""
    control: str
    """ZeroMQ endpoint of the rank's `RpcServer`."""
    data: dict[str, str] = {}
    """Transport name -> endpoint of that transport's data server."""
    local: str = ""
    """The control server's local lane (`rpc.ThreadService.local_endpoint`), for subscribers
    on `host`; "" when it has none."""
    lease_timeout: float = 0.0
    """How long a lease on this rank's slots lasts unless renewed or released (0: not told): a
    reader done within it of asking for its lease needs no word from the rank that its slot
    held (`PublisherRanks.release`)."""


class SlotInfo(msgspec.Struct, frozen=True):
    """A staging slot: co-located readers map `path` (empty when not shareable); `handle` is
    what the lease's transport needs to reach the slot (`Transport.describe`: a NIXL agent's
    metadata and the slot's address, CUDA IPC handles), empty for the others."""

    index: int
    generation: int
    size: int
    path: str = ""
    handle: bytes = b""


_Msg = Message


class Join(_Msg, tag="join", frozen=True):
    info: RankInfo


class Staged(_Msg, tag="staged", frozen=True):
    rank: int
    version: int
    complete: bool


class Latest(_Msg, tag="latest", frozen=True):
    """The newest version above `after`: only complete ones, or also one being staged.

    `lease` names a "map" transport: a complete offer then carries rank 0's lease on its slot,
    granted as for a `Lease` with that transport (one round trip less per version; the other
    ranks are still asked), also when the request waited for the version: the lease is the
    requesting connection's, released when that connection closes."""

    after: int
    complete: bool = True
    timeout: float = 0.0
    lease: str = ""


class Confirm(_Msg, tag="confirm", frozen=True):
    version: int
    timeout: float = 30.0


class Lease(_Msg, tag="lease", frozen=True):
    """Pin `version`'s slot (waiting up to `timeout` for this rank to start staging it).
    `transport`, `plan`, `relay`: the transport the subscriber pulls with, the digest of its
    reads and the endpoint where it re-serves them (relay trees); `direct` refuses a relay."""

    version: int
    transport: str = ""
    plan: int = 0
    relay: str = ""
    direct: bool = False
    timeout: float = 30.0


class Release(_Msg, tag="release", frozen=True):
    lease: int


class Describe(_Msg, tag="describe", frozen=True):
    manifest: int


class Slots(_Msg, tag="slots", frozen=True):
    """Which slots exist, described for `transport`: a co-located subscriber opens them before
    the first version, so its first apply does not pay for mapping and registering them."""

    transport: str


class Verify(_Msg, tag="verify", frozen=True):
    lease: int
    reads: list[Read]


Request = Union[Join, Staged, Latest, Confirm, Lease, Release, Describe, Slots, Verify, Cancel, Ping]


class Granted(_Msg, tag="granted", frozen=True):
    """`source`: pull from this relay endpoint instead of the rank ("" = the rank itself);
    `base`: the version the rank can send a delta against (-1: whole only)."""

    lease: int
    version: int
    manifest: int
    slot: SlotInfo
    source: str = ""
    base: int = -1


class Offer(_Msg, tag="offer", frozen=True):
    """`granted`: rank 0's lease on `version`, when `Latest.lease` asked for it and the slot
    could be pinned (None: lease it with `Lease`)."""

    version: int
    complete: bool
    ranks: list[RankInfo]
    granted: Granted | None = None


class Described(_Msg, tag="described", frozen=True):
    manifest: Manifest


class SlotList(_Msg, tag="slot_list", frozen=True):
    """`manifest`: the id of the manifest the slots were made for (0: none yet); `stopped`:
    why the rank no longer serves the transport asked about ("": it does), e.g. its GPU
    staging beside host staging ran out of memory (`gpu_mirror`)."""

    slots: list[SlotInfo]
    manifest: int = 0
    stopped: str = ""


class Checksums(_Msg, tag="checksums", frozen=True):
    """xxh3-64 of each requested box; `corrupt`: staged tensors that changed since staging."""

    values: list[int]
    corrupt: list[str] = []


Reply = Union[Ok, ErrorReply, Offer, Granted, Described, SlotList, Checksums]

# -- data plane (stream transports): one request, then the reads' bytes back to back --------


class _Data(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


class Pull(_Data, tag="pull", frozen=True):
    """Send these reads of the slot pinned by `lease`, each as its box's contiguous bytes; with
    a `base` (>= 0), as delta frames against that version (`stream.delta_frames`)."""

    lease: int
    version: int
    reads: list[Read]
    base: int = -1


class RelayPull(_Data, tag="relay", frozen=True):
    """Send what you pulled of `version` from `rank`, for a plan with this digest; with a
    `base` (>= 0), as delta frames against that version: the frames the relay received when
    it pulled a delta against the same base, else its bytes as WHOLE frames."""

    version: int
    rank: int
    plan: int
    base: int = -1


DataRequest = Union[Pull, RelayPull]
DATA_DECODER = msgspec.msgpack.Decoder(DataRequest)
DATA_ENCODER = msgspec.msgpack.Encoder()


def serve(
    handler: Callable[[Any, Pending], None],
    bind: str,
    credentials: Credentials | None,
    on_disconnect: Callable[[bytes], None] | None = None,
    local: bool = False,
) -> ThreadService:
    """This rank's control server: `handler(msg, pending)` runs in its thread (see
    `rpc.ThreadService`), and so does `on_disconnect(peer)` when a client's connection
    closes; with `credentials` a CurveZMQ server admitting the cluster's clients; with `local`
    also a local lane for subscribers on this host (`connect`).

    Raises:
        SchemaError: `bind` is beyond loopback and no `credentials` were given.
    """
    return ThreadService(
        Codec(Request), handler, bind, credentials, name="sluice-ws-rpc", on_disconnect=on_disconnect, local=local
    )


def connect(
    info: RankInfo, here: str, timeout: float, credentials: Credentials | None = None
) -> RpcClient | LocalClient:
    """A control client to rank `info`, from a process on host `here`: over the rank's local
    lane when it has one and is on this host (one thread wake per message, not three), else
    over ZeroMQ with `credentials` (also when the lane cannot be reached: the rank is gone,
    which the first call over ZeroMQ reports as `WeightSyncError`)."""
    if info.local and info.host == here:
        try:
            return LocalClient(info.local, timeout=timeout)
        except WeightSyncError:
            pass
    return RpcClient(info.control, timeout=timeout, credentials=credentials)


class RpcClient(Channel):
    """A kernel channel to one rank's control server, used from one thread: `call(msg)` returns
    the reply and raises an `ErrorReply` as the Sluice error it names. A peer that is not
    reachable, drops the connection while a call waits (noticed at once) or does not answer in
    time raises `WeightSyncError`. `credentials` default to `SLUICE_CREDENTIALS` (as the
    publisher's do). A first request waits up to `connect_timeout` for its connection, as
    long as a silent peer is given (`DEAD_AFTER`): under CurveZMQ the publisher's handshake
    needs its Python credentials thread, which a trainer's GIL-holding threads can delay by
    seconds (benchmarks/connect_under_load.py)."""

    def __init__(
        self,
        endpoint: str,
        timeout: float = 10.0,
        connect_timeout: float = DEAD_AFTER,
        credentials: Credentials | None = None,
    ):
        super().__init__(
            endpoint,
            Codec(Reply),
            name=f"the publisher at {endpoint}",
            credentials=credentials if credentials is not None else credentials_from_env(),
            timeout=timeout,
            connect_timeout=connect_timeout,
            lost=WeightSyncError,
            late=WeightSyncError,
            watch_disconnect=True,
        )


class LocalClient(LocalChannel):
    """`RpcClient`'s calls over a rank's local lane (`connect`): a peer that is gone, or drops
    the connection while a call waits, or does not answer in time raises `WeightSyncError`."""

    def __init__(self, endpoint: str, timeout: float = 10.0, connect_timeout: float = 2.0):
        super().__init__(
            endpoint,
            Codec(Reply),
            name=f"the publisher at {endpoint}",
            timeout=timeout,
            connect_timeout=connect_timeout,
            lost=WeightSyncError,
            late=WeightSyncError,
        )
