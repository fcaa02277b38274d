"""Where a storage unit's received frames live: the main malloc heap, kept warm for the next
frames, and given back to the system only when much of it is free.

Each case runs in a fresh interpreter: the allocator is tuned once per process."""

from __future__ import annotations

import json
import subprocess
import sys

from storage_harness import REPO

HEAP = r"""
import ctypes, json, os, sys, tempfile, threading
from transfer_queue.host import give_back_freed_memory, keep_freed_memory

libc = ctypes.CDLL(None)
libc.fdopen.restype = ctypes.c_void_p
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fflush.argtypes = [ctypes.c_void_p]


def heaps():
    with tempfile.TemporaryFile("w+") as f:
        out = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, out)
        libc.fflush(out)
        f.seek(0)
        return f.read().count("<heap nr=")


def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


tuned = keep_freed_memory(256 << 20, 32 << 20, one_heap=sys.argv[1] == "1")
frames = []
# what a ZeroMQ I/O thread does: receive frames into blocks it mallocs (zero-filled: resident)
receiver = threading.Thread(target=lambda: frames.extend(ctypes.create_string_buffer(8 << 20) for _ in range(3)))
receiver.start()
receiver.join()
frames.clear()  # stored and freed: 24 MiB of warm heap
before = resident()
kept = give_back_freed_memory(64 << 20)
after_kept = resident()
given = give_back_freed_memory(1 << 20)
print(json.dumps({"tuned": tuned, "heaps": heaps(), "kept": kept, "given": given,
                  "kept_drop": before - after_kept, "given_drop": after_kept - resident()}))
"""


def _run(one_heap: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", HEAP, "1" if one_heap else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_units_io_threads_allocate_from_the_main_heap():
    """A thread's own malloc arena unmaps its 64 MiB heaps as their blocks are freed, whatever
    the trim threshold, so frames received there land in fresh pages; a unit's threads share
    the main heap instead (a client's keep their own arenas)."""
    unit, client = _run(one_heap=True), _run(one_heap=False)
    assert unit["tuned"] and client["tuned"]
    assert unit["heaps"] == 1
    assert client["heaps"] == 2


def test_freed_frames_stay_warm_until_more_than_the_kept_share_is_free():
    result = _run(one_heap=True)
    assert result["kept"] is False and result["kept_drop"] < 1 << 20  # 24 MiB free, 64 MiB kept
    assert result["given"] is True and result["given_drop"] >= 16 << 20  # 24 MiB free, 1 MiB kept
