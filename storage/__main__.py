"""`python -m storage`: run one storage unit.

    python -m storage --unit-id K --capacity BYTES --cluster-id ID [--host 127.0.0.1]
                      [--controller tcp://HOST:PORT] [--register-timeout 30]

Binds `tcp://{host}:*` (a free port; loopback unless told otherwise), creates the arena
`/dev/shm/sluice-{ID}-u{K}`, registers with the controller when one is given (and waits for its
`Ok`; the cluster secret comes from the environment variable `SLUICE_SECRET`), then prints exactly one line, `SLUICE_STORAGE {address}`, to stdout and serves until
SIGTERM or SIGINT. On the way out it unlinks the arena file.

Exit status: 0 after a signal-initiated stop; 1 when the unit could not start (arena file
exists, /dev/shm too small, bad arguments) or the controller refused or ignored the
registration. The reason goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

import zmq
import zmq.asyncio

from transfer_queue.host import host_id, keep_freed_memory, reachable
from transfer_queue.wire.errors import ServiceError, SluiceError, TimeoutError
from transfer_queue.wire.messages import Ok, Registered, RegisterUnit, Reply, UnitInfo
from transfer_queue.wire.rpc import (
    AsyncChannel,
    AsyncLocalChannel,
    Codec,
    Credentials,
    Service,
    credentials_from_env,
    run_service,
)
from transfer_queue.wire.sizes import parse_bytes

from .service import StorageUnit

ANNOUNCE = "SLUICE_STORAGE"
log = logging.getLogger("sluice.storage")


class StartupError(Exception):
    """The unit could not start or register; the message says why."""


async def register(
    unit: StorageUnit, controller: str, timeout: float, secret: str, credentials: Credentials | None
) -> None:
    """Send `RegisterUnit` (with the cluster `secret`) to the controller and wait for its `Ok`,
    then keep the channel for the unit's reports of put writes; `StartupError` otherwise."""
    info = UnitInfo(
        unit.unit_id,
        reachable(unit.address, controller),
        unit.arena.capacity,
        unit.arena.path,
        host_id(),
        unit.local_endpoint,
    )
    channel = AsyncChannel(
        controller,
        Codec(Reply),
        name=f"controller {controller}",
        credentials=credentials,
        timeout=timeout,
        connect_timeout=timeout,
        dead_after=timeout,
        on_reply=_refused,
    )
    try:
        registered = await channel.call(RegisterUnit(info, secret))
    except (ServiceError, TimeoutError) as exc:  # unreachable, silent or late
        channel.close()
        raise StartupError(
            f"controller {controller} did not answer the registration within {timeout} s ({exc})"
        ) from exc
    except SluiceError as exc:
        channel.close()
        raise StartupError(f"controller {controller} refused storage unit {unit.unit_id}: {exc.code}: {exc}") from exc
    except BaseException:
        channel.close()
        raise
    unit.report_to(channel, secret, _lane(channel, registered, timeout))


def _lane(channel: AsyncChannel, registered: object, timeout: float) -> AsyncLocalChannel | None:
    """A channel for the unit's reports over the controller's local lane, when the controller
    (its answer to `RegisterUnit`) is on this host and the lane can be reached (a report on a
    put's path then wakes one thread, not three); else None: they go over `channel` (ZeroMQ)."""
    if not isinstance(registered, Registered) or not registered.local or registered.host_id != host_id():
        return None
    try:
        return AsyncLocalChannel(
            registered.local,
            Codec(Reply),
            name=f"{channel.name}'s local lane",
            timeout=timeout,
            dead_after=timeout,
            on_reply=_refused,
        )
    except SluiceError:  # gone, or not this user's: ZeroMQ decides the rest
        return None


def _refused(reply: object) -> None:
    """The controller answers a posted report only to refuse it (an `Ok` answers a `Cancel`)."""
    if not isinstance(reply, Ok):
        log.warning("the controller refused a report of this unit: %s", reply)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m storage", description="Run one Sluice storage unit.")
    p.add_argument("--unit-id", type=int, required=True)
    p.add_argument("--capacity", type=parse_bytes, required=True, help="arena bytes (e.g. 1073741824 or 1GiB)")
    p.add_argument("--cluster-id", required=True, help="names the /dev/shm arena file")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback)")
    p.add_argument("--controller", default=None, help="controller endpoint to register with")
    p.add_argument("--register-timeout", type=float, default=30.0)
    return p


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Until the service loop takes over the signals, a SIGTERM unwinds (and unlinks the arena)
    # instead of killing the process outright.
    signal.signal(signal.SIGTERM, _interrupt)
    # Write frames land in warm memory of the main heap, which also the I/O threads (started
    # below) allocate from. Up to 10% of capacity stays kept at its top: above the staged frames'
    # and the frame window's share together, so a burst of them freed at once stays warm for the
    # next (a smaller keep gives them back between bursts). Frames over capacity / 32 get
    # their own mapping (see keep_freed_memory). With the trimming rule of `StorageUnit._trim`,
    # a put's frames then land in warm pages, not in fresh ones that fault in on first touch.
    keep_freed_memory(args.capacity // 10, args.capacity // 32, one_heap=True)
    # Two ZeroMQ I/O threads, created before any socket: a producer's write arriving and a
    # consumer's read leaving (two connections) then run at once instead of taking turns.
    zmq.asyncio.Context.instance(io_threads=2)

    async def make() -> Service:
        credentials = credentials_from_env()
        unit = StorageUnit(args.unit_id, args.capacity, args.cluster_id, args.host, credentials=credentials)
        if args.controller is None:
            return unit
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        assert me is not None
        for sig in (signal.SIGTERM, signal.SIGINT):  # a stop while registering still cleans up
            loop.add_signal_handler(sig, me.cancel)
        try:
            await register(
                unit, args.controller, args.register_timeout, os.environ.get("SLUICE_SECRET", ""), credentials
            )
        except BaseException:
            unit.close()
            raise
        return unit

    try:
        run_service(make, lambda unit: f"{ANNOUNCE} {unit.address}")
    except (StartupError, FileExistsError, MemoryError, ValueError, OSError, zmq.ZMQError) as exc:
        print(f"storage unit {args.unit_id}: {exc}", file=sys.stderr, flush=True)
        return 1
    except (asyncio.CancelledError, KeyboardInterrupt):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
