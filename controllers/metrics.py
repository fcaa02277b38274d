"""What `status()` reports, and the optional Prometheus endpoint serving the same numbers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .service import Controller

__all__ = ["snapshot", "serve_prometheus"]


def snapshot(ctl: "Controller") -> dict:
    """A JSON-able picture of the cluster: partitions, tasks, versions, staleness, admission, bytes."""
    partitions = {}
    for name, part in ctl.partitions.items():
        n = part.n
        alive = part.alive[:n]
        committed = alive & part.committed[:n]
        tasks = {}
        for task_name, task in part.tasks.items():
            consumed = task.consumed[:n] & alive
            leased = (task.lease[:n] != 0) & alive & ~consumed
            tasks[task_name] = {
                "consumed": int(np.count_nonzero(consumed)),
                "leased": int(np.count_nonzero(leased)),
                "pending": int(np.count_nonzero(committed & ~consumed & ~leased)),
            }
        partitions[name] = {
            "samples": int(np.count_nonzero(alive)),
            "committed": int(np.count_nonzero(committed)),
            "sealed": part.sealed,
            "fields": {f: {"dtype": s.dtype, "shape": list(s.shape)} for f, s in part.schema.items()},
            "ready": {f: int(np.count_nonzero(r[:n] & alive)) for f, r in part.ready.items()},
            "bytes": int(part.row_bytes[:n][alive].sum()),
            "tasks": tasks,
        }
    stale = ctl.dispatch.stale
    return {
        "cluster_id": ctl.cluster_id,
        "uptime_s": round(time.time() - ctl.started, 3),
        "version": ctl.clock.current,
        "max_staleness": ctl.config.max_staleness,
        "stale_policy": ctl.config.stale_policy,
        "partitions": partitions,
        "units": {
            str(k): {"address": u.address, "capacity": u.capacity, "bytes": ctl.unit_bytes.get(k, 0)}
            for k, u in sorted(ctl.units.items())
        },
        "retired_units": {str(k): {"address": u.address} for k, u in sorted(ctl.retired.items())},
        "bytes": sum(ctl.unit_bytes.values()),
        "staleness": {
            "histogram": {str(k): v for k, v in sorted(stale.served_histogram.items())},
            "dropped": stale.dropped,
            "kept": stale.kept,
            "requeued": stale.requeued,
        },
        "admission": ctl.admission.stats(),
        "counters": {
            "samples_put": ctl.puts,
            "samples_served": ctl.dispatch.served,
            "samples_acked": ctl.dispatch.acked,
            "open_leases": len(ctl.dispatch.leases),
            "parked_get_meta": sum(len(q) for q in ctl.dispatch.waiters.values()),
            "open_puts": len(ctl.open_puts),
            "puts_waiting_for_room": len(ctl.intake),
            "puts_expired": ctl.puts_expired,
            "samples_lost": ctl.samples_lost,
            "registrations_refused": ctl.registrations_refused,
            "auth_refused": ctl.auth_refused,
            "requests_served": ctl.served,
            "requests_rejected": ctl.rejected,
        },
    }


def serve_prometheus(ctl: "Controller", port: int, host: str) -> None:
    """Expose `snapshot` as Prometheus metrics on http://host:port/metrics."""
    from prometheus_client import start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, REGISTRY

    class _Collector:
        def collect(self):
            snap = snapshot(ctl)
            yield GaugeMetricFamily("sluice_version", "Current trainer weight version", value=snap["version"])
            hist = GaugeMetricFamily("sluice_served_staleness_samples", "Samples served, by staleness", labels=["staleness"])
            for k, v in snap["staleness"]["histogram"].items():
                hist.add_metric([k], v)
            yield hist
            stale = CounterMetricFamily("sluice_stale_samples", "Too-stale samples by outcome", labels=["outcome"])
            for outcome in ("dropped", "kept", "requeued"):
                stale.add_metric([outcome], snap["staleness"][outcome])
            yield stale
            yield CounterMetricFamily("sluice_admission_waits", "acquire calls that had to wait", value=snap["admission"]["waits"])
            yield GaugeMetricFamily("sluice_admission_running", "Granted slots not yet put", value=snap["admission"]["running"])
            depth = GaugeMetricFamily("sluice_queue_depth", "Ready samples not yet taken", labels=["partition", "task"])
            for pname, part in snap["partitions"].items():
                for tname, task in part["tasks"].items():
                    depth.add_metric([pname, tname], task["pending"])
            yield depth
            yield GaugeMetricFamily("sluice_bytes", "Bytes held by storage units", value=snap["bytes"])
            for key, value in snap["counters"].items():
                yield CounterMetricFamily(f"sluice_{key}", key.replace("_", " "), value=value)

    REGISTRY.register(_Collector())
    start_http_server(port, addr=host)
