"""The unit's memory: one shared-memory file, carved into extents of any size.

A storage unit owns exactly one file, `/dev/shm/sluice-{cluster_id}-u{unit_id}`: `capacity`
bytes of arena (and its free log after them, 192 KiB), mapped once for the unit's whole life.
Every tensor byte the unit holds lives in it, so memory is accounted exactly against `capacity`
(the unit pushes back instead of growing), the pages stay warm after the first use (a
first-touch fault costs far more than a warm copy, docs/architecture.md, section 3), and a
co-located client can map the same file and copy straight in or out.

`ExtentAllocator` is the pure bookkeeping (best fit over `ALIGN`-byte extents, coalescing);
`Arena` adds the file and its mapping; `Chunk` is one allocated extent (one Write's rows of one
field) with a reference count: one reference per stored row plus one per holder (a writer until
it registers its rows, a zero-copy reply frame until ZeroMQ has sent it). The extent goes back to
the free list when the count drops to zero, logged in the file's `FreeLog` (after the arena's
bytes) first, so that a co-located reader can tell whether the extents it copied from were
freed, and maybe written again, meanwhile.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading

import numpy as np

from transfer_queue.host import FreeLog, arena_path, map_file
from transfer_queue.wire.sizes import ALIGN

__all__ = ["ALIGN", "ExtentAllocator", "Chunk", "Arena"]

PREFAULT_STEP = 64 << 20
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we skip pre-faulting


class ExtentAllocator:
    """Best-fit allocator of `ALIGN`-byte-aligned extents of `[0, capacity)`.

    An extent occupies its bytes rounded up to `align` (`rounded`), so a write costs its own bytes
    plus at most `align - 1` per field, and the controller, which accounts the same rounding
    (`transfer_queue.wire.sizes.arena_bytes`), agrees with the unit's `used` to within a put's
    `row_bytes` rounding. Free extents are indexed three ways: by (size, start) in a sorted list
    (best fit: the smallest that fits, the lowest address among equals, so large free extents
    stay whole for large writes), and by start and by end (freeing merges an extent with both
    neighbours in O(1) look-ups, so a fully freed allocator is again one extent). Live extents
    are remembered by start, so a double or mismatched free is caught instead of corrupting data.
    """

    def __init__(self, capacity: int, align: int = ALIGN):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        capacity = capacity // align * align
        if capacity <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one extent of {align} bytes")
        self.align = align
        self.capacity = capacity
        self._by_size: list[tuple[int, int]] = [(capacity, 0)]
        self._by_start: dict[int, int] = {0: capacity}
        self._by_end: dict[int, int] = {capacity: 0}
        self._live: dict[int, int] = {}
        self.used = 0
        """Bytes currently allocated (each extent rounded up to `align`)."""

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        """The largest single allocation that would succeed now, in bytes."""
        return self._by_size[-1][0] if self._by_size else 0

    def extents(self) -> list[tuple[int, int]]:
        """Free extents as (offset, nbytes), by offset."""
        return sorted(self._by_start.items())

    def rounded(self, nbytes: int) -> int:
        """Bytes an allocation of `nbytes` occupies (a multiple of `align`; 0 for 0)."""
        return -(-nbytes // self.align) * self.align

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes` bytes, or None when no free extent fits.

        Zero bytes need no extent: they get offset 0 and cost nothing.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = self.rounded(nbytes)
        if need == 0:
            return 0
        by_size = self._by_size
        i = bisect.bisect_left(by_size, (need, -1))
        if i == len(by_size):
            return None
        size, start = by_size.pop(i)
        del self._by_start[start], self._by_end[start + size]
        if size > need:
            self._add(start + need, size - need)
        self._live[start] = need
        self.used += need
        return start

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent that `alloc(nbytes)` gave at `offset`.

        Raises `ValueError` for an extent that is not live (never allocated, freed already, or
        of another size): that is a bookkeeping bug, and silently accepting it would corrupt
        data later.
        """
        need = self.rounded(nbytes)
        if need == 0:
            return
        if self._live.get(offset) != need:
            raise ValueError(f"extent ({offset}, {nbytes}) is not an allocated extent")
        del self._live[offset]
        self.used -= need
        start, size = offset, need
        before = self._by_end.get(start)
        if before is not None:
            size += self._take(before)
            start = before
        after = self._by_start.get(start + size)
        if after is not None:
            size += self._take(start + size)
        self._add(start, size)

    def _add(self, start: int, size: int) -> None:
        bisect.insort(self._by_size, (size, start))
        self._by_start[start] = size
        self._by_end[start + size] = start

    def _take(self, start: int) -> int:
        """Remove the free extent at `start` from the indexes; returns its size."""
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        by_size = self._by_size
        del by_size[bisect.bisect_left(by_size, (size, start))]
        return size


class Chunk:
    """One allocated extent: `nbytes` requested bytes at arena `offset`, and its reference count.
    `staged` holds the received bytes while they are not copied into the arena yet (see
    `staging`); reads serve them from there."""

    __slots__ = ("offset", "nbytes", "refs", "staged")

    def __init__(self, offset: int, nbytes: int):
        self.offset = offset
        self.nbytes = nbytes
        self.refs = 1  # the creator's reference; dropped once it has registered its rows
        self.staged: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"Chunk(offset={self.offset}, nbytes={self.nbytes}, refs={self.refs})"


class Arena:
    """The shared-memory file of one unit, its mapping and its allocator.

    `array` (numpy uint8) and `view` (memoryview) cover the whole mapping; copies into and out of
    the arena go through them. Create with `Arena.create`; `close()` unmaps and unlinks the file.
    """

    def __init__(self, path: str, capacity: int):
        self.allocator = ExtentAllocator(capacity)
        capacity = self.allocator.capacity
        self.path = path
        self.size = capacity
        file_size = FreeLog.offset(capacity) + FreeLog.nbytes()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, file_size)
            try:
                # Reserve the tmpfs pages now: a full /dev/shm fails here, with a clear error,
                # instead of killing the unit with SIGBUS on some later write.
                os.posix_fallocate(fd, 0, file_size)
            except OSError as exc:
                raise MemoryError(
                    f"cannot reserve {file_size} bytes in {os.path.dirname(path)}: {exc.strerror}; "
                    "lower storage_capacity or enlarge /dev/shm"
                ) from exc
            self._mmap: mmap.mmap | None = map_file(fd, capacity)
            self.frees = FreeLog.create(fd, capacity)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.view: memoryview = self.array.data
        self._stop = threading.Event()
        self._prefault: threading.Thread | None = None
        self.prefaulted = 0
        """Bytes pre-faulted so far (the whole mapping once the background pass is done)."""

    @classmethod
    def create(cls, cluster_id: str, unit_id: int, capacity: int) -> Arena:
        """The arena of unit `unit_id`; `FileExistsError` if another process holds that name."""
        return cls(arena_path(cluster_id, unit_id), capacity)

    # -- accounting ----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes available to chunks (the file size rounded down to `ALIGN`)."""
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    def alloc(self, nbytes: int) -> int | None:
        return self.allocator.alloc(nbytes)

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent, logged freed first (`FreeLog`): a co-located reader that copied
        from it meanwhile then knows its bytes may be another write's."""
        occupied = self.allocator.rounded(nbytes)
        if occupied:
            self.frees.freed(offset, occupied)
        self.allocator.free(offset, nbytes)

    def new_chunk(self, nbytes: int) -> Chunk | None:
        """A chunk of `nbytes` holding its creator's reference, or None when it does not fit."""
        offset = self.allocator.alloc(nbytes)
        return None if offset is None else Chunk(offset, nbytes)

    def unref(self, chunk: Chunk, n: int = 1) -> bool:
        """Drop `n` references; frees the extent (and returns True) when none is left."""
        chunk.refs -= n
        if chunk.refs > 0:
            return False
        if chunk.refs < 0:
            raise ValueError(f"{chunk!r} released more often than referenced")
        self.free(chunk.offset, chunk.nbytes)
        return True

    # -- life cycle ----------------------------------------------------------------------

    def start_prefault(self) -> None:
        """Fault every page in, in the background, so first writes copy at warm speed.

        A thread calls `madvise(MADV_POPULATE_WRITE)` through ctypes, which releases the GIL, one
        `PREFAULT_STEP` at a time, so the event loop never stalls on it. Kernels without that
        advice (EINVAL) are skipped silently: writes then just pay the faults themselves.
        """
        if self._prefault is not None or self._mmap is None:
            return
        self._prefault = threading.Thread(target=self._populate, name="sluice-prefault", daemon=True)
        self._prefault.start()

    def wait_prefault(self, timeout: float | None = None) -> bool:
        """Block until the background pre-fault is done (tests and benchmarks); True if done."""
        if self._prefault is None:
            return False
        self._prefault.join(timeout)
        return not self._prefault.is_alive()

    def _populate(self) -> None:
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        base = self.array.ctypes.data
        for start in range(0, self.size, PREFAULT_STEP):
            if self._stop.is_set():
                return
            length = min(PREFAULT_STEP, self.size - start)
            if madvise(base + start, length, MADV_POPULATE_WRITE) != 0:
                return  # unsupported (EINVAL) or out of memory: the pages fault on first use
            self.prefaulted = start + length

    def close(self) -> None:
        """Unmap and unlink the file. Idempotent.

        If a zero-copy frame still references the mapping (a reply ZeroMQ has not sent yet),
        the mapping is left to the process exit, but the file is unlinked all the same.
        """
        self._stop.set()
        if self._prefault is not None:
            self._prefault.join()
        if self._mmap is not None:
            self.frees.close()
            mm, self._mmap = self._mmap, None
            try:
                self.view.release()
                del self.array
                mm.close()
            except BufferError:
                pass  # exported views remain; the OS unmaps at exit
        _unlink(self.path)

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
