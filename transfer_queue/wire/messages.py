"""The wire messages: one tagged union of frozen msgspec structs per service.

Controller and storage units each decode exactly one union (`ControllerRequest`,
`StorageRequest`) and answer with a `Reply`. Tensor bytes never appear here: they travel as
separate raw frames after the message (see `rpc`, which also defines the messages every
service shares: `Cancel`, `Ping`, `Ok`, `ErrorReply`). Messages evolve as `rpc.Message` says: a
new field of a request goes only to a controller that granted its feature (`FEATURES`, asked for
in `Hello`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from .meta import BatchMeta, FieldSpec
from .rpc import Cancel, ErrorReply, Message, Ok, Ping
from .staleness import Checked, StalenessConfig

__all__ = [
    "LANE",
    "LEASE",
    "FIELD_BYTES",
    "FEATURES",
    "ClusterConfig",
    "UnitInfo",
    "RowInfo",
    "Cancel",
    "Ping",
    # controller requests
    "Hello",
    "RegisterUnit",
    "Registered",
    "BeginPut",
    "CommitPut",
    "WriteLanded",
    "AbortPut",
    "GetMeta",
    "Ack",
    "Nack",
    "Clear",
    "ClearPartition",
    "Seal",
    "SetVersion",
    "WaitVersion",
    "Acquire",
    "Release",
    "Status",
    "Announce",
    "Lookup",
    "KvResolve",
    "KvTag",
    "KvList",
    "KvKeys",
    "KvClear",
    "Export",
    "ControllerRequest",
    # storage requests
    "Write",
    "CommitWrite",
    "Read",
    "Free",
    "UnitStatus",
    "StorageRequest",
    # replies
    "Ok",
    "ErrorReply",
    "HelloReply",
    "PutPlan",
    "MetaReply",
    "VersionReply",
    "GrantReply",
    "StatusReply",
    "LookupReply",
    "KvMetaReply",
    "KvListReply",
    "KvKeysReply",
    "WriteReply",
    "ReadReply",
    "ExportReply",
    "ExportRows",
    "Reply",
]

StalePolicy = Literal["drop", "keep", "requeue"]


class ClusterConfig(StalenessConfig, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Settings shared by the controller and every client of a cluster: the staleness settings
    it extends, plus storage, timeouts and serving. Bounds are `msgspec.Meta` on the fields
    (checked when built and when decoded; `SchemaError` when built)."""

    num_storage_units: Annotated[int, msgspec.Meta(gt=0)] = 2
    storage_capacity: Annotated[int, msgspec.Meta(gt=0)] = 2 << 30
    """Total bytes across all units (each unit holds an equal share)."""
    lease_timeout: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    grant_timeout: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    stale_policy: StalePolicy = "drop"
    samplers: tuple[str, ...] = ()
    """Extra samplers as "module:Class" import paths, loaded by the controller."""
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    host: str = "127.0.0.1"
    journal: str | None = None
    """Path of the controller's journal: a restarted controller replays it and loses no acked put."""


class UnitInfo(msgspec.Struct, frozen=True):
    """Where a storage unit listens and how a co-located client maps its arena."""

    unit_id: int
    address: str
    capacity: int
    shm_path: str = ""
    host_id: str = ""
    local: str = ""
    """The unit's local lane (`rpc.Service.local_endpoint`), for clients on host `host_id`."""


class RowInfo(msgspec.Struct, frozen=True):
    """Per-sample facts a producer records with new rows."""

    versions_first: list[int]
    versions_last: list[int]
    groups: list[int]
    seqlens: list[int]
    grant_id: int = 0
    source_partition: str = ""
    source_task: str = ""
    source_indexes: list[int] = []
    versioned: bool = True
    """False: put with no policy version and no grant (e.g. prompts); such rows are never stale."""


MAX_TIMEOUT = 1e9
"""The longest wait a request may ask for, in seconds (about 31 years: "forever", but a number)."""

Timeout = Annotated[float, msgspec.Meta(ge=0, le=MAX_TIMEOUT)]
"""Seconds a request may wait. NaN (a timer that never fires), negative and infinite waits are
refused: by `SchemaError` where the message is built, by `ProtocolError` where it is decoded."""


LeaseId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
"""A lease's id (`BatchMeta.lease_id`), 0 for none: the controller's lease columns are int64, so
a larger one is refused like a bad `Timeout`, never compared there."""


class _Msg(Message, Checked, frozen=True):
    """A request whose field bounds (`Timeout`, ...) hold when built in Python as on the wire."""


# -- features ----------------------------------------------------------------------------


LANE = "lane"
"""Feature: the controller names its host and local lane (`HelloReply.host_id`, `.local`)."""
LEASE = "lease"
"""Feature: the controller reads the lease an `Ack` or `Nack` ends (`lease_id`)."""
FIELD_BYTES = "field_bytes"
"""Feature: the controller accounts a put by each field's bytes (`BeginPut.field_bytes`,
`CommitPut.field_bytes`)."""
FEATURES = frozenset({LANE, LEASE, FIELD_BYTES})
"""The features of this release: what a client asks for in `Hello` and the controller grants
(`HelloReply.features`). A feature gates what a peer of the release before could not decode: a
new field of a request goes only to a controller that granted its feature (the client core's
`features`), a new field of the hello's reply only to a client that asked for it."""


# -- controller requests -----------------------------------------------------------------


class Hello(_Msg, tag="hello", frozen=True):
    """Ask for the cluster's configuration, units and version, and for `features`: those of
    `FEATURES` the client knows. A controller before features refuses the field (`ProtocolError`):
    the client says hello again without it and uses none."""

    features: list[str] = []


class RegisterUnit(_Msg, tag="register_unit", frozen=True):
    """Join the cluster (or come back after a restart); refused without the cluster's secret."""

    unit: UnitInfo
    secret: str = ""


class BeginPut(_Msg, tag="begin_put", frozen=True):
    """Validate the schema and place `n` new rows (new columns of existing rows need none: their
    `CommitPut` checks and accounts for them)."""

    partition: str
    fields: dict[str, FieldSpec]
    n: int
    row_bytes: int
    timeout: Timeout = 30.0
    """The put's own timeout: new rows not committed within 2 x timeout + a grace expire."""
    mapped: list[int] = []
    """Units the producer writes through its own mapping of their arenas (no data frames)."""
    stay: int = -1
    """The unit of the producer's previous put, which a small put keeps to while that unit is not
    far ahead of the others (`controllers.placement`); -1: none."""
    now: bool = False
    """Place the put now or not at all (an empty `PutPlan`) instead of waiting for room: its
    producer holds arena space reserved ahead of the plan (`Write.ahead`), which it must not
    hold while the put waits for room the controller does not know it holds."""
    field_bytes: dict[str, int] = {}
    """Each field's arena bytes per row (its bytes over the put's rows / `n`, rounded up), which
    add up to `row_bytes`: the controller counts each field's, so that writing a field again
    replaces its bytes. Sent only to a controller that granted `FIELD_BYTES`; {}: an older
    client, whose `row_bytes` the controller splits by the fields' specs (`ledger.field_sizes`)."""


class CommitPut(_Msg, tag="commit_put", frozen=True):
    """Mark `fields` ready for `indexes`. With `rows`, it registers the new rows of an open put,
    once every unit of the put reported its write stored (it may be sent with the writes);
    without, the fields are new columns of existing rows the units already hold (checked against
    the schema here, `row_bytes` more per row)."""

    partition: str
    indexes: list[int]
    fields: dict[str, FieldSpec]
    rows: RowInfo | None = None
    row_bytes: int = 0
    field_bytes: dict[str, int] = {}
    """New columns: each one's bytes per row, as `BeginPut.field_bytes` (and gated the same way)."""


class WriteLanded(_Msg, tag="write_landed", frozen=True):
    """From a storage unit: its write of `indexes` for open put `put` (`Write.put`) was stored
    (`code` empty) or failed with the error `code`/`message`. A notice: the controller answers
    only a refusal. Carries the cluster secret, so only a unit can report; the controller takes a
    report only when `indexes` are exactly the put's rows on that unit."""

    unit_id: int
    partition: str
    put: int
    indexes: list[int]
    secret: str
    code: str = ""
    message: str = ""


class AbortPut(_Msg, tag="abort_put", frozen=True):
    partition: str
    indexes: list[int]


class GetMeta(_Msg, tag="get_meta", frozen=True):
    partition: str
    task: str
    fields: list[str]
    batch_size: int
    sampler: str = "fifo"
    sampler_options: dict[str, int | float | str] = {}
    max_staleness: int | None = None
    timeout: Timeout = 30.0
    allow_partial: bool = False
    lease_timeout: Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT)] | None = None


class Ack(_Msg, tag="ack", frozen=True):
    """Mark `indexes` consumed by `task`. With the `lease_id` the samples were handed out under
    (`BatchMeta.lease_id`), samples leased again to another consumer since that lease expired
    are left to it (`LeaseExpiredError`); 0 (a meta built or merged by hand, an older client)
    acks them whatever lease they are under. Last, with a default: older clients still decode."""

    partition: str
    task: str
    indexes: list[int]
    lease_id: LeaseId = 0


class Nack(_Msg, tag="nack", frozen=True):
    """Give `indexes` back to `task`'s ready pool. With a `lease_id`, only the samples still
    under that lease go back (a late nack leaves another consumer's lease alone); 0 gives back
    every unconsumed one, whatever lease it is under."""

    partition: str
    task: str
    indexes: list[int]
    lease_id: LeaseId = 0


class Clear(_Msg, tag="clear", frozen=True):
    partition: str
    indexes: list[int]


class ClearPartition(_Msg, tag="clear_partition", frozen=True):
    partition: str


class Seal(_Msg, tag="seal", frozen=True):
    partition: str


class SetVersion(_Msg, tag="set_version", frozen=True):
    version: int


class WaitVersion(_Msg, tag="wait_version", frozen=True):
    """Answer once the version exceeds `after`, with every version set since, in order."""

    after: int
    timeout: Timeout = 30.0


class Acquire(_Msg, tag="acquire", frozen=True):
    n: int
    timeout: Timeout = 30.0


class Release(_Msg, tag="release", frozen=True):
    grant_id: int
    n: int


class Status(_Msg, tag="status", frozen=True):
    pass


class Announce(_Msg, tag="announce", frozen=True):
    """Publish a small value under `key` (e.g. a weight publisher's endpoint)."""

    key: str
    value: bytes


class Lookup(_Msg, tag="lookup", frozen=True):
    key: str
    timeout: Timeout = 0.0


# -- the key index (TransferQueue's KV API): user keys and tags over global indexes ----------

Tags = dict[str, Any]
"""A key's tags: msgpack-typed metadata (None, bool, int, float, str, lists and dicts of them)."""


class KvResolve(_Msg, tag="kv_resolve", frozen=True):
    """The samples of `keys` in `partition`, in key order. `create=True` gives keys the partition
    lacks new rows (no fields yet); otherwise a missing key is a `SchemaError` naming it."""

    partition: str
    keys: list[str]
    create: bool = False


class KvTag(_Msg, tag="kv_tag", frozen=True):
    """Merge `tags[i]` into the tags of `keys[i]` (dict update), after their data is written."""

    partition: str
    keys: list[str]
    tags: list[Tags]


class KvList(_Msg, tag="kv_list", frozen=True):
    """Every live key with its tags, of one partition (or of all when `partition` is None)."""

    partition: str | None = None


class KvKeys(_Msg, tag="kv_keys", frozen=True):
    """The keys of global `indexes` of `partition` (`SchemaError` for an index without a key)."""

    partition: str
    indexes: list[int]


class KvClear(_Msg, tag="kv_clear", frozen=True):
    """Delete `keys` and their samples (keys the partition lacks are ignored)."""

    partition: str
    keys: list[str]


class Export(_Msg, tag="export", frozen=True):
    """A partition's committed samples, for a checkpoint (answered with `ExportReply`)."""

    partition: str


ControllerRequest = Union[
    Cancel,
    Hello,
    RegisterUnit,
    BeginPut,
    CommitPut,
    WriteLanded,
    AbortPut,
    GetMeta,
    Ack,
    Nack,
    Clear,
    ClearPartition,
    Seal,
    SetVersion,
    WaitVersion,
    Acquire,
    Release,
    Status,
    Announce,
    Lookup,
    KvResolve,
    KvTag,
    KvList,
    KvKeys,
    KvClear,
    Ping,
    Export,
]

# -- storage requests --------------------------------------------------------------------

Via = Literal["frames", "shm"]


class Write(_Msg, tag="write", frozen=True):
    """Store rows. `via="frames"`: one frame per field follows (rows in `indexes` order, ragged
    values concatenated). `via="shm"`: reserve space and reply with arena offsets; the client
    copies, then sends `CommitWrite`."""

    partition: str
    indexes: list[int]
    fields: dict[str, FieldSpec]
    lengths: dict[str, list[int]] = {}
    via: Via = "frames"
    timeout: Timeout = 30.0
    put: int = -1
    """The first index of the open put these rows belong to: the unit reports the write's outcome
    to the controller (`WriteLanded`), which commits the put once all its units did; -1 for new
    columns of existing rows."""
    ticket: bytes = b""
    """For an open put's rows, the controller's ticket for this unit (`PutPlan.tickets`): a unit
    registered with a controller refuses such a write without the right one."""
    ahead: bool = False
    """`via="shm"` only: space for a put not placed yet, reserved along with its `BeginPut`
    (`indexes` are placeholders, one per row, in the put's row order). Refused at once
    (`CapacityError`) when the arena has no room now, instead of waiting; its `CommitWrite`
    names the put and its rows (`CommitWrite.put`)."""


class CommitWrite(_Msg, tag="commit_write", frozen=True):
    """Register the rows of a filled reservation (`token`), or drop it (`abort`; always answered
    `Ok`). An open put's commit is a notice: the unit reports it to the controller."""

    token: int
    abort: bool = False
    put: int = -1
    """For space reserved ahead (`Write.ahead`): the first index of the open put the space now
    holds; its rows on this unit are `indexes` (in the reservation's row order), checked against
    the plan's `ticket` as a put's `Write` is. -1 for any other reservation."""
    indexes: list[int] = []
    ticket: bytes = b""


class Read(_Msg, tag="read", frozen=True):
    """Return `fields` of `indexes`: as frames, or as arena runs for a co-located client."""

    partition: str
    indexes: list[int]
    fields: list[str]
    via: Via = "frames"


class Free(_Msg, tag="free", frozen=True):
    """Drop rows (all rows of the partition when `indexes` is None); with `fields`, only those
    fields of the rows (a column put the controller refused)."""

    partition: str
    indexes: list[int] | None = None
    fields: list[str] | None = None


class UnitStatus(_Msg, tag="unit_status", frozen=True):
    pass


StorageRequest = Union[Cancel, Write, CommitWrite, Read, Free, UnitStatus, Ping]

# -- replies -----------------------------------------------------------------------------


class HelloReply(_Msg, tag="hello_reply", frozen=True):
    cluster_id: str
    config: ClusterConfig
    units: list[UnitInfo]
    version: int
    host_id: str = ""
    """The controller's host (`transfer_queue.host.host_id`); only with `LANE`."""
    local: str = ""
    """The controller's local lane (`rpc.Service.local_endpoint`), for clients on `host_id`;
    only with `LANE`."""
    features: list[str] = []
    """The features of `Hello.features` this controller supports (none sent when none asked)."""


class PutPlan(_Msg, tag="put_plan", frozen=True):
    indexes: list[int]
    units: list[int]
    tickets: dict[int, bytes] = {}
    """Unit id -> the ticket of its share of the put (`Write.ticket`)."""
    partition: str = ""
    """The put's partition: a plan its producer abandoned is aborted (`AbortPut`) at once."""


class MetaReply(_Msg, tag="meta_reply", frozen=True):
    meta: BatchMeta


class Registered(_Msg, tag="registered", frozen=True):
    """The controller took a unit's `RegisterUnit`; a unit on its host (`host_id`) sends its
    reports over its local lane (`local`, `rpc.Service.local_endpoint`). Only a unit that names
    its own lane (`UnitInfo.local`) gets it: a unit before the lane knows only `Ok`."""

    host_id: str = ""
    local: str = ""


class VersionReply(_Msg, tag="version_reply", frozen=True):
    version: int
    history: list[int] = []


class GrantReply(_Msg, tag="grant_reply", frozen=True):
    grant_id: int
    n: int
    version: int


class StatusReply(_Msg, tag="status_reply", frozen=True):
    status: dict


class LookupReply(_Msg, tag="lookup_reply", frozen=True):
    value: bytes | None


class KvMetaReply(_Msg, tag="kv_meta_reply", frozen=True):
    """`meta.fields`: the fields ready for every key; `partial`: per field ready for only some
    keys, their positions in `meta`; `tags`: each key's tags."""

    meta: BatchMeta
    tags: list[Tags]
    partial: dict[str, list[int]] = {}


class KvListReply(_Msg, tag="kv_list_reply", frozen=True):
    partitions: dict[str, dict[str, Tags]]


class KvKeysReply(_Msg, tag="kv_keys_reply", frozen=True):
    keys: list[str]


class WriteReply(_Msg, tag="write_reply", frozen=True):
    """`token`/`offsets` are set for a shm reservation (field -> arena offset)."""

    token: int = 0
    offsets: dict[str, int] = {}


class ReadReply(_Msg, tag="read_reply", frozen=True):
    """Per field: `lengths` (ragged fields, per row) and `runs` of (arena offset, nbytes) in row
    order; with frames, one frame per run follows, fields in request order."""

    lengths: dict[str, list[int]]
    runs: dict[str, list[tuple[int, int]]]


class ExportRows(msgspec.Struct, frozen=True):
    """Per-sample facts of one exported batch that `BatchMeta` does not carry."""

    versioned: list[bool]
    """False for samples put with no policy version and no grant (prompts): never stale."""
    source: list[int]
    """Index into `ExportReply.sources` of the prompt batch each sample came from; -1: none."""
    source_index: list[int]
    """The prompt's index in that partition (for the `requeue` policy); -1: none."""


class ExportReply(_Msg, tag="export_reply", frozen=True):
    """Live committed samples grouped by their ready fields (one `BatchMeta` per group, with
    its `ExportRows` in `rows`); per consumer task the indexes it consumed (leased ones are not
    consumed); sealed or not; the (partition, task) prompt sources the rows refer to."""

    batches: list[BatchMeta]
    consumed: dict[str, list[int]]
    sealed: bool
    rows: list[ExportRows] = []
    sources: list[tuple[str, str]] = []


Reply = Union[
    Ok,
    Registered,
    ErrorReply,
    HelloReply,
    PutPlan,
    MetaReply,
    VersionReply,
    GrantReply,
    StatusReply,
    LookupReply,
    WriteReply,
    ReadReply,
    KvMetaReply,
    KvListReply,
    KvKeysReply,
    ExportReply,
]
