"""This host: its identity, its shared-memory files, its allocator and its stop signals. A public
module, small and free of torch, so every part may use it: the client and the storage units (arena
files), the launcher (sweeping a cluster's files), the weight channel (staging segments), the
commands (`sluice`, the recipes).

- `host_id()`: processes that report the same id can map each other's shared memory;
- `shm_prefix`, `arena_path`: how a cluster's /dev/shm files are named;
- `open_arena`: a unit's arena file, opened only if it is exactly what its name promises;
- `map_file`, `unmap`: map a shared-memory file (or descriptor) and let go of it again;
- `FreeLog`: what an arena file keeps after the arena, so that a co-located reader can tell
  whether the bytes it copied out were still its rows' (a unit logs each extent it frees);
- `keep_freed_memory`: keep freed large blocks warm in glibc's heap;
- `reachable`: an endpoint as other hosts can dial it;
- `exit_on_signals`: SIGINT, SIGTERM and SIGHUP (`STOP_SIGNALS`) unwind a command, which then ends
  by that signal; `stop_while_loading`: until then, they end a command that is still loading;
- `die_with_parent`: a child process's `preexec_fn`: it ends when the process that started it dies;
- `stop_processes`: SIGTERM child processes, SIGKILL those that outlast a deadline.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = [
    "host_id",
    "shm_prefix",
    "arena_path",
    "open_arena",
    "map_file",
    "unmap",
    "FreeLog",
    "keep_freed_memory",
    "give_back_freed_memory",
    "reachable",
    "exit_on_signals",
    "stop_while_loading",
    "STOP_SIGNALS",
    "die_with_parent",
    "stop_processes",
]

SHM_DIR = "/dev/shm"


def host_id() -> str:
    """Hostname plus boot id: processes reporting the same id can map each other's /dev/shm files."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def shm_prefix(cluster_id: str) -> str:
    """What every shared-memory file of cluster `cluster_id` is named with (glob it with `*`)."""
    return f"{SHM_DIR}/sluice-{cluster_id}-"


def arena_path(cluster_id: str, unit_id: int) -> str:
    """Where unit `unit_id` of cluster `cluster_id` keeps its arena (the only path a client maps)."""
    return f"{shm_prefix(cluster_id)}u{unit_id}"


def open_arena(cluster_id: str, unit_id: int, shm_path: str, capacity: int) -> int | None:
    """A read-write descriptor of a unit's arena, or None unless the path a unit advertised is
    exactly its cluster's arena file: no other name, no symlink, owned by this user and big
    enough. A client never maps (and writes into) any other file a peer names."""
    expected = arena_path(cluster_id, unit_id)
    if shm_path != expected:
        return None
    try:
        fd = os.open(expected, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_size < capacity:
        os.close(fd)
        return None
    return fd


def map_file(file: str | int, size: int, *, writable: bool = True) -> mmap.mmap:
    """A shared mapping of the first `size` bytes of `file` (a path, opened and closed here, or
    a descriptor, which stays the caller's). Its pages fault in on first touch: a caller that
    wants them in at once touches them through torch, which lets other threads run
    (`MAP_POPULATE` would hold the GIL for the whole mapping).

    Raises:
        OSError: the file cannot be opened or mapped.
    """
    fd = os.open(file, os.O_RDWR if writable else os.O_RDONLY) if isinstance(file, str) else file
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED, prot=prot)
    finally:
        if isinstance(file, str):
            os.close(fd)


def unmap(mm: mmap.mmap) -> None:
    """Unmap now, or, while a view of it is still alive somewhere, when the last one goes."""
    try:
        mm.close()
    except BufferError:
        pass


class FreeLog:
    """The free log of a unit's arena: a ring in the arena's file, after its `capacity` bytes
    (from `offset(capacity)`, a page boundary), of the extents the unit freed last, so that a
    co-located reader can tell whether the extents it copied its rows from stayed theirs.

    A reader of a mapped arena copies rows from the runs the unit named in its reply, after the
    reply; nothing holds those extents meanwhile, and a clear of the rows followed by a new write
    could land another batch's bytes there. So the unit logs every extent it frees (`freed`)
    before the extent goes back to its free list, hence before any write can land there: word 1
    counts the extents freed (the epoch), and free number e is entry e mod `RING`: (e, start,
    end). The reader notes the epoch (`epoch`) before it asks for rows and, once its copies are
    done, checks (`intact`) that none of the frees since overlapped the runs it copied: then no
    extent under them was freed, or written again, while it copied. Where more than `RING` frees
    came since, or an entry it needs was overwritten meanwhile, it cannot tell, and says so.

    Ordering: the unit writes an entry (its tag last) and then the epoch before the extent can be
    handed out, and a writer of the extent stores its bytes only after it was handed out, so a
    reader that copied any of those bytes loads the new epoch and entry after them (x86-64 keeps
    loads in order, and every processor sees stores in one order). Word 0 is `RING`, written when
    the log is made: a file without it (a unit of a release before the log) has none.
    """

    RING = 8192
    _HEADER = 2  # words before the entries: RING, the epoch

    def __init__(self, mm: mmap.mmap):
        self._mm: mmap.mmap | None = mm
        self._words = memoryview(mm).cast("q")
        self._table = np.frombuffer(mm, np.int64)

    @classmethod
    def offset(cls, capacity: int) -> int:
        """Where the log of an arena of `capacity` bytes starts in its file."""
        page = mmap.ALLOCATIONGRANULARITY
        return -(-capacity // page) * page

    @classmethod
    def nbytes(cls) -> int:
        """Bytes of a log (192 KiB, whatever the arena's size)."""
        return (cls._HEADER + 3 * cls.RING) * 8

    @classmethod
    def create(cls, fd: int, capacity: int) -> FreeLog:
        """The unit's log in its arena file `fd` (already `offset + nbytes` long, zeroed).

        Raises:
            OSError: it cannot be mapped."""
        log = cls(mmap.mmap(fd, cls.nbytes(), flags=mmap.MAP_SHARED, offset=cls.offset(capacity)))
        log._words[0] = cls.RING
        return log

    @classmethod
    def open(cls, cluster_id: str, unit_id: int, shm_path: str, capacity: int) -> FreeLog | None:
        """A reader's view of unit `unit_id`'s log, or None where its arena file is not what
        `open_arena` accepts or holds no log of this layout (a unit before the free log)."""
        fd = open_arena(cluster_id, unit_id, shm_path, capacity)
        if fd is None:
            return None
        try:
            start = cls.offset(capacity)
            if os.fstat(fd).st_size < start + cls.nbytes():
                return None
            log = cls(mmap.mmap(fd, cls.nbytes(), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=start))
        except OSError:
            return None
        finally:
            os.close(fd)
        if log._words[0] != cls.RING:
            log.close()
            return None
        return log

    def epoch(self) -> int:
        """How many extents the unit has freed so far."""
        return self._words[1]

    def freed(self, offset: int, nbytes: int) -> None:
        """Log the extent of `nbytes` bytes at `offset` freed (the unit, before it may be reused)."""
        words = self._words
        epoch = words[1] + 1
        at = self._HEADER + 3 * (epoch % self.RING)
        words[at] = 0  # the entry is being written
        words[at + 1] = offset
        words[at + 2] = offset + nbytes
        words[at] = epoch
        words[1] = epoch

    def intact(self, runs: Iterable[tuple[int, int]], since: int) -> bool:
        """Whether no extent freed after the epoch `since` (noted before the runs were asked for)
        overlapped any of `runs` ((offset, nbytes) of arena); False also where that cannot be
        told (more than `RING` frees since)."""
        words = self._words
        now = words[1]
        if now == since:
            return True  # the common case: nothing was freed
        if now - since > self.RING:
            return False
        spans = [run for run in runs if run[1] > 0]
        if not spans:
            return True
        if (now - since) * len(spans) <= 64:  # a few frees and runs: compared one by one (numpy: 60 us)
            freed = []
            for epoch in range(since + 1, now + 1):
                at = self._HEADER + 3 * (epoch % self.RING)
                freed.append((words[at + 1], words[at + 2]))
                if words[at] != epoch:  # read after its extent: overwritten by a later free
                    return False
            # a freed [start, end) overlaps a run [offset, offset + size) where start < offset + size and end > offset
            return not any(start < offset + size and end > offset for offset, size in spans for start, end in freed)
        epochs = np.arange(since + 1, now + 1, dtype=np.int64)
        slots = self._HEADER + 3 * (epochs % self.RING)
        table = self._table
        starts, ends = table[slots + 1], table[slots + 2]
        if not np.array_equal(table[slots], epochs):  # as above
            return False
        order = np.argsort(starts)
        starts, reach = starts[order], np.maximum.accumulate(ends[order])
        offsets, sizes = np.array(spans, dtype=np.int64).T
        below = np.searchsorted(starts, offsets + sizes)  # extents that start before the run's end
        return not bool(np.any((below > 0) & (reach[np.maximum(below - 1, 0)] > offsets)))

    def close(self) -> None:
        """Unmap the log. Idempotent."""
        if self._mm is not None:
            mm, self._mm = self._mm, None
            self._words.release()
            del self._table
            mm.close()


_malloc_tuned = False


def keep_freed_memory(trim_bytes: int, mmap_bytes: int = 32 << 20, *, one_heap: bool = False) -> bool:
    """Once per process: make glibc keep freed blocks of up to `mmap_bytes` (at most 32 MiB) for
    reuse.

    ZeroMQ receives every data frame into a new malloc'd block; by default glibc maps blocks that
    large afresh or trims them off its heap once freed, so every frame lands in pages that fault
    in on first touch (far slower than a warm copy, docs/architecture.md section 3). A fixed mmap threshold
    and a trim threshold of `trim_bytes` keep them warm; the process then holds up to
    `trim_bytes` of freed heap. Frames above `mmap_bytes` still get their own mapping, returned
    as soon as they are freed: a storage unit sets it low, since a freed heap block is often split
    by small allocations and not reused whole, and large frames kept warm would cost it about
    twice their size.

    With `one_heap` (a storage unit, before ZeroMQ starts its I/O threads), threads started later
    allocate from the main heap too. A thread's own malloc arena is a chain of 64 MiB heaps that
    glibc unmaps as soon as the blocks in one are freed, whatever the trim threshold, so frames
    received there kept landing in fresh pages. A client leaves its threads' arenas alone: they
    are its application's.

    Set `SLUICE_MALLOC_TUNING=0` to leave the allocator alone. Returns whether the allocator was
    tuned (False without glibc's `mallopt`, or when it was asked before in this process).
    """
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("SLUICE_MALLOC_TUNING", "1") == "0":
        return False
    _malloc_tuned = True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mmap_bytes = max(mmap.PAGESIZE, min(mmap_bytes, 32 << 20))
    tuned = bool(mallopt(_M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_bytes))
    return tuned and (not one_heap or bool(mallopt(_M_ARENA_MAX, 1)))


def give_back_freed_memory(keep: int) -> bool:
    """Return freed heap memory to the system (glibc `malloc_trim`) once more than `keep` bytes of
    it are free; whether it did.

    The trim threshold only trims the heap's top, so without this a burst of writes whose frames
    were freed between live blocks stays resident long after it was stored. Below `keep` nothing
    is returned: `malloc_trim` gives back every free page, and the frames that follow would land
    in fresh pages (a page fault and zeroing each, more than the copy itself)."""
    try:
        libc = ctypes.CDLL(None)
        if hasattr(libc, "mallinfo2"):  # glibc >= 2.33; older ones trim every time
            libc.mallinfo2.restype = _MallInfo2
            if libc.mallinfo2().fordblks <= keep:
                return False
        libc.malloc_trim(ctypes.c_size_t(keep))
    except (OSError, AttributeError):
        return False
    return True


_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2`: ten `size_t` counters, `fordblks` the free bytes."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


def reachable(endpoint: str, toward: str | None = None) -> str:
    """`endpoint` (`tcp://host:port`) as others can reach it: a wildcard host (0.0.0.0 binds
    every interface but reaches none) becomes this machine's IP on the route to `toward`'s host
    (or the default route), found without sending anything; else the IP of this machine's name."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host not in _WILDCARDS:
        return endpoint
    ip = ""
    peer = toward.partition("://")[2].rpartition(":")[0] if toward else "192.0.2.1"  # TEST-NET-1: the default route
    if peer not in _WILDCARDS:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((peer, 9))  # UDP connect: a routing lookup, no packet
                ip = probe.getsockname()[0]
        except OSError:
            ip = ""
    if not ip:
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
    return f"{scheme}://{ip}:{port}"


def exit_on_signals() -> None:
    """From now on SIGINT, SIGTERM and SIGHUP raise `SystemExit(128 + signal)` in the main thread:
    the command unwinds through its `finally` blocks and `with` statements (closing its clients,
    stopping the services and processes it started); then, once every exit hook ran (those that
    libraries registered before it too: `multiprocessing` ends its children there) and stdout,
    stderr and logging are flushed, it ends by that signal itself, as a
    process the signal killed: a shell reports 130, 143 or 129, and a script or loop that runs
    the command stops on Ctrl-C rather than going on to its next line (bash goes on after a
    child that *exited* 130). Call it first thing in a command's `main`.

    Also where SIGINT came ignored: a script's background job starts so, and Python then raises
    no `KeyboardInterrupt` of its own, so `kill -INT` would do nothing. A signal that comes
    while the command unwinds raises again, cutting short the cleanup it interrupts; the
    command still ends by the first. Inside a running asyncio loop the exception lands wherever
    the loop is, possibly in the middle of a task, which then ends with it: there, cancel the
    main task instead (`loop.add_signal_handler`), then raise the signal again outside it
    (`signal.raise_signal`, once these handlers are back), as `recipes.rollout_worker` does.

    Outside the main thread it does nothing: Python runs signal handlers in the main thread
    alone, whose handling then stands (a command's `main` called as a function from a thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_on)
    _register_end_by_signal()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, `kill` and a closed terminal (or a dropped ssh session)."""


def stop_while_loading(module: str) -> None:
    """Where `module` (the caller's `__name__`) is "__main__", a module run as a command: from now
    until `exit_on_signals` installs its handlers, a stop signal ends the process at once, by that
    signal (SIG_DFL), as it has started nothing yet. Call it before the command's heavy imports:
    loading torch takes seconds, in which a SIGINT that came inherited ignored (a script's
    background job) was lost, and the command ran on to its end; raised inside a half-done import
    instead, a library's `except` may swallow it. Imported as a library, the module changes
    nothing (nor outside the main thread)."""
    if module == "__main__" and threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


_stopped_by: list[int] = []
"""The signal that stopped this process (`_exit_on`), once one came: the first, if more did."""


def _exit_on(signum: int, _frame: object) -> None:
    if not _stopped_by:
        _stopped_by.append(signum)
    raise SystemExit(128 + signum)


@functools.cache
def _register_end_by_signal() -> None:
    """Once per process, however often `exit_on_signals` runs."""
    atexit.register(_end_by_signal)


def _end_by_signal() -> None:
    """At exit, a process a signal stopped ends by that signal, unhandled (SIG_DFL), after the
    other exit hooks: registered last, this one runs first, so it runs the rest itself."""
    if not _stopped_by:
        return
    atexit.unregister(_end_by_signal)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None, a closed pipe, a closed file
            pass
    signal.signal(_stopped_by[0], signal.SIG_DFL)
    os.kill(os.getpid(), _stopped_by[0])


def die_with_parent() -> None:
    """A child process's `preexec_fn` (`subprocess.Popen(..., preexec_fn=die_with_parent)`): the
    child gets SIGTERM when the thread that started it dies, also SIGKILLed or in a child of its
    own session, where no terminal's or group's signal reaches it (Linux `PR_SET_PDEATHSIG`;
    nothing without glibc). The child unwinds on that SIGTERM (`exit_on_signals`) or dies of it."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _find_prctl() -> Any:
    """libc's `prctl`, or None where there is no glibc."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _find_prctl()
"""Looked up before any fork: dlopen/dlsym in the child of a threaded parent (a Ray worker) can deadlock."""


def stop_processes(procs: list[subprocess.Popen], timeout: float) -> None:
    """SIGTERM every process still running (each may unwind: close its clients, keep its
    records), wait up to `timeout` seconds in all, then SIGKILL those still running; close their
    stdout pipes. Interrupted (a second Ctrl-C, any exception), it SIGKILLs every one still
    running before it lets the exception go on: none outlives a stop that was asked for."""
    try:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    except BaseException:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        raise
    finally:
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.close()
