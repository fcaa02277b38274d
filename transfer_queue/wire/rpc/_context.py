"""The process's ZeroMQ contexts, sized to what the OS allows.

ZeroMQ's default context allows 1,023 sockets, whatever the process's open-file limit, and each
client holds up to one socket per service (the controller and every storage unit): a process of
many clients (a rollout server's workers) would stop at a few hundred. So before its first
socket each shared context is allowed as many sockets as the process may open files, after the
soft `RLIMIT_NOFILE` is raised to the hard one where the OS allows. `socket` names the limit a
refused socket hit (`out_of_files`, which names it for any other descriptor too).
"""

from __future__ import annotations

import errno
import itertools
import os
import resource
from typing import Any, TypeVar

import zmq

from ..errors import CapacityError

__all__ = ["shared_context", "socket", "open_file_limit", "out_of_files", "monitor"]

MAX_SOCKETS_CAP = 1 << 17
"""At most this many sockets per context: ZeroMQ allocates a mailbox slot per allowed socket."""

C = TypeVar("C", bound=zmq.Context)
_sized: set[int] = set()


def open_file_limit() -> int:
    """The soft `RLIMIT_NOFILE`, first raised to the hard limit where the OS allows it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = MAX_SOCKETS_CAP if hard == resource.RLIM_INFINITY else min(hard, MAX_SOCKETS_CAP)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return MAX_SOCKETS_CAP if soft == resource.RLIM_INFINITY else min(soft, MAX_SOCKETS_CAP)


def shared_context(kind: type[C]) -> C:
    """`kind.instance()` (the process's shared context of that kind), allowed as many sockets as
    the process may open files. The limit is set before the context's first socket; a context
    some other code already started keeps its own."""
    ctx = kind.instance()
    if id(ctx) not in _sized:
        _sized.add(id(ctx))
        ctx.set(zmq.MAX_SOCKETS, open_file_limit())
    return ctx


def socket(ctx: zmq.Context, kind: int) -> Any:
    """A new socket of `ctx`, of `ctx`'s kind (an asyncio context's sockets are awaitable).

    Raises:
        CapacityError: the process is out of sockets or files, naming which limit it hit.
        zmq.ZMQError: any other failure.
    """
    try:
        return ctx.socket(kind)
    except zmq.ZMQError as exc:
        if exc.errno != errno.EMFILE:
            raise
        raise out_of_files("ZeroMQ sockets", ctx) from None


def out_of_files(what: str, ctx: zmq.Context | None = None) -> CapacityError:
    """The error for a process that could open no more `what` (`EMFILE`), naming the limit it
    hit: the open-file limit, or `ctx`'s socket limit where files were left."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        files = len(os.listdir("/proc/self/fd"))
    except OSError:
        files = -1
    if ctx is not None and 0 <= files < soft - 16:
        which = (
            f"its ZeroMQ context's socket limit (MAX_SOCKETS {ctx.get(zmq.MAX_SOCKETS)}; {files} files open of {soft})"
        )
    else:
        which = f"its open-file limit (RLIMIT_NOFILE soft {soft}, hard {hard}; {files} open)"
    return CapacityError(
        f"this process can open no more {what}: it hit {which}; close clients it no longer uses, or raise "
        "the limit (ulimit -n)"
    )


_monitors = itertools.count()


def monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A monitor socket for `sock`'s `events`, on an inproc address of its own. pyzmq's default
    address is made from the socket's file descriptor, which a new socket reuses once the old one
    is closed, while the old monitor's address may still be bound: the new monitor would then
    fail with "Address already in use"."""
    try:
        return sock.get_monitor_socket(events, f"inproc://sluice-monitor-{os.getpid()}-{next(_monitors)}")
    except zmq.ZMQError as exc:
        sock.disable_monitor()  # libzmq's half, bound before the reader was refused, would block its I/O thread
        if exc.errno != errno.EMFILE:
            raise
        raise out_of_files("ZeroMQ sockets", sock.context) from None
