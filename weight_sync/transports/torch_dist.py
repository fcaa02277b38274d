"""`torch`: torch.distributed broadcast from the publisher to a fixed group of subscribers.

NCCL on GPUs, gloo on CPU. Under NCCL there is no host bounce: the publisher stages into GPU
slots (`staging = "cuda"`) and broadcasts from them, and subscribers receive into GPU buffers
(`receive_device`); only the small headers go through a device buffer. NCCL needs a GPU per
member (it refuses two processes on one GPU). The group is the publisher (group rank 0) plus
`world_size - 1` subscribers, formed through a TCPStore the publisher hosts; subscribers take
group ranks from the store's counter. It is a standalone process group, so it never touches
the trainer's default group. A pusher thread broadcasts each version bucket by bucket as it
is staged (a header, the buckets, a trailer saying whether staging finished), so bucket k is
on the wire while k+1 is packed. Every member receives the whole slot (collective semantics:
no per-subscriber slicing); each applies only its own reads from it. Publishing one rank's
slot only: sharded trainers use the pull transports.

Deltas (gloo only; `deltas` is False under NCCL, where staging and receive buffers are on the
GPU and every version is broadcast whole). Every member receives every broadcast, so the
members share one base: the last version this transport broadcast complete and ok, whole or as a
delta (`_last_ok`).
The pusher may skip versions (`send` supersedes a queued one), so a staged version's changes
(`Source.staged_delta`, compared against the version staged before it) are broadcast only
when their base is that version; otherwise, and when a member asked for it, the version goes
whole. The header says which (its base, -1: whole). A delta version then broadcasts, per
staging bucket, a `delta.Frame` header and its payload (the gaps and new bytes of
`delta.encode`, or the whole bucket for a WHOLE frame), so every member knows each payload's
size before it is broadcast. A member applies the frames to a copy of its base image (the
receive buffer that holds the base, `Job.base_image`, copied into the buffer it receives into
unless that is the same one); `delta.apply` checks each payload's checksum and the base's bytes
it overwrites. A member whose apply fails, or which holds no intact base, applies nothing more
of that version but takes part in every remaining broadcast (the collective stays in step),
raises `WeightSyncError` at the end (its tensors keep their version), and asks for a whole
version by bumping a counter in the group's TCPStore (`_WHOLE`); the pusher reads the counter
before each version and broadcasts whole when it moved. A member that asks during a version the
pusher has already started as a delta fails that one too (it holds no base) and asks again, so
the whole version comes at most two versions later.

A broken group (docs/weight-sync.md, "`torch`: when the group breaks"). The group forms once and
does not go on without a member, nor form again: whoever first sees it break (a member that
closes, a broadcast that fails, the publisher giving up waiting for members to join) records
why in the store (`_BROKEN`). The publisher reads it before each version and while it waits on a
broadcast; from then on it releases every version `send` is given. Members waiting on a
broadcast read it every `_POLL` (gloo) and raise `WeightSyncError` with it, as does every later
`receive`, and a subscriber that joins after it.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from transfer_queue import SluiceError, WeightSyncError
from transfer_queue.cuda import synchronize

from ..delta import GAPS, HEADER, WHOLE, Frame, apply, encode_span
from .base import Job, Source, StagedChanges, Transport, register

if TYPE_CHECKING:  # the class of ProcessGroupGloo/NCCL (a torch without distributed lacks the module)
    from torch._C._distributed_c10d import Backend as _Backend

__all__ = ["TorchTransport"]

log = logging.getLogger("sluice.weight_sync")

_WORLD = "sluice/weight_sync/world_size"
_RANK = "sluice/weight_sync/rank"
_GOODBYE = -2
"""Header version that tells subscribers the publisher closed the group."""
_IDLE = datetime.timedelta(days=7)
"""How long a subscriber waits for the next version's header (trainer steps can be long)."""
_BROKEN = "sluice/weight_sync/broken"
"""Store key: why the group broke for good (set once, by whoever saw it first: the publisher, a
member whose broadcast failed, or a member that left). Members waiting on a broadcast read it
every `_POLL`, the publisher before each version and while it waits on one."""
_POLL = datetime.timedelta(seconds=1)
"""How often a gloo broadcast still waiting looks whether the group broke (`_BROKEN`)."""
_WHOLE = "sluice/weight_sync/whole"
"""Store counter a member bumps to ask for the next version whole (it holds no intact base)."""
_HEADER = 6
"""int64s opening each broadcast: version, manifest id - 2**63, slot bytes, buckets, bucket bytes,
and the base of a delta (-1: whole)."""


class _Broken(Exception):
    """The group's store says the group broke (`_BROKEN`, the reason in `args[0]`)."""


def _outlive(work, group: _Backend | None) -> None:  # noqa: ANN001 - a c10d Work
    """Wait for a broadcast given up on, holding its `group` until it ended (by the group's
    timeout, or a peer closing its connection): the group's destructor would wait for it."""
    try:
        work.wait()
    except RuntimeError:
        pass  # it failed: ended all the same
    del group  # the last reference may go now


@register
class TorchTransport(Transport):
    """Broadcast to a group of `world_size` (the publisher and `world_size - 1` subscribers;
    subscribers learn it from the publisher's store)."""

    name = "torch"
    mode = "image"

    def __init__(self, world_size: int = 2, backend: str = "gloo", host: str = "127.0.0.1", timeout: float = 60.0):
        self.world_size = world_size
        self.backend = backend
        self.host = host
        self.timeout = timeout
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            self.staging = "cuda"
            self.receive_device = self.device
        self._store: dist.TCPStore | None = None
        self._group: _Backend | None = None
        self._cond = threading.Condition()
        self._queued: tuple | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._bounce: torch.Tensor | None = None
        self._ended: str | None = None
        """Subscriber: why this member left the group for good (None: still in it)."""
        self._rank = -1
        """Subscriber: this member's group rank (-1: not joined)."""
        self._broken: str | None = None
        """Publisher: why the group broke for good (None: it did not); `send` then releases
        every version at once."""
        self.deltas = backend == "gloo"
        self._source: Source | None = None
        self._last_ok = -1
        """Publisher: the last version broadcast complete and ok (whole or as a delta), the
        members' shared base."""
        self._asked = 0
        """Publisher: the `_WHOLE` count at the last version (more since: broadcast whole)."""
        self._member_store: dist.TCPStore | None = None

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    # -- group ---------------------------------------------------------------------------

    def _make_group(self, store: dist.Store, rank: int) -> _Backend:
        timeout = datetime.timedelta(seconds=self.timeout)
        if self.backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, self.world_size)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, self.world_size, opts)

    def _broadcast(self, tensor: torch.Tensor, timeout: datetime.timedelta | None = None) -> None:
        """Broadcast `tensor` from group rank 0: in place when it is on the group's device, else
        (a small CPU header under NCCL) through a device buffer."""
        group = self._group
        assert group is not None  # publisher and subscriber form the group before broadcasting
        if tensor.device == self.device:
            self._wait(group.broadcast(tensor, 0, timeout))
            return
        if self._bounce is None or self._bounce.numel() < tensor.numel():
            self._bounce = torch.empty(tensor.numel(), dtype=tensor.dtype, device=self.device)
        bounce = self._bounce[: tensor.numel()]
        bounce.copy_(tensor)
        self._wait(group.broadcast(bounce, 0, timeout))
        tensor.copy_(bounce)

    def _wait(self, work) -> None:  # noqa: ANN001 - a c10d Work
        """Wait for a broadcast; under gloo, look every `_POLL` whether the group broke meanwhile
        (`_BROKEN`: a member left, or failed where this process has no connection to see it).
        Under NCCL `wait` only orders streams, as before: a member there learns of a broken
        group from NCCL's own timeout.

        Raises:
            RuntimeError: the broadcast failed (a peer's connection closed, or it timed out).
            _Broken: the group broke meanwhile (its broadcast is left pending: the group is dead).
        """
        if self.backend != "gloo":
            work.wait()
            return
        while True:
            try:
                work.wait(_POLL)
                return
            except RuntimeError:
                if work.is_completed():
                    work.wait()  # it ended meanwhile, or failed: its own outcome
                    return
            reason = self._broken_reason()
            if reason is not None:
                # gloo cannot cancel the broadcast, and the group's destructor waits for it (at
                # exit too): a daemon thread holds the group until the broadcast ends
                threading.Thread(target=_outlive, args=(work, self._group), name="sluice-ws-torch", daemon=True).start()
                raise _Broken(reason)

    @property
    def _group_store(self) -> dist.TCPStore | None:
        """The group's store: the publisher's own (it hosts it), or a member's client of it
        (None before it joined)."""
        return self._store if self._store is not None else self._member_store

    def _broken_reason(self) -> str | None:
        """Why the group broke, as its store says (None: it did not); a store that does not
        answer means the publisher, its host, is gone."""
        store = self._group_store
        if store is None:
            return None
        try:
            return store.get(_BROKEN).decode() if store.check([_BROKEN]) else None
        except RuntimeError as exc:
            return f"the torch group broke: its publisher's store does not answer ({exc})"

    def _break(self, reason: str) -> str:
        """Record in the group's store that the group broke for good, for `reason` unless
        someone recorded why first; returns the reason recorded (the first)."""
        store = self._group_store
        if store is not None:
            try:
                return store.compare_set(_BROKEN, "", reason).decode()
            except RuntimeError:
                pass  # the publisher, the store's host, is gone: there is no one left to tell
        return reason

    # -- publisher -----------------------------------------------------------------------

    def serve(self, source: Source) -> str:
        self._source = source
        self._store = dist.TCPStore(
            self.host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=self.timeout)
        )
        self._store.set(_WORLD, str(self.world_size))
        self._thread = threading.Thread(target=self._push_loop, name="sluice-ws-torch", daemon=True)
        self._thread.start()
        return f"{self.host}:{self._store.port}"

    def send(self, slot, release) -> None:  # noqa: ANN001
        """Queue `slot` for broadcast (only the newest queued version is kept)."""
        with self._cond:
            if self._broken is not None:
                release()  # the group broke: no one receives it
                return
            if self._queued is not None:
                self._queued[2]()  # a newer version supersedes one not yet on the wire
            self._queued = (slot, slot.version, release)
            self._cond.notify_all()

    def _push_loop(self) -> None:
        assert self._store is not None  # `serve` made it before starting this thread
        try:
            self._group = self._make_group(self._store, 0)
        except Exception as exc:  # noqa: BLE001 - the group never formed (closed, or peers missing)
            if self._closed:
                return  # the publisher closed before its subscribers came: nothing broke
            members = self.world_size - 1
            joined = min(self._store.add(_RANK, 0), members)
            log.info("the torch group did not form: %s", exc)
            self._give_up(
                f"the torch group never formed: {joined} of its {members} subscriber(s) joined within "
                f"TorchTransport.timeout={self.timeout:g} s of the publisher"
            )
            return
        while True:
            with self._cond:
                while self._queued is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    try:
                        self._broadcast(torch.full((_HEADER,), _GOODBYE, dtype=torch.int64))
                    except (RuntimeError, _Broken):
                        pass  # members are gone already
                    return
                assert self._queued is not None  # woken with a slot queued, or closed (returned above)
                slot, version, release = self._queued
                self._queued = None
            try:
                self._push(slot, version)
            except (RuntimeError, SluiceError, _Broken) as exc:
                self._give_up(f"the torch group broke while the publisher broadcast version {version}: {exc}")
                return
            finally:
                release()

    def _give_up(self, reason: str) -> None:
        """The group broke for good (a member died or left, or it never formed): record why
        (members waiting on a broadcast and late joiners read it from the store), log it, and
        release the queued version and, from now on, every one `send` is given."""
        reason = self._break(reason)
        log.error("weight sync over torch stopped: %s", reason)
        with self._cond:
            self._broken = reason
            if self._queued is not None:
                self._queued[2]()
            self._queued = None

    def _push(self, slot, version: int) -> None:  # noqa: ANN001
        reason = self._broken_reason()  # a member that left while the group was idle
        if reason is not None:
            raise _Broken(reason)
        manifest = slot.manifest
        bucket = manifest.bucket_bytes
        staged = self._delta_of(slot)
        base = staged.base if staged is not None else -1
        header = torch.tensor(
            [version, manifest.id - (1 << 63), slot.size, manifest.num_buckets, bucket, base], dtype=torch.int64
        )
        self._broadcast(header)
        ok, sent, gaps = True, header.numel() * 8, 0
        for k in range(manifest.num_buckets):
            end = min((k + 1) * bucket, slot.size)
            piece = slot.mapped.tensor[k * bucket : end]
            if ok:
                try:
                    slot.wait_filled(end, version, self.timeout)
                except SluiceError:
                    ok = False  # staging failed: keep the collective in step, mark it bad
            if staged is None:
                self._broadcast(piece)
                sent += piece.numel()
                continue
            frame, payload = Frame(WHOLE, end - k * bucket, 0, 0, base, 0, 0), None
            if ok:
                try:
                    frame, payload = encode_span(staged.changes(k, self.timeout), 0, end - k * bucket, base)
                except SluiceError:
                    # staging failed: the version is bad; only its compare failed: the bytes are
                    # good and this bucket goes whole (a WHOLE frame)
                    ok = not slot.failed
            self._broadcast(torch.frombuffer(bytearray(frame.pack()), dtype=torch.uint8))
            body = piece if payload is None else payload
            if body.numel():
                self._broadcast(body)
            sent += HEADER.size + body.numel()
            gaps += frame.kind == GAPS
        ok = ok and not slot.failed  # a staging failure seen after its last bucket went out
        self._broadcast(torch.tensor([int(ok)], dtype=torch.int64))
        synchronize(self.receive_device)  # NCCL ran on its stream: done before the slot is released
        self._last_ok = version if ok else -1
        if self._source is not None:
            for _ in range(self.world_size - 1):  # each member received the broadcast bytes
                self._source.record(version, slot.size, sent, gaps > 0)

    def _delta_of(self, slot) -> StagedChanges | None:  # noqa: ANN001
        """The staged version's changes if they can be broadcast: against `_last_ok`, which
        every member holds, and no member asked for a whole version since the last one."""
        if not self.deltas or self._source is None or self._store is None:
            return None
        asked = self._store.add(_WHOLE, 0)
        if asked != self._asked:
            self._asked = asked
            return None
        staged = self._source.staged_delta(slot)
        return staged if staged is not None and staged.base == self._last_ok >= 0 else None

    # -- subscriber ----------------------------------------------------------------------

    def receive(self, job: Job) -> torch.Tensor:
        """Receive broadcasts until one of version >= `job.version` arrives whole (or as a delta
        applied to `job.base_image`, which holds `job.base`); sets `job.version`, `job.manifest`
        and `job.received` (the bytes broadcast) to what arrived.

        Raises:
            WeightSyncError: the group broke (a member died or left; the first to see it recorded
                why in the group's store, and every member raises that), never formed, formed
                before this subscriber joined, or closed; the publisher abandoned the version; or
                a delta could not be applied (then a whole version is asked for).
        """
        if self._ended is not None:
            raise WeightSyncError(self._ended)
        try:
            if self._group is None:
                self._join(job.endpoint)
            while True:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                self._broadcast(header, _IDLE)  # the next version may be far off
                version, manifest, size, buckets, bucket, base = header.tolist()
                if version == _GOODBYE:
                    self._ended = "the publisher closed the torch group"
                    raise WeightSyncError(self._ended)
                wanted = version >= job.version
                if wanted:
                    job.version, job.manifest = version, manifest + (1 << 63)
                into = job.into(size) if wanted else torch.empty(size, dtype=torch.uint8, device=self.device)
                if base < 0:
                    for k in range(buckets):
                        self._broadcast(into[k * bucket : min((k + 1) * bucket, size)])
                    received, refused = header.numel() * 8 + size, None
                else:
                    received, refused = self._receive_delta(job, into, size, buckets, bucket, base, wanted)
                    received += header.numel() * 8
                ok = torch.zeros(1, dtype=torch.int64)
                self._broadcast(ok)
                if wanted:
                    job.received = received
                    if not ok.item():
                        raise WeightSyncError(f"the publisher abandoned version {version} while broadcasting it")
                    if refused is not None:
                        raise WeightSyncError(refused)
                    return into
        except (RuntimeError, _Broken) as exc:
            if self._member_store is None:  # no group rank taken: the next receive tries to join again
                raise WeightSyncError(f"could not reach the torch group's store at {job.endpoint}: {exc}") from exc
            self._ended = self._break(f"the torch group broke at group rank {self._rank}: {exc}")
            raise WeightSyncError(self._ended) from exc

    def _join(self, endpoint: str) -> None:
        """Join the group the publisher at `endpoint` hosts (its store), as the next group rank.

        Raises:
            WeightSyncError: the group broke or never formed before this subscriber came, or
                formed with all its members (it cannot grow).
            RuntimeError: the store or the group's rendezvous failed (the caller records it).
        """
        host, port = endpoint.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=self.timeout))
        self.world_size = int(store.get(_WORLD))
        if store.check([_BROKEN]):
            self._ended = (
                f"{store.get(_BROKEN).decode()}; this subscriber joined after that, so it is not in the group "
                "(a torch group forms once: the publisher and world_size - 1 subscribers that join within "
                "TorchTransport.timeout)"
            )
            raise WeightSyncError(self._ended)
        rank = store.add(_RANK, 1)
        if rank >= self.world_size:
            self._ended = (
                f"the torch group formed with its {self.world_size} members before this subscriber joined; "
                "it cannot grow (raise world_size at the publisher)"
            )
            raise WeightSyncError(self._ended)
        self._member_store, self._rank = store, rank
        self._group = self._make_group(store, rank)

    def _receive_delta(
        self, job: Job, into: torch.Tensor, size: int, buckets: int, bucket: int, base: int, wanted: bool
    ) -> tuple[int, str | None]:
        """Take part in a delta version's broadcasts, applying its frames to `into` (seeded with
        `job.base_image`) while every frame fits; from the first that does not, receive and
        discard the rest and ask the pusher for a whole version. Returns the bytes broadcast and
        why the delta was refused (None: applied).

        Raises:
            WeightSyncError: a frame header is malformed (the group is then out of step for good).
        """
        refused = None
        if wanted:
            image = job.base_image
            if job.base != base or image is None or image.numel() < size:
                refused = f"this subscriber holds no intact copy of version {base}: delta refused"
            elif image.data_ptr() != into.data_ptr():
                into[:size].copy_(image[:size])
        if refused is not None:
            self._ask_whole()
        received, head = 0, torch.empty(HEADER.size, dtype=torch.uint8)
        for k in range(buckets):
            target = into[k * bucket : min((k + 1) * bucket, size)]
            self._broadcast(head)
            try:
                frame = Frame.unpack(head.numpy().tobytes())
            except WeightSyncError as exc:  # payload sizes unknown from here: the group cannot go on
                self._ended = self._break(f"the torch group is out of step at group rank {self._rank}: {exc}")
                raise WeightSyncError(self._ended) from exc
            payload = target if frame.kind == WHOLE and frame.span == target.numel() else None
            if payload is None:
                payload = torch.empty(frame.payload, dtype=torch.uint8)
            if payload.numel():
                self._broadcast(payload)
            received += HEADER.size + payload.numel()
            if not wanted or refused is not None or payload is target:
                continue
            try:
                if frame.kind == WHOLE or frame.base != base:
                    raise WeightSyncError(f"delta frame {frame} does not fit bucket {k} of a delta against {base}")
                apply(frame, payload, target)
            except WeightSyncError as exc:
                refused = str(exc)
                self._ask_whole()
        return received, refused

    def _ask_whole(self) -> None:
        """Ask the pusher to broadcast the next version whole (it reads the count before each).
        A store that does not answer is logged: the member stays in step with the group (it
        still refuses deltas it cannot apply, and asks again at the next)."""
        if self._member_store is not None:
            try:
                self._member_store.add(_WHOLE, 1)
            except RuntimeError as exc:  # the store timed out or is gone
                log.warning("could not ask the torch group's publisher for a whole version: %s", exc)

    def close(self) -> None:
        """Publisher: say goodbye to the group and stop. Subscriber: leave, which breaks the
        group (its size is fixed): the publisher and the other members learn it from the store
        (`_BROKEN`). A receive blocked in the collective cannot be interrupted (gloo has no
        cancel) and ends with the group."""
        if self._member_store is not None and self._ended is None:
            self._ended = self._break(f"the torch group broke: the subscriber at group rank {self._rank} left it")
        with self._cond:
            self._closed = True
            if self._queued is not None:
                self._queued[2]()
            self._queued = None
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
