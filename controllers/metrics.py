"""The optional Prometheus endpoint: the numbers of `status()`, read from its typed objects."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec

from .status import ClusterStatus

__all__ = ["serve_prometheus"]


def serve_prometheus(status: Callable[[], ClusterStatus], port: int, host: str) -> None:
    """Expose what `status()` returns as Prometheus metrics on http://host:port/metrics."""
    from prometheus_client import start_http_server
    from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
            now = status()
            yield GaugeMetricFamily("sluice_version", "Current trainer weight version", value=now.version)
            hist = GaugeMetricFamily(
                "sluice_served_staleness_samples", "Samples served, by staleness", labels=["staleness"]
            )
            for k, v in now.staleness.histogram.items():
                hist.add_metric([k], v)
            yield hist
            stale = CounterMetricFamily("sluice_stale_samples", "Too-stale samples by outcome", labels=["outcome"])
            for outcome in ("dropped", "kept", "requeued"):
                stale.add_metric([outcome], getattr(now.staleness, outcome))
            yield stale
            yield CounterMetricFamily(
                "sluice_admission_waits", "acquire calls that had to wait", value=now.admission.waits
            )
            yield GaugeMetricFamily(
                "sluice_admission_running", "Granted slots not yet put", value=now.admission.running
            )
            depth = GaugeMetricFamily("sluice_queue_depth", "Ready samples not yet taken", labels=["partition", "task"])
            for pname, part in now.partitions.items():
                for tname, task in part.tasks.items():
                    depth.add_metric([pname, tname], task.pending)
            yield depth
            yield GaugeMetricFamily("sluice_bytes", "Bytes held by storage units", value=now.bytes)
            for key, value in msgspec.structs.asdict(now.counters).items():
                yield CounterMetricFamily(f"sluice_{key}", key.replace("_", " "), value=value)

    REGISTRY.register(_Collector())
    start_http_server(port, addr=host)
