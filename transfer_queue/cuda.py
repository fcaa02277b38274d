"""CUDA in the clients and the weight channel: every CUDA call Sluice makes, kept small and in one place.

A process touches CUDA state only when it is handed a CUDA tensor or asks for a CUDA device;
a CPU-only process (the services, a client that never sees a GPU) never initialises CUDA. Host
memory that CUDA copies read or write (a mapped arena, a staging slot) is registered with CUDA
(`cudaHostRegister`) once per mapping, so those copies run at pinned speed and may be
asynchronous, and it is unregistered before the mapping goes away. CUDA IPC handles
(`ipc_share`, `ipc_open`) are plain fields that callers encode themselves (never pickled).
Copies run on a side stream per device and end with one synchronisation per call (`copies`): the caller's tensors and host
buffers are then safe to reuse, whatever stream the caller works on. Copies the host need not
wait for (`background_copies`, a publisher staging GPU weights into host memory) run on a
second side stream, ordered before the caller's later work by the GPU rather than by the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .wire.errors import SchemaError

__all__ = [
    "is_cuda",
    "in_use",
    "check_tensor_device",
    "target_device",
    "HostRegistry",
    "tensor_ptr",
    "pinned_source",
    "pinned_empty",
    "copies",
    "copy_each",
    "background_copies",
    "background_done",
    "trailing_copies",
    "side_stream",
    "synchronize",
    "make_current",
    "ipc_share",
    "ipc_open",
]


def is_cuda(t: torch.Tensor) -> bool:
    """Whether `t` lives in GPU memory (never initialises CUDA)."""
    return t.is_cuda


def in_use() -> bool:
    """Whether this process has started CUDA (it holds or has made CUDA tensors): only then is
    host memory worth registering with CUDA."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def check_tensor_device(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor this process cannot copy to host memory.

    Raises:
        SchemaError: `t` is on a device other than the CPU or CUDA, or on CUDA in a process
            without CUDA; the message names the field `name`.
    """
    kind = t.device.type
    if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
        return
    why = "this process has no CUDA" if kind == "cuda" else "only CPU and CUDA tensors can be stored"
    raise SchemaError(f"field {name!r} is a tensor on device {t.device}: {why}; move it to the CPU first")


def target_device(device: str | torch.device | None) -> torch.device | None:
    """The device `get_data`/`stream` return tensors on: None for the CPU (the default path),
    else a `torch.device`.

    Raises:
        SchemaError: an unknown device string, a device other than CPU or CUDA, or CUDA in a
            process without CUDA.
    """
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SchemaError(f"device={device!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise SchemaError(f"device={device!r}: data can be returned on the CPU or a CUDA device")
    if not torch.cuda.is_available():
        raise SchemaError(f"device={device!r}: this process has no CUDA")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


_READ_ONLY = 0x08
"""`cudaHostRegisterReadOnly`: the memory is mapped read-only (a publisher's slot)."""


class HostRegistry:
    """Host memory ranges registered with CUDA, each once, all unregistered by `clear`.

    `register` is a no-op (returns False) in a process without CUDA, so callers need not ask
    first; it registers only ranges not yet registered (keyed by address).
    """

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}  # address -> bytes
        self._refused: set[int] = set()  # addresses CUDA would not register: not asked again

    def register(self, ptr: int, nbytes: int, read_only: bool = False) -> bool:
        """Page-lock `nbytes` at `ptr` for CUDA copies (once; `read_only` for memory mapped
        without write access); False when CUDA is absent or refuses (the copies then run at
        pageable speed, still correct). A refused range is not tried again until `unregister`
        or `clear`: callers register on every copy, and a refusal can cost as much as the copy."""
        if ptr in self._ranges:
            return True
        if nbytes <= 0 or ptr in self._refused or not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _READ_ONLY if read_only else 0)
        if int(err) != 0:
            _reset_last_error()
            self._refused.add(ptr)
            return False
        self._ranges[ptr] = nbytes
        return True

    def unregister(self, ptr: int) -> None:
        """Unregister the range at `ptr` (before its memory is unmapped or freed)."""
        self._refused.discard(ptr)
        if self._ranges.pop(ptr, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def clear(self) -> None:
        self._refused.clear()
        for ptr in list(self._ranges):
            self.unregister(ptr)

    def __contains__(self, ptr: int) -> bool:
        return ptr in self._ranges


def _reset_last_error() -> None:
    """Reset the CUDA runtime's last error after a refusal Sluice tolerates.

    A refused `cudaHostRegister` stays the runtime's last error, and torch reads that after its
    next kernel launch: the refusal would surface there as an unrelated failure. torch binds no
    `cudaGetLastError`, so it is called in the runtime library this process has loaded (nothing
    happens where it cannot be found, e.g. a build that links the runtime statically)."""
    library = _runtime_library()
    if library is not None:
        library.cudaGetLastError()


@functools.cache
def _runtime_library() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded in this process, or None if there is none to find."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    if path is None:
        return None
    try:
        library = ctypes.CDLL(path)
        library.cudaGetLastError.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return library


def tensor_ptr(t: torch.Tensor) -> int:
    """The address of a host tensor's storage (what `HostRegistry` keys on)."""
    return t.untyped_storage().data_ptr()


def pinned_source(t: torch.Tensor) -> torch.Tensor:
    """A host tensor with `t`'s bytes that a copy to a GPU can read asynchronously, at pinned
    speed: `t` itself when its memory is pinned or registered (an arena), else a copy of it in
    pinned memory (a received frame, which lands in ordinary heap memory).

    A copy from pageable memory is staged by the driver through its own small pinned buffers,
    one chunk at a time and blocking the host, at a fraction of pinned speed; copying into
    pinned memory first (on all of torch's CPU threads) and then letting the GPU read it costs
    less, and leaves the copy asynchronous. The pinned block comes from torch's caching host
    allocator, which hands it out again only once the copies that read it are done."""
    return t if t.is_pinned() else t.pin_memory()


def pinned_empty(nbytes: int) -> torch.Tensor:
    """`nbytes` of pinned host memory (uint8) for a GPU to copy into asynchronously; from
    torch's caching host allocator, so the same blocks serve call after call once freed."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_streams: dict[tuple[int, str], Any] = {}


def _side_stream(device: torch.device, purpose: str) -> Any:
    """One stream per device and purpose, so one purpose's waits never include another's copies."""
    key = (device.index, purpose)
    stream = _streams.get(key)
    if stream is None:
        stream = _streams[key] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def copies(device: torch.device | None) -> Iterator[None]:
    """Run the block's copies to or from `device` on its side stream, asynchronously where the
    host memory is pinned, and wait for them once at the end (nothing happens for the CPU).

    The side stream first waits for the caller's current stream, so copies see what the caller
    wrote to its tensors. The wait happens when the block raises too: host memory the copies
    already issued read or write (an arena reservation the failed put gives up) is reused only
    once they are done."""
    if device is None or device.type != "cuda":
        yield
        return
    stream = _side_stream(device, "copies")
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            yield
    except BaseException:
        with contextlib.suppress(RuntimeError):  # a CUDA error raised again here: report the first
            stream.synchronize()
        raise
    stream.synchronize()


def copy_each(dsts: list[torch.Tensor], srcs: list[torch.Tensor], non_blocking: bool = False) -> None:
    """`dst.copy_(src, non_blocking)` for each pair, in one call (`torch._foreach_copy_`, whose
    loop over the pairs runs in C++: no Python per copy) unless the first pair is CUDA to CUDA.
    Those are issued one by one, each its own `cudaMemcpyAsync`: for lists of CUDA tensors of
    one dtype torch would run its fused foreach kernel instead, which has not been measured
    against the copies on a GPU. Pairs that mix devices or dtypes take the loop in C++ (the
    fused kernel is used only when every tensor is on one CUDA device)."""
    if not dsts or (is_cuda(dsts[0]) and is_cuda(srcs[0])):
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src, non_blocking=non_blocking)
        return
    torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


@contextlib.contextmanager
def background_copies(device: torch.device) -> Iterator[Callable[[], Callable[[], None]]]:
    """Issue the block's copies from CUDA `device` on a side stream and return without waiting
    for them: the host goes on at once, and the GPU orders the caller's later work after them.

    The block calls the yielded `mark()` after each group of copies; it records an event there
    and returns a function that blocks until the group is done (raising `RuntimeError` if the
    GPU failed it). The side stream first waits for the caller's current stream (the copies
    see what the caller wrote); on leaving, the caller's current stream waits for the side
    stream, so a kernel the caller issues next (an optimizer step changing the copied tensors)
    cannot start before the copies have read them. Host memory the copies write must be
    registered (`HostRegistry`) for them to run asynchronously; unregistered, each copy blocks
    the host until done, which is slower but still correct.
    """
    stream = _side_stream(device, "background")
    caller = torch.cuda.current_stream(device)
    stream.wait_stream(caller)
    try:
        with torch.cuda.stream(stream):
            yield functools.partial(_mark, stream)
    finally:
        caller.wait_stream(stream)


def background_done(device: torch.device) -> None:
    """Wait for the copies `background_copies` issued on CUDA `device` so far: before memory
    they may still write is freed."""
    _side_stream(device, "background").synchronize()


@contextlib.contextmanager
def trailing_copies(device: torch.device) -> Iterator[Callable[[], Callable[[], None]]]:
    """Issue the block's copies on a side stream of their own once the work `background_copies`
    issued so far is done, and return without waiting; the caller's stream does not wait for
    them: for copies out of memory only the caller's own staging writes (a packed copy of the
    weights), which the trainer's next kernels need not wait for. `mark()` as in
    `background_copies`."""
    stream = _side_stream(device, "trailing")
    stream.wait_stream(_side_stream(device, "background"))
    with torch.cuda.stream(stream):
        yield functools.partial(_mark, stream)


def _mark(stream: Any) -> Callable[[], None]:
    """Record an event on `stream`; returns what blocks until the work before it is done."""
    event = torch.cuda.Event()
    event.record(stream)
    return event.synchronize


@contextlib.contextmanager
def side_stream(device: torch.device, purpose: str, after: str | None = None) -> Iterator[None]:
    """Run the block's GPU work on `device`'s side stream for `purpose`, apart from the
    caller's stream and from every other purpose's; nothing is waited for: the block orders its
    work itself (events, or a host synchronisation such as `.item()`). `after`: another
    purpose whose work queued so far the block's runs after (`"background"`: `background_copies`')."""
    stream = _side_stream(device, purpose)
    if after is not None:
        stream.wait_stream(_side_stream(device, after))
    with torch.cuda.stream(stream):
        yield


def synchronize(device: torch.device | None) -> None:
    """Wait for the copies issued on `device`'s current stream (nothing for the CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def make_current(device: torch.device) -> None:
    """Make CUDA `device` this thread's device, with its primary context current: for libraries
    that call the CUDA driver on GPU memory they are handed (UCX, through NIXL), which expect a
    current context in the calling thread. Nothing is waited for (the memory they are handed
    must hold no queued work: see `staging.Segment`)."""
    torch.cuda.set_device(device)
    torch.cuda.current_stream(device).query()  # a runtime call: binds the context to this thread


def ipc_share(t: torch.Tensor) -> tuple:
    """The CUDA IPC handle of a CUDA tensor's storage, as the fields `ipc_open` takes: the
    device, the memory handle, the storage's bytes and offset in its allocation, an event handle
    and whether the opener must wait on it. Each field is an int, bytes or a bool: it can travel
    in any message.

    The memory lives exactly as long as the tensor: the caller keeps it alive while other
    processes read it (Sluice: its leases). PyTorch's own cross-process count, which the share
    starts at one and each opener lowers by one when it drops the handle, is given back here and
    not handed on: it counts one opener per share, so a handle shared once and opened by two
    processes (or by none) would hold the freed memory back until this process exits."""
    device, handle, size, offset, counter, counter_offset, event, sync = t.untyped_storage()._share_cuda_()
    torch.UntypedStorage._release_ipc_counter(counter, counter_offset, device=t.device)
    return device, handle, size, offset, event, sync


_NO_COUNTER = b"/sluice/no-counter"
"""The cross-process count an opening is given (`ipc_share`'s fields carry none): an opening
lowers its count when it is dropped, and PyTorch skips a count it cannot open, as when the
producer has exited. A shared-memory name with a second "/" is refused by `shm_open`, so this
one never names a real object."""


def ipc_open(fields: tuple, nbytes: int) -> torch.Tensor:
    """A uint8 view of `nbytes` of another process's CUDA storage, from its `ipc_share` fields
    (opened once: keep the result for as long as the memory is used)."""
    device, handle, size, offset, event, sync = fields
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(device, handle, size, offset, _NO_COUNTER, 0, event, sync)
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device)).set_(storage, 0, (nbytes,), (1,))
