"""A real unit process over real sockets: round trips, the shm path, and what it refuses."""

from __future__ import annotations

import mmap
import os
import pickle
import random

import msgspec
import numpy as np
import pytest
import torch
from storage_harness import UnitClient, Units

from tests.helpers import eventually
from transfer_queue.wire.errors import ProtocolError, SchemaError
from transfer_queue.wire.messages import (
    CommitWrite,
    ErrorReply,
    Free,
    Hello,
    Ok,
    Read,
    ReadReply,
    StatusReply,
    UnitStatus,
    Write,
    WriteReply,
)
from transfer_queue.wire.meta import RAGGED, FieldSpec
from transfer_queue.wire.rpc import pack_prefix

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array (no copy for contiguous tensors)."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _joined(frames: list) -> bytes:
    return b"".join(bytes(f.buffer) for f in frames)


def _split(reply: ReadReply, fields: list[str], frames: list) -> dict[str, bytes]:
    """Concatenated bytes per field from the frames of a read (one frame per run)."""
    out, i = {}, 0
    for name in fields:
        n = len(reply.runs[name])
        out[name] = _joined(frames[i : i + n])
        assert [len(f.buffer) for f in frames[i : i + n]] == [r[1] for r in reply.runs[name]]
        i += n
    assert i == len(frames)
    return out


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def test_dense_and_ragged_round_trip_every_dtype(main_client: UnitClient) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 24
    indexes = list(range(1000, 1000 + n))
    lengths = [int(x) for x in torch.randint(0, 7, (n,), generator=gen)]
    lengths[3] = 0
    tensors: dict[str, torch.Tensor] = {}
    fields: dict[str, FieldSpec] = {}
    for dtype in DTYPES:
        name = dtype_name(dtype)
        tensors[f"d_{name}"] = _random(dtype, (n, 3, 2), gen)
        fields[f"d_{name}"] = FieldSpec(name, (3, 2))
        tensors[f"r_{name}"] = _random(dtype, (sum(lengths), 5), gen)
        fields[f"r_{name}"] = FieldSpec(name, (RAGGED, 5))
    ragged_lengths = {k: lengths for k in fields if k.startswith("r_")}
    reply, _ = main_client.ok(Write("dtypes", indexes, fields, ragged_lengths), [_raw(tensors[k]) for k in fields])
    assert reply == WriteReply()

    # every row, in a shuffled order, so runs break up
    order = indexes[:]
    random.Random(1).shuffle(order)
    names = list(fields)
    reply, frames = main_client.ok(Read("dtypes", order, names))
    data = _split(reply, names, frames)
    pos = [i - 1000 for i in order]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for name, spec in fields.items():
        dtype = tensors[name].dtype
        if spec.ragged:
            assert reply.lengths[name] == [lengths[p] for p in pos]
            got = _from_bytes(data[name], dtype, (-1, 5))
            want = torch.cat([tensors[name][starts[p] : starts[p + 1]] for p in pos])
        else:
            assert name not in reply.lengths
            got = _from_bytes(data[name], dtype, (n, 3, 2))
            want = tensors[name][pos]
        assert torch.equal(got, want), name

    # a contiguous range of one Write is a single run per field
    reply, frames = main_client.ok(Read("dtypes", indexes[5:15], ["d_float32", "r_int64"]))
    assert len(reply.runs["d_float32"]) == 1 and len(frames) == 2
    main_client.ok(Free("dtypes"))


def test_rewriting_rows_replaces_them_without_growing(main_client: UnitClient) -> None:
    spec = {"x": FieldSpec("int32", (1000,))}
    main_client.ok(Write("rewrite", [1, 2], spec), [np.full(2000, 7, np.int32)])
    used = main_client.ok(UnitStatus())[0].status["used"]
    for value in (8, 9):  # an at-least-once producer retrying
        main_client.ok(Write("rewrite", [1, 2], spec), [np.full(2000, value, np.int32)])
    status = main_client.ok(UnitStatus())[0].status
    assert status["used"] == used and status["rows"]["rewrite"] == 2
    _reply, frames = main_client.ok(Read("rewrite", [2, 1], ["x"]))
    assert set(np.frombuffer(_joined(frames), np.int32)) == {9}
    with pytest.raises(SchemaError, match="holds rows of dtype int32"):
        main_client.ok(Write("rewrite", [3], {"x": FieldSpec("int64", (1000,))}), [np.zeros(1000, np.int64)])
    main_client.ok(Free("rewrite"))
    main_client.ok(Free("rewrite"))  # freeing is idempotent


def test_large_rows_round_trip_zero_copy(main_client: UnitClient) -> None:
    """Rows above ZeroMQ's copy threshold leave as zero-copy frames of the arena."""
    big = np.random.default_rng(0).integers(0, 255, size=(4, 3 << 20), dtype=np.uint8)
    main_client.ok(Write("big", [0, 1, 2, 3], {"x": FieldSpec("uint8", (3 << 20,))}), [big])
    reply, frames = main_client.ok(Read("big", [3, 0, 1], ["x"]))
    assert [r[1] for r in reply.runs["x"]] == [3 << 20, 6 << 20]
    assert _joined(frames) == big[[3, 0, 1]].tobytes()
    main_client.ok(Free("big", [0, 1, 2, 3]))
    # the freed chunk is reusable once ZeroMQ has let go of the frames
    main_client.ok(Write("big", [9], {"x": FieldSpec("uint8", (3 << 20,))}), [big[0]])
    assert main_client.ok(Read("big", [9], ["x"]))[1][0].bytes == big[0].tobytes()
    main_client.ok(Free("big"))


def test_shm_write_and_read(units: Units, main_client: UnitClient) -> None:
    x = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    ids = torch.arange(10, dtype=torch.int64)
    lengths = [1, 2, 3, 0, 4, 0]
    fields = {"x": FieldSpec("float32", (8,)), "ids": FieldSpec("int64", (RAGGED,))}
    indexes = [50, 51, 52, 53, 54, 55]
    reply, _ = main_client.ok(Write("shm", indexes, fields, {"ids": lengths}, via="shm"))
    assert reply.token > 0 and set(reply.offsets) == {"x", "ids"}
    assert main_client.ok(UnitStatus())[0].status["reservations"] == 1
    with pytest.raises(SchemaError):  # not readable before the commit
        main_client.ok(Read("shm", indexes, ["x"]))

    fd = os.open(units.main.shm_path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    try:
        arena = np.frombuffer(mm, dtype=np.uint8)
        for name, t in (("x", x), ("ids", ids)):
            raw = _raw(t)
            arena[reply.offsets[name] : reply.offsets[name] + raw.size] = raw
        assert main_client.ok(CommitWrite(reply.token))[0] == Ok()
        assert main_client.ok(UnitStatus())[0].status["reservations"] == 0

        read, frames = main_client.ok(Read("shm", [52, 50], ["ids", "x"], via="shm"))
        assert frames == [] and read.lengths == {"ids": [3, 1]}
        got = {k: b"".join(arena[o : o + n].tobytes() for o, n in runs) for k, runs in read.runs.items()}
        assert got["ids"] == _raw(ids[3:6]).tobytes() + _raw(ids[0:1]).tobytes()
        assert got["x"] == _raw(x[[2, 0]]).tobytes()
        read2, frames = main_client.ok(Read("shm", [52, 50], ["ids", "x"]))
        assert read2 == read and _split(read2, ["ids", "x"], frames) == got
        del arena

        # an aborted reservation frees its space and stores nothing
        used = main_client.ok(UnitStatus())[0].status["used"]
        reply, _ = main_client.ok(Write("shm", [60], {"x": fields["x"]}, via="shm"))
        assert main_client.ok(CommitWrite(reply.token, abort=True))[0] == Ok()
        assert main_client.ok(CommitWrite(reply.token, abort=True))[0] == Ok()  # idempotent
        with pytest.raises(SchemaError, match="no reservation"):
            main_client.ok(CommitWrite(reply.token))
        assert main_client.ok(UnitStatus())[0].status["used"] == used
        with pytest.raises(SchemaError, match=r"no row\(s\) \[60\]"):
            main_client.ok(Read("shm", [60], ["x"]))
    finally:
        mm.close()
    main_client.ok(Free("shm"))


@pytest.mark.parametrize(
    "write, frames, match",
    [
        (Write("bad", [0, 1], {"x": FieldSpec("float32", (4,))}), [b"\0" * 31], "should carry 32 bytes"),
        (Write("bad", [0, 1], {"x": FieldSpec("int8", ()), "y": FieldSpec("int8", ())}), [b"\0\0"], "1 data frame"),
        (Write("bad", [0], {"x": FieldSpec("int8", ())}), [b"\0", b"\0"], "2 data frame"),
        (Write("bad", [0, 1], {"r": FieldSpec("int8", (RAGGED,))}), [b"\0"], "needs per-row lengths"),
        (Write("bad", [0, 1], {"r": FieldSpec("int8", (RAGGED,))}, {"r": [1]}), [b"\0"], "1 lengths for 2 rows"),
        (Write("bad", [0, 1], {"r": FieldSpec("int16", (RAGGED,))}, {"r": [1, 2]}), [b"\0" * 5], "should carry 6"),
        (Write("bad", [0], {"x": FieldSpec("int8", ())}, {"x": [1]}), [b"\0"], "not ragged"),
        (Write("bad", [0, 0], {"x": FieldSpec("int8", ())}), [b"\0\0"], "more than once"),
        (Write("bad", [0], {"x": FieldSpec("complex64", ())}), [b"\0" * 8], "unsupported dtype"),
        (Write("bad", [0], {"x": FieldSpec("int8", (2, -1))}), [b""], "invalid shape"),
        (Write("bad", [0], {"x": FieldSpec("int8", ())}, via="shm"), [b"\0"], "no data frames"),
    ],
)
def test_malformed_writes_are_schema_errors_and_store_nothing(
    main_client: UnitClient, write: Write, frames: list, match: str
) -> None:
    before = main_client.ok(UnitStatus())[0].status
    with pytest.raises(SchemaError, match=match):
        main_client.ok(write, frames)
    after = main_client.ok(UnitStatus())[0].status
    assert after["used"] == before["used"] and "bad" not in after["rows"]
    assert after["reservations"] == before["reservations"]


def test_reads_of_unknown_things_are_schema_errors(main_client: UnitClient) -> None:
    main_client.ok(Write("known", [0, 1], {"x": FieldSpec("int8", ())}), [b"ab"])
    with pytest.raises(SchemaError, match="no rows of partition 'unknown'"):
        main_client.ok(Read("unknown", [0], ["x"]))
    with pytest.raises(SchemaError, match="no field 'y'"):
        main_client.ok(Read("known", [0], ["y"]))
    with pytest.raises(SchemaError, match=r"no row\(s\) \[7\]"):
        main_client.ok(Read("known", [0, 7], ["x"]))
    with pytest.raises(SchemaError, match="twice"):
        main_client.ok(Read("known", [0], ["x", "x"]))
    main_client.ok(Free("known"))


class _Evil:
    """Unpickling this creates `marker`: proof that someone called pickle.loads."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_garbage_pickle_and_unknown_messages_are_refused(main_client: UnitClient, tmp_path) -> None:
    marker = str(tmp_path / "unpickled")
    payload = pickle.dumps(_Evil(marker))
    rejected = main_client.ok(UnitStatus())[0].status["rejected"]
    attempts = [
        [b"\x00garbage"],  # one frame
        [os.urandom(12), os.urandom(64)],  # random prefix
        [payload],  # a bare pickle
        [pack_prefix(41), payload],  # a pickle where the body belongs
        [pack_prefix(42), b"\xff\xfe not msgpack"],
        [pack_prefix(43), msgspec.msgpack.encode({"op": "drop_table", "partition": "x"})],  # unknown op
        [pack_prefix(44), msgspec.msgpack.encode(Hello())],  # a controller message
        [pack_prefix(45), msgspec.msgpack.encode(Read("x", [0], ["x"])), payload],  # frames on a read
        [pack_prefix(46), msgspec.msgpack.encode({"op": "read", "partition": 3})],  # wrong types
    ]
    for frames in attempts:
        _, reply, _ = main_client.send_raw(frames)
        assert isinstance(reply, ErrorReply) and reply.code == ProtocolError.code, (frames, reply)
    assert not os.path.exists(marker)
    status = main_client.ok(UnitStatus())[0]
    assert isinstance(status, StatusReply)
    assert status.status["rejected"] == rejected + len(attempts)
    # and it keeps serving real work
    main_client.ok(Write("after", [0], {"x": FieldSpec("int8", ())}), [b"z"])
    assert main_client.ok(Read("after", [0], ["x"]))[1][0].bytes == b"z"
    main_client.ok(Free("after"))


def test_a_large_field_is_served_from_its_frame_until_it_must_be_copied(units: Units, main_client: UnitClient) -> None:
    """A written field of >= 1 MiB (in a write of at most capacity / 64) is staged: read back
    from the frame it arrived in, freed without ever being copied into the arena, copied first
    when a mapped reader needs the arena's bytes, and copied oldest first when staged frames
    exceed capacity / 20."""
    big = np.random.default_rng(1).integers(0, 255, size=(8, 1 << 20), dtype=np.uint8)
    spec = {"x": FieldSpec("uint8", (1 << 20,))}

    def status() -> dict:
        return main_client.ok(UnitStatus())[0].status

    copied = status()["unstaged_bytes"]
    main_client.ok(Write("staged", [0], spec), [big[0]])
    assert status()["staged_bytes"] == 1 << 20
    _, frames = main_client.ok(Read("staged", [0], ["x"]))
    assert _joined(frames) == big[0].tobytes()
    del frames
    main_client.ok(Free("staged", [0]))
    eventually(lambda: status()["staged_bytes"] == 0, 10, "the freed frame dropped")  # once its reply left
    assert status()["unstaged_bytes"] == copied, "a freed staged field was copied"

    main_client.ok(Write("staged", [2], spec), [big[2]])
    read, _ = main_client.ok(Read("staged", [2], ["x"], via="shm"))  # a mapped reader: copied first
    assert status()["unstaged_bytes"] == copied + (1 << 20) and status()["staged_bytes"] == 0
    ((offset, n),) = read.runs["x"]
    with open(units.main.shm_path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        assert mm[offset : offset + n] == big[2].tobytes()
    finally:
        mm.close()

    limit = status()["capacity"] // 20  # 3.2 MiB: the fourth staged MiB copies the oldest
    for i in (4, 5, 6, 7):
        main_client.ok(Write("staged", [i], spec), [big[i]])
    now = status()
    assert now["staged_bytes"] == 3 << 20 <= limit and now["unstaged_bytes"] == copied + (2 << 20), now
    _, frames = main_client.ok(Read("staged", [7, 2, 5, 4, 6], ["x"]))
    assert _joined(frames) == big[[7, 2, 5, 4, 6]].tobytes()
    del frames
    main_client.ok(Free("staged"))
