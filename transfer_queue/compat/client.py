"""`TransferQueueClient`: TransferQueue 0.1.11's client methods, on Sluice's own clients.

Each operation is written once, as a flow over a `ClientCore` (as Sluice's clients are, see
`_control`), and written out twice, typed: `name(...)` drives it with this thread's blocking
`Client`, `async_name(...)` with an `AsyncClient` bound to the running event loop. verl awaits the same
client from several loops (its agent loop's and its sync-to-async bridge's), so there is one
`AsyncClient` per loop and one `Client` per thread; no hidden event loop or thread. A loop's
client closes when its loop shuts down (`asyncio.run` and `loop.shutdown_asyncgens()` finalize
a guard async generator that closes it), so short-lived loops leave no reader task or socket to
the garbage collector; a loop closed without `shutdown_asyncgens` still leaves one (as any
asyncio library's background task), and `close()` closes the clients of loops still open.

Shapes follow TransferQueue: any tensor field may hold samples of different lengths from one
put to the next (a `[n, L, ...]` tensor is stored as n rows of length L), and a read returns
every field whose samples have one or more dimensions as a jagged nested tensor, even when the
lengths agree (a field of scalars stays a dense `[n]` tensor).
Non-tensor fields (`NonTensorStack`, `NonTensorData`) travel as msgpack (`_objects`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import torch
from tensordict import TensorDict

from .._async_client import AsyncClient
from .._client import Client
from .._client_core import ClientCore
from .._flows import CONTROLLER, Flow
from .._tensors import is_non_tensor, jagged
from ..wire.auth import Credentials
from ..wire.errors import ClosedError, SchemaError
from ..wire.messages import KvClear, KvKeys, KvKeysReply, KvList, KvListReply, KvMetaReply, KvResolve, KvTag, Ok
from ..wire.meta import BatchMeta
from .kv_meta import KVBatchMeta

__all__ = ["TransferQueueClient"]


_CLOSE_WAIT = 5.0
"""Seconds `close()` waits for a client of a loop running in another thread to close."""


async def _loop_guard(
    loops: dict[asyncio.AbstractEventLoop, Any], loop: asyncio.AbstractEventLoop, client: AsyncClient
) -> AsyncGenerator[None]:
    """Suspended for the life of `loop`'s client; finalized by the loop's `shutdown_asyncgens`
    (or by `close()` dropping it), it closes the client while the loop can still run its tasks."""
    try:
        yield
    finally:
        if loops.get(loop, (None,))[0] is client:
            del loops[loop]
        await client.close()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def as_rows(data: TensorDict) -> TensorDict:
    """`data` with each dense `[n, L, ...]` tensor as a jagged nested tensor of n rows of length L:
    on a put, so later puts of the same field may use another L (TransferQueue stores samples, not
    columns); on a read, because TransferQueue hands every per-sample tensor of one or more
    dimensions back jagged, whatever the lengths (verl calls `.offsets()` on what it reads)."""
    out = {}
    n = int(data.batch_size[0])
    for name, value in data.items():
        if isinstance(value, torch.Tensor) and not is_non_tensor(value) and not value.is_nested and value.dim() >= 2:
            length = value.shape[1]
            offsets = np.arange(n + 1, dtype=np.int64) * length
            value = jagged(value.reshape(n * length, *value.shape[2:]), offsets)
        out[name] = value
    return TensorDict(out, batch_size=data.batch_size)


class TransferQueueClient:
    """TransferQueue 0.1.11's `TransferQueueClient` on a Sluice cluster at `address`.

    Methods come in pairs, `name` (blocking) and `async_name`: `get_data`, `put`,
    `kv_retrieve_meta`, `kv_retrieve_keys`, `kv_list`, `clear_samples`. Errors are Sluice's
    typed errors (`SchemaError` is a `ValueError`, as TransferQueue raises for bad keys).

    One instance may be shared by threads and event loops: each thread calls through a blocking
    `Client` of its own, each loop through an `AsyncClient` of its own. `close()` may come from
    any thread: a blocking call in flight on another thread then raises `ClosedError` promptly
    (`Client`'s contract).
    """

    def __init__(self, address: str, client_id: str = "", credentials: Credentials | None = None):
        self.address = address
        self.client_id = client_id
        self.credentials = credentials
        """The cluster's client keys when it listens beyond loopback (see `tq.connect`)."""
        self._threads = threading.local()
        # Each client's reader task holds its loop, so entries leave explicitly (`_loop_guard`).
        self._loops: dict[asyncio.AbstractEventLoop, tuple[AsyncClient, AsyncGenerator[None]]] = {}
        # A loop's client while it says hello: the loop's other first callers await the same one.
        self._hellos: dict[asyncio.AbstractEventLoop, asyncio.Task[AsyncClient]] = {}
        self._connecting: dict[asyncio.AbstractEventLoop, AsyncClient] = {}  # theirs, for `close`
        self._all_sync: list[Client] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- drivers -------------------------------------------------------------------------

    def _refuse_closed(self) -> None:
        """Raises ClosedError once `close()` was called."""
        if self._closed:
            raise ClosedError("this TransferQueueClient was closed; create a new one")

    def _client(self) -> Client:
        self._refuse_closed()
        client = getattr(self._threads, "client", None)
        if client is None:
            client = Client(self.address, credentials=self.credentials)
            with self._lock:
                if not self._closed:
                    self._all_sync.append(client)
            if self._closed:  # closed as it connected
                client.close()
                self._refuse_closed()
            self._threads.client = client
        return client

    async def _async_client(self) -> AsyncClient:
        """The running loop's client, connected (`hello`) before anyone uses it: coroutines that
        make the loop's first calls together await one connect."""
        self._refuse_closed()
        loop = asyncio.get_running_loop()
        entry = self._loops.get(loop)
        if entry is not None:
            return entry[0]
        hello = self._hellos.get(loop)
        if hello is None:
            hello = self._hellos[loop] = loop.create_task(self._connect_async(loop))
            hello.add_done_callback(lambda done: (self._hellos.pop(loop, None), done.cancelled() or done.exception()))
        return await asyncio.shield(hello)  # a caller cancelled leaves the connect to the others

    async def _connect_async(self, loop: asyncio.AbstractEventLoop) -> AsyncClient:
        """A new client for `loop`, published once its hello is answered (a failed one is
        closed, and one that `close()` closed while it said hello: ClosedError)."""
        with self._lock:
            self._refuse_closed()
            client = self._connecting[loop] = AsyncClient(self.address, credentials=self.credentials)
        try:
            await client.hello()
            guard = _loop_guard(self._loops, loop, client)
            await anext(guard)  # now the loop finalizes it at shutdown_asyncgens
            with self._lock:
                if not self._closed:
                    for gone in [old for old in self._loops if old.is_closed()]:  # closed without shutdown_asyncgens
                        del self._loops[gone]
                    self._loops[loop] = client, guard
            if self._closed:
                await guard.aclose()  # closes the client
        except BaseException as exc:
            await client.close()
            if self._closed and not isinstance(exc, ClosedError):
                raise ClosedError("this TransferQueueClient was closed while it connected") from exc
            raise
        finally:
            with self._lock:
                self._connecting.pop(loop, None)
        self._refuse_closed()
        return client

    def _blocking(self, flow: Callable[..., Flow], *args: Any) -> Any:
        """Run `flow(core, *args)` on this thread's blocking `Client`."""
        client = self._client()
        return client._run(flow(client._core, *args))

    async def _awaiting(self, flow: Callable[..., Flow], *args: Any) -> Any:
        """Run `flow(core, *args)` on the running loop's `AsyncClient`."""
        client = await self._async_client()
        return await client._run(flow(client._core, *args))

    def close(self) -> None:
        """Close every thread's blocking client and the async clients of loops still open,
        those still saying hello included: at once on a loop that is not running, by a task on
        a running one (waited for up to `_CLOSE_WAIT` s when it runs in another thread). The
        client stays closed: what is called on it afterwards, or was awaiting a connect, raises
        `ClosedError`."""
        with self._lock:
            self._closed = True
            clients, self._all_sync = self._all_sync, []
            loops = [(loop, entry[0]) for loop, entry in self._loops.items()]
            loops += list(self._connecting.items())
            self._loops = {}
        for client in clients:
            client.close()
        self._threads = threading.local()
        for loop, aclient in loops:
            if loop.is_closed():
                continue
            if not loop.is_running():
                loop.run_until_complete(aclient.close())
                continue
            done = asyncio.run_coroutine_threadsafe(aclient.close(), loop)
            if _running_loop() is not loop:
                concurrent.futures.wait([done], timeout=_CLOSE_WAIT)

    # -- operations: `name` blocks, `async_name` awaits; both run the same flow below --------

    def get_data(self, metadata: BatchMeta) -> TensorDict:
        """The batch's fields as a TensorDict, rows in `metadata` order (TransferQueue's shapes)."""
        return self._blocking(_get_data, metadata)

    async def async_get_data(self, metadata: BatchMeta) -> TensorDict:
        """The batch's fields as a TensorDict, rows in `metadata` order (TransferQueue's shapes)."""
        return await self._awaiting(_get_data, metadata)

    def put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write `data`: new columns of `metadata`'s samples, or (no metadata) new samples of
        `partition_id`. Returns the metadata with the written fields added.

        Raises:
            SchemaError: neither `metadata` nor `partition_id`, data contradicting the fields, or
                a `data_parser` (Sluice runs no caller code on the data path: parse before the put).
        """
        _no_parser(data_parser)
        return self._blocking(_put, data, metadata, partition_id)

    async def async_put(
        self,
        data: TensorDict,
        metadata: BatchMeta | None = None,
        partition_id: str | None = None,
        data_parser: Callable[[Any], Any] | None = None,
    ) -> BatchMeta:
        """Write `data` (see `put`)."""
        _no_parser(data_parser)
        return await self._awaiting(_put, data, metadata, partition_id)

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """The `BatchMeta` of `keys` (their fields ready for every key); `create=True` adds the
        keys the partition lacks.

        Raises:
            SchemaError: keys are missing and `create` is False (the message names them).
        """
        return self._blocking(_kv_retrieve_meta, keys, partition_id, create)

    async def async_kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """The `BatchMeta` of `keys` (see `kv_retrieve_meta`)."""
        return await self._awaiting(_kv_retrieve_meta, keys, partition_id, create)

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """The keys of `global_indexes` in `partition_id`."""
        return self._blocking(_kv_retrieve_keys, global_indexes, partition_id)

    async def async_kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str]:
        """The keys of `global_indexes` in `partition_id`."""
        return await self._awaiting(_kv_retrieve_keys, global_indexes, partition_id)

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """`{partition: {key: tags}}` of one partition, or of every partition with keys."""
        return self._blocking(_kv_list, partition_id)

    async def async_kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict]]:
        """`{partition: {key: tags}}` of one partition, or of every partition with keys."""
        return await self._awaiting(_kv_list, partition_id)

    def clear_samples(self, metadata: BatchMeta) -> None:
        """Delete the batch's samples (and their keys)."""
        self._blocking(_clear_samples, metadata)

    async def async_clear_samples(self, metadata: BatchMeta) -> None:
        """Delete the batch's samples (and their keys)."""
        await self._awaiting(_clear_samples, metadata)

    def kv_batch_put(
        self, keys: list[str], partition_id: str, fields: TensorDict | None = None, tags: list[dict] | None = None
    ) -> KVBatchMeta:
        """Create missing keys, write `fields`, then merge `tags`; returns the `KVBatchMeta`.

        Raises:
            SchemaError: tags msgpack cannot carry, or fields contradicting the partition's.
        """
        return self._blocking(_kv_batch_put, keys, partition_id, fields, tags)

    async def async_kv_batch_put(
        self, keys: list[str], partition_id: str, fields: TensorDict | None = None, tags: list[dict] | None = None
    ) -> KVBatchMeta:
        """Create missing keys, write `fields`, then merge `tags` (see `kv_batch_put`)."""
        return await self._awaiting(_kv_batch_put, keys, partition_id, fields, tags)

    def kv_batch_get(
        self, keys: list[str], partition_id: str, select_fields: Sequence[str] | None = None
    ) -> TensorDict:
        """The fields of `keys` as a TensorDict in key order; of `select_fields`, those written for
        none of the keys are left out (TransferQueue's behaviour, unlike Sluice's strict `get_data`).

        Raises:
            SchemaError: (a `ValueError`) a key is missing, or a field is written for some keys only.
        """
        return self._blocking(_kv_batch_get, keys, partition_id, select_fields)

    async def async_kv_batch_get(
        self, keys: list[str], partition_id: str, select_fields: Sequence[str] | None = None
    ) -> TensorDict:
        """The fields of `keys` as a TensorDict in key order (see `kv_batch_get`)."""
        return await self._awaiting(_kv_batch_get, keys, partition_id, select_fields)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        """Delete `keys` and their samples (unknown keys are ignored)."""
        self._blocking(_kv_clear, keys, partition_id)

    async def async_kv_clear(self, keys: list[str], partition_id: str) -> None:
        """Delete `keys` and their samples (unknown keys are ignored)."""
        await self._awaiting(_kv_clear, keys, partition_id)

    def kv_resolve(self, keys: list[str], partition_id: str) -> KvMetaReply:
        """`KvMetaReply` of `keys`: their meta, tags, and the fields ready for only some of them."""
        return self._blocking(_kv_resolve, keys, partition_id)

    async def async_kv_resolve(self, keys: list[str], partition_id: str) -> KvMetaReply:
        """`KvMetaReply` of `keys` (see `kv_resolve`)."""
        return await self._awaiting(_kv_resolve, keys, partition_id)


# -- the flows, written once -----------------------------------------------------------------


def _get_data(core: ClientCore, metadata: BatchMeta) -> Flow:
    """The batch's fields as a TensorDict, rows in `metadata` order (TransferQueue's shapes)."""
    data = yield from core.get_data(metadata)
    return as_rows(data)


def _put(
    core: ClientCore, data: TensorDict, metadata: BatchMeta | None = None, partition_id: str | None = None
) -> Flow:
    """Write `data`: new columns of `metadata`'s samples, or (no metadata) new samples of
    `partition_id`. Returns the metadata with the written fields added."""
    if metadata is None:
        if partition_id is None:
            raise SchemaError("put needs metadata or a partition_id")
        return (yield from core.put(as_rows(data), partition_id))
    if not len(metadata):
        return metadata
    return (yield from core.put(as_rows(data), meta=metadata))


def _kv_retrieve_meta(core: ClientCore, keys: list[str] | str, partition_id: str, create: bool = False) -> Flow:
    """The `BatchMeta` of `keys` (their fields ready for every key); `create=True` adds the
    keys the partition lacks. `SchemaError` names missing keys when not creating."""
    reply = yield from _resolve(core, [keys] if isinstance(keys, str) else list(keys), partition_id, create)
    return reply.meta


def _kv_retrieve_keys(core: ClientCore, global_indexes: list[int] | int, partition_id: str) -> Flow:
    """The keys of `global_indexes` in `partition_id`."""
    indexes = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
    reply = yield from core.one(CONTROLLER, KvKeys(partition_id, indexes), KvKeysReply)
    return reply.keys


def _kv_list(core: ClientCore, partition_id: str | None = None) -> Flow:
    """`{partition: {key: tags}}` of one partition, or of every partition with keys."""
    reply = yield from core.one(CONTROLLER, KvList(partition_id), KvListReply)
    return reply.partitions


def _clear_samples(core: ClientCore, metadata: BatchMeta) -> Flow:
    """Delete the batch's samples (and their keys)."""
    yield from core.clear(metadata)


def _kv_batch_put(
    core: ClientCore,
    keys: list[str],
    partition_id: str,
    fields: TensorDict | None = None,
    tags: list[dict] | None = None,
) -> Flow:
    """Create missing keys, write `fields`, then merge `tags`; returns the `KVBatchMeta`."""
    if tags is not None:
        _check_tags(keys, tags)
    resolved = yield from _resolve(core, keys, partition_id, True)
    meta = resolved.meta
    if fields is not None:
        meta = yield from core.put(as_rows(fields), meta=meta)
    merged = [dict(t) for t in resolved.tags]
    if tags is not None:
        yield from core.one(CONTROLLER, KvTag(partition_id, list(keys), [dict(t) for t in tags]), Ok)
        for mine, new in zip(merged, tags):
            mine.update(new)
    return KVBatchMeta(list(keys), merged, partition_id, meta.field_names, {})


def _kv_batch_get(
    core: ClientCore, keys: list[str], partition_id: str, select_fields: Sequence[str] | None = None
) -> Flow:
    """The fields of `keys` as a TensorDict in key order. Of `select_fields`, those no key has
    (never written for these keys) are left out, as TransferQueue does: verl selects its standard
    field list whether or not the run produces every field. `SchemaError` (a `ValueError`) for
    missing keys or for a field written for some keys but not all."""
    reply = yield from _resolve(core, keys, partition_id, False)
    meta = reply.meta
    if select_fields is not None:
        wanted = list(select_fields)
        meta = meta.select_fields([f for f in wanted if f in meta.fields or f in reply.partial])
    data = yield from core.get_data(meta)
    return as_rows(data)


def _kv_clear(core: ClientCore, keys: list[str], partition_id: str) -> Flow:
    """Delete `keys` and their samples (unknown keys are ignored)."""
    yield from core.one(CONTROLLER, KvClear(partition_id, list(keys)), Ok)


def _kv_resolve(core: ClientCore, keys: list[str], partition_id: str) -> Flow:
    """`KvMetaReply` of `keys`: their meta, tags, and the fields ready for only some of them."""
    return (yield from _resolve(core, keys, partition_id, False))


def _no_parser(data_parser: Callable[[Any], Any] | None) -> None:
    if data_parser is not None:
        raise SchemaError("data_parser is not supported by Sluice: parse the values before the put")


def _check_tags(keys: list[str], tags: list[dict]) -> None:
    for key, tag in zip(keys, tags):
        try:
            msgspec.msgpack.encode(tag)
        except TypeError as exc:
            raise SchemaError(
                f"the tags of key {key!r} hold a value msgpack cannot carry ({exc}); tags may hold only "
                "None, bool, int, float, str and lists/dicts of these (Sluice never pickles)"
            ) from exc


def _resolve(core: ClientCore, keys: list[str], partition: str, create: bool) -> Flow:
    return (yield from core.one(CONTROLLER, KvResolve(partition, list(keys), create), KvMetaReply))
