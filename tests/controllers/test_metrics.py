"""Staleness metrics in `status()`, on the Prometheus endpoint and in `sluice status`."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import transfer_queue as tq
from tests.helpers import free_port, rows


def _scenario(client: tq.Client) -> None:
    """η = 1, batch 2. Leaves: version 2; 3 samples served at staleness 1; 2 dropped; 1 admission
    wait; 2 samples pending for task "train" in partition "train"."""
    with client.acquire(2, timeout=5) as grant:
        client.put(rows(2), grant=grant)  # version 0
    with pytest.raises(tq.TimeoutError):
        client.acquire(3, timeout=0.2)  # 2 of 4 slots left: waits, then gives up
    client.set_version(1)
    client.put(rows(3, 10), policy_version=1)
    first = client.get_meta(["x"], 2, task="train", timeout=5)
    assert first.policy_versions == [0, 0]
    client.ack(first)
    client.set_version(2)
    client.put(rows(2, 20), policy_version=0)  # 2 versions old: dropped when next asked for
    second = client.get_meta(["x"], 1, task="train", timeout=5)
    assert second.policy_versions == [1]


def test_status_reports_version_staleness_admission_and_queue_depth(make_cluster):
    cluster = make_cluster(max_staleness=1, consumer_batch_size=2)
    with cluster.connect() as client:
        _scenario(client)
        status = client.status()
    assert status["version"] == 2 and status["max_staleness"] == 1 and status["stale_policy"] == "drop"
    assert status["staleness"] == {"histogram": {"1": 3}, "dropped": 2, "kept": 0, "requeued": 0}
    assert status["admission"]["waits"] == 1 and status["admission"]["wait_seconds"] > 0
    assert status["partitions"]["train"]["tasks"]["train"] == {"consumed": 2, "leased": 1, "pending": 2}


def test_prometheus_endpoint_serves_the_staleness_metrics(make_cluster):
    port = free_port()
    cluster = make_cluster(max_staleness=1, consumer_batch_size=2, metrics_port=port)
    with cluster.connect() as client:
        _scenario(client)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("sluice_version", ())] == 2
    assert samples[("sluice_served_staleness_samples", (("staleness", "1"),))] == 3
    assert samples[("sluice_stale_samples_total", (("outcome", "dropped"),))] == 2
    assert samples[("sluice_stale_samples_total", (("outcome", "kept"),))] == 0
    assert samples[("sluice_stale_samples_total", (("outcome", "requeued"),))] == 0
    assert samples[("sluice_admission_waits_total", ())] == 1
    assert samples[("sluice_queue_depth", (("partition", "train"), ("task", "train")))] == 2
    assert samples[("sluice_samples_ack_refused_total", ())] == 0  # acks of leases that expired (test_leases.py)


def test_sluice_status_shows_the_staleness_metrics(make_cluster, capsys):
    from transfer_queue.cli import main

    cluster = make_cluster(max_staleness=1, consumer_batch_size=2)
    with cluster.connect() as client:
        _scenario(client)
    assert main(["status", cluster.address]) == 0
    out = capsys.readouterr().out
    assert "version 2" in out and "max_staleness 1" in out
    assert "1:3" in out  # staleness histogram: 3 samples one version behind
    assert "dropped 2" in out and "kept 0" in out and "requeued 0" in out
    assert "waits 1" in out
