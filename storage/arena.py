"""The unit's memory: one shared-memory file, carved into page-granular extents.

A storage unit owns exactly one file, `/dev/shm/sluice-{cluster_id}-u{unit_id}`, of `capacity`
bytes, mapped once for the unit's whole life. Every tensor byte the unit holds lives in it, so
memory is accounted exactly against `capacity` (the unit pushes back instead of growing), the
pages stay warm after the first use (a first-touch fault costs far more than a warm copy,
docs/architecture.md, section 3),
and a co-located client can map the same file and copy straight in or out.

`ExtentAllocator` is the pure bookkeeping (first-fit over 64 KiB pages, coalescing free list);
`Arena` adds the file and its mapping; `Chunk` is one allocated extent (one Write's rows of one
field) with a reference count: one reference per stored row plus one per holder (a writer until
it registers its rows, a zero-copy reply frame until ZeroMQ has sent it). The extent goes back to
the free list when the count drops to zero.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading

import numpy as np

from transfer_queue.host import arena_path, map_file

__all__ = ["PAGE_BYTES", "ExtentAllocator", "Chunk", "Arena"]

PAGE_BYTES = 64 << 10
"""Allocation granularity: every chunk occupies a whole number of 64 KiB pages."""
PREFAULT_STEP = 64 << 20
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we skip pre-faulting


class ExtentAllocator:
    """First-fit allocator of page-granular extents of `[0, capacity)`.

    The free list is two parallel lists (start page, page count) sorted by start; freeing merges
    an extent with both neighbours, so a fully freed allocator is again one extent. Allocation
    scans the free list (it stays short: at most one entry more than live chunks).
    """

    def __init__(self, capacity: int, page_bytes: int = PAGE_BYTES):
        if page_bytes <= 0 or page_bytes & (page_bytes - 1):
            raise ValueError(f"page_bytes must be a power of two, got {page_bytes}")
        pages = capacity // page_bytes
        if pages <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one page of {page_bytes} bytes")
        self.page_bytes = page_bytes
        self.pages = pages
        self.capacity = pages * page_bytes
        self._starts: list[int] = [0]
        self._sizes: list[int] = [pages]
        self._used_pages = 0

    @property
    def used(self) -> int:
        """Bytes currently allocated (whole pages)."""
        return self._used_pages * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        """The largest single allocation that would succeed now, in bytes."""
        return max(self._sizes, default=0) * self.page_bytes

    def extents(self) -> list[tuple[int, int]]:
        """Free extents as (offset, nbytes), by offset."""
        pb = self.page_bytes
        return [(s * pb, n * pb) for s, n in zip(self._starts, self._sizes)]

    def rounded(self, nbytes: int) -> int:
        """Bytes an allocation of `nbytes` occupies (whole pages; 0 for 0)."""
        return self._pages(nbytes) * self.page_bytes

    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // self.page_bytes)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of at least `nbytes` bytes, or None when no free extent fits.

        Zero bytes need no extent: they get offset 0 and cost nothing.
        """
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        need = self._pages(nbytes)
        if need == 0:
            return 0
        sizes = self._sizes
        for i, size in enumerate(sizes):
            if size >= need:
                start = self._starts[i]
                if size == need:
                    del self._starts[i], sizes[i]
                else:
                    self._starts[i] = start + need
                    sizes[i] = size - need
                self._used_pages += need
                return start * self.page_bytes
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the extent that `alloc(nbytes)` gave at `offset`.

        Raises `ValueError` for an extent that is misaligned, out of range or (partly) free
        already: that is a bookkeeping bug, and silently accepting it would corrupt data later.
        """
        n = self._pages(nbytes)
        if n == 0:
            return
        start, rem = divmod(offset, self.page_bytes)
        if rem or start < 0 or start + n > self.pages:
            raise ValueError(f"extent ({offset}, {nbytes}) is not an allocated extent")
        starts, sizes = self._starts, self._sizes
        i = bisect.bisect_right(starts, start)  # free extents before i start at or before `start`
        if i > 0 and starts[i - 1] + sizes[i - 1] > start:
            raise ValueError(f"extent ({offset}, {nbytes}) is already free")
        if i < len(starts) and starts[i] < start + n:
            raise ValueError(f"extent ({offset}, {nbytes}) overlaps a free extent")
        merge_prev = i > 0 and starts[i - 1] + sizes[i - 1] == start
        merge_next = i < len(starts) and starts[i] == start + n
        if merge_prev and merge_next:
            sizes[i - 1] += n + sizes[i]
            del starts[i], sizes[i]
        elif merge_prev:
            sizes[i - 1] += n
        elif merge_next:
            starts[i] = start
            sizes[i] += n
        else:
            starts.insert(i, start)
            sizes.insert(i, n)
        self._used_pages -= n


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

    def __init__(self, path: str, capacity: int, page_bytes: int = PAGE_BYTES):
        self.allocator = ExtentAllocator(capacity, page_bytes)
        self.path = path
        self.size = capacity
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            try:
                # Reserve the tmpfs pages now: a full /dev/shm fails here, with a clear error,
                # instead of killing the unit with SIGBUS on some later write.
                os.posix_fallocate(fd, 0, capacity)
            except OSError as exc:
                raise MemoryError(
                    f"cannot reserve {capacity} bytes in {os.path.dirname(path)}: {exc.strerror}; "
                    "lower storage_capacity or enlarge /dev/shm"
                ) from exc
            self._mmap: mmap.mmap | None = map_file(fd, capacity)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
        self.view: memoryview = memoryview(self.array)
        self._stop = threading.Event()
        self._prefault: threading.Thread | None = None
        self.prefaulted = 0
        """Bytes pre-faulted so far (the whole mapping once the background pass is done)."""

    @classmethod
    def create(cls, cluster_id: str, unit_id: int, capacity: int, page_bytes: int = PAGE_BYTES) -> Arena:
        """The arena of unit `unit_id`; `FileExistsError` if another process holds that name."""
        return cls(arena_path(cluster_id, unit_id), capacity, page_bytes)

    # -- accounting ----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes available to chunks (the file size rounded down to whole pages)."""
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    def alloc(self, nbytes: int) -> int | None:
        return self.allocator.alloc(nbytes)

    def free(self, offset: int, nbytes: int) -> None:
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
        self.allocator.free(chunk.offset, chunk.nbytes)
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
