"""The `sluice` command: run a cluster standalone, or watch one.

    sluice serve  [--units N] [--capacity 2GiB] [--max-staleness K] ...   until SIGINT/SIGTERM
    sluice status ADDRESS [--watch SECONDS] [--json]

`serve` prints `SLUICE_ADDRESS tcp://...` (for scripts) and a line for people, then holds the
services until it is told to stop, and stops them cleanly. `status` renders what
`client.status()` returns as tables; throughput is the difference of two snapshots over the
refresh interval. It asks through `ControlClient`, which does not load torch (seconds on a
busy machine). Sluice's typed errors end the
command with a one-line message and exit status 1, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ._control_client import ControlClient
from .host import exit_on_signals
from .wire.errors import SchemaError, SluiceError
from .wire.staleness import StalenessConfig

__all__ = ["main"]

_FIRST_SAMPLE_GAP = 0.5
"""Seconds between the two snapshots a one-off `status` diffs for throughput."""
_PROBE_TIMEOUT = 3.0
"""Seconds `status` waits for a TCP connection before it calls the address unreachable."""
_CLEAR = "\x1b[H\x1b[2J"


# -- serve ---------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _size(text: str) -> int:
    from ._cluster import parse_bytes  # imports the client, hence torch: only when serving

    try:
        return parse_bytes(text)
    except SchemaError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def serve(args: argparse.Namespace) -> int:
    """Start the services, announce the address, hold them until SIGINT/SIGTERM, stop them."""
    from ._cluster import init

    stop = threading.Event()
    # Handlers go in before `init`: a signal during start-up then stops the cluster it started.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    cluster = init(
        args.units,
        args.capacity,
        staleness=StalenessConfig(args.consumer_batch_size, args.max_staleness, follow_consumers=args.follow_consumers),
        lease_timeout=args.lease_timeout,
        stale_policy=args.stale_policy,
        metrics_port=args.metrics_port,
        host=args.host,
        port=args.port,
        journal=args.journal,
    )
    try:
        print(f"SLUICE_ADDRESS {cluster.address}", flush=True)
        eta = "unbounded" if args.max_staleness is None else args.max_staleness
        metrics = "" if args.metrics_port is None else f", metrics on http://{args.host}:{args.metrics_port}/metrics"
        print(
            f"Sluice cluster {cluster.cluster_id}: {args.units} storage unit(s), {_bytes(args.capacity)} in all, "
            f"max_staleness {eta}{_admission(args)}, stale policy {args.stale_policy}{metrics}. "
            f"Watch it with `sluice status {cluster.address} --watch 1`; Ctrl-C stops it.",
            flush=True,
        )
        if cluster.client_credentials is not None:
            print(
                "Bound beyond loopback: workers must present this cluster's CurveZMQ keys. Hand them this "
                "line (a secret: over a private channel, e.g. your job scheduler's secret store):\n"
                f"export SLUICE_CREDENTIALS={cluster.client_credentials.token()}",
                flush=True,
            )
        while not stop.wait(1.0):
            if args.journal and not cluster.controller_alive:
                print("sluice serve: the controller died; restarting it from its journal", file=sys.stderr, flush=True)
                cluster.restart_controller()
                continue
            if not cluster.alive:
                print("sluice serve: a service process died; stopping the others", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        cluster.shutdown()


def _admission(args: argparse.Namespace) -> str:
    """The admission budget in the start-up line (nothing when admission is unbounded)."""
    if args.max_staleness is None:
        return ""
    how = "growing to what the consumers take per version" if args.follow_consumers else "pinned"
    return f", admission (η + version + 1) * consumer_batch_size {args.consumer_batch_size} ({how})"


# -- status --------------------------------------------------------------------------------


def _probe(address: str) -> None:
    """Fail fast, with a clear message, when nothing listens at a TCP `address` (a typo'd
    port would otherwise only show as a reply timeout)."""
    match = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:]+):(\d+)", address)
    if match is None:
        if not re.fullmatch(r"(ipc|inproc)://.+", address):
            raise SchemaError(f"{address!r} is not a controller address; expected e.g. tcp://127.0.0.1:41000")
        return
    host, port = match.group(1).strip("[]"), int(match.group(2))
    if not 0 < port < 65536:
        raise SchemaError(f"{address!r} names port {port}; ports run from 1 to 65535")
    try:
        socket.create_connection((host, port), timeout=_PROBE_TIMEOUT).close()
    except OSError as exc:
        raise SluiceError(
            f"no Sluice controller reachable at {address} ({exc.strerror or exc}); is `sluice serve` running?"
        ) from exc


def status(args: argparse.Namespace) -> int:
    """Print the cluster's status once, or every `--watch` seconds until Ctrl-C, SIGTERM or SIGHUP
    (`exit_on_signals`: it then ends by that signal)."""
    if args.watch is not None:
        exit_on_signals()  # Ctrl-C or SIGTERM ends a watch, a script's background job's too
    _probe(args.address)
    in_place = args.watch is not None and sys.stdout.isatty()
    reader = ControlClient(args.address, timeout=args.timeout)
    try:
        for text in _frames(reader, args.json, args.watch):
            print(_CLEAR + text if in_place else text, flush=True)
    finally:
        reader.close()
    return 0


def _frames(reader: ControlClient, as_json: bool, watch: float | None) -> Iterator[str]:
    """Rendered snapshots: one, or one every `watch` seconds. Tables show rates, which need two
    snapshots, so their first frame comes `_FIRST_SAMPLE_GAP` seconds after the first snapshot."""
    before = None if as_json else reader.status()
    gap = 0.0 if as_json else _FIRST_SAMPLE_GAP
    while True:
        time.sleep(gap)
        now = reader.status()
        if as_json:
            yield json.dumps(now, indent=2)
        else:
            assert before is not None  # tables take their first snapshot before the loop
            yield _as_tables(now, before)
        if watch is None:
            return
        before, gap = now, watch


def _as_tables(now: dict, before: dict) -> str:
    """The status as a few aligned tables, with rates from the counters' change since `before`."""
    eta = "unbounded" if now["max_staleness"] is None else now["max_staleness"]
    out = [
        f"Sluice cluster {now['cluster_id']}  up {now['uptime_s']:.0f}s  version {now['version']}  "
        f"max_staleness {eta}  stale policy {now['stale_policy']}",
        "",
    ]
    rows = []
    for name, part in sorted(now["partitions"].items()):
        head = [name, part["samples"], part["committed"], "yes" if part["sealed"] else "no", _bytes(part["bytes"])]
        tasks = sorted(part["tasks"].items()) or [("-", None)]
        for i, (task, t) in enumerate(tasks):
            counts = ["", "", ""] if t is None else [t["pending"], t["leased"], t["consumed"]]
            rows.append((head if i == 0 else [""] * len(head)) + [task, *counts])
    out += _table(
        ["PARTITION", "SAMPLES", "COMMITTED", "SEALED", "BYTES", "TASK", "READY", "LEASED", "CONSUMED"],
        rows or [["(none)", "", "", "", "", "", "", "", ""]],
    )
    stale = now["staleness"]
    hist = "  ".join(f"{k}:{v}" for k, v in stale["histogram"].items()) or "none served"
    out += [
        "",
        f"staleness of served samples (versions behind: count)  {hist}",
        f"too stale: dropped {stale['dropped']}  kept {stale['kept']}  requeued {stale['requeued']}",
    ]
    adm = now["admission"]
    budget = "unbounded" if adm["budget"] is None else adm["budget"]
    out += [
        f"admission: accepted {adm['accepted']}  running {adm['running']}  budget {budget}  "
        f"waiting {adm['waiting']}  waits {adm['waits']} ({adm['wait_seconds']:.2f}s)  "
        f"consumer batch {adm['consumer_batch_size']} ({_follows(adm)})",
        "",
    ]
    units = [
        [k, _bytes(u["bytes"]), _bytes(u["capacity"]), f"{100 * u['bytes'] / max(u['capacity'], 1):.1f}%", u["address"]]
        for k, u in now["units"].items()
    ]
    out += _table(["UNIT", "BYTES", "CAPACITY", "USED", "ADDRESS"], units)
    dt = now["uptime_s"] - before["uptime_s"]
    rates = {
        k: (now["counters"][k] - before["counters"][k]) / dt if dt > 0 else 0.0
        for k in ("samples_put", "samples_served", "samples_acked")
    }
    out += [
        "",
        f"throughput over {dt:.1f}s: put {rates['samples_put']:.1f}/s  served "
        f"{rates['samples_served']:.1f}/s  acked {rates['samples_acked']:.1f}/s  "
        f"(open leases {now['counters']['open_leases']})",
    ]
    return "\n".join(out)


def _follows(adm: dict) -> str:
    if not adm["follows_consumers"]:
        return "pinned"
    if not adm["grown_by"]:
        return "follows the consumers"
    return f"grown from {adm['configured_consumer_batch_size']}: {adm['grown_by']}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Rows as left-aligned text columns (numbers right-aligned)."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(isinstance(row[i], int) or row[i] == "" for row in rows) for i in range(len(headers))]
    return [
        "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip() for r in cells
    ]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# -- entry point ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Run or watch a Sluice cluster.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a controller and storage units; stop with Ctrl-C or SIGTERM")
    s.add_argument("--units", type=int, default=2, help="storage units (default 2)")
    s.add_argument("--capacity", type=_size, default="2GiB", help="total storage, e.g. 512MiB (default 2GiB)")
    s.add_argument(
        "--max-staleness", type=int, default=None, help="η: versions a consumed sample may lag (default unbounded)"
    )
    s.add_argument(
        "--consumer-batch-size",
        type=int,
        default=64,
        help="trainer samples per version, for admission (default 64; grows to what the consumers take)",
    )
    s.add_argument(
        "--follow-consumers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="grow the admission budget's consumer batch to what the consumers really take per version "
        "(default); --no-follow-consumers pins it, and a consumer that needs more fails at once",
    )
    s.add_argument(
        "--lease-timeout", type=float, default=300.0, help="seconds a consumer may hold samples unacked (default 300)"
    )
    s.add_argument("--stale-policy", choices=("drop", "keep", "requeue"), default="drop")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    s.add_argument("--host", default="127.0.0.1", help="interface the services bind (default loopback)")
    s.add_argument("--port", type=int, default=0, help="controller port (default: a free one)")
    s.add_argument(
        "--journal",
        default=None,
        metavar="PATH",
        help="record the controller's state in PATH; a controller that dies is restarted from it "
        "and loses no acked put",
    )
    s.set_defaults(run=serve)

    st = sub.add_parser("status", help="show a cluster's partitions, tasks, staleness, admission, storage and rates")
    st.add_argument("address", help="the controller's address, e.g. tcp://127.0.0.1:41000")
    st.add_argument(
        "--watch", type=_positive, default=None, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    st.add_argument("--json", action="store_true", help="print the raw status dict")
    st.add_argument("--timeout", type=_positive, default=5.0, help="seconds to wait for each answer (default 5)")
    st.set_defaults(run=status)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`sluice` entry point; returns the exit status (0 ok, 1 a Sluice error, 2 bad usage; a
    watch stopped by SIGINT, SIGTERM or SIGHUP ends by that signal: a shell says 130, 143, 129)."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except SluiceError as exc:
        print(f"sluice {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
