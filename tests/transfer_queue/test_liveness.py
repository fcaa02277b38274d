"""A dead service is reported within seconds as a `ServiceError` naming it, from every call;
the controller retires a dead storage unit, counts its samples lost (requeuing their prompts),
never serves them again, and takes the unit back when it registers again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import ROOT, eventually
from tests.helpers import put_anew
from tests.peers import ask, peer
from transfer_queue.host import arena_path
from transfer_queue.wire.messages import RegisterUnit, UnitInfo


def _td(n: int) -> TensorDict:
    return TensorDict({"x": torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 4)}, batch_size=[n])


def _blocked_calls(address: str) -> dict:
    """Calls that block on the controller, each in its own thread and client."""

    def stream(c):
        for _ in c.stream(["x"], 4, task="never"):
            pass

    def versions(c):
        next(iter(c.versions()))

    return {
        "stream": stream,
        "versions": versions,
        "lookup": lambda c: c.lookup("nobody", timeout=600),
        "get_meta": lambda c: c.get_meta(["x"], 4, task="t", timeout=600),
        "acquire": lambda c: c.acquire(4, timeout=600),
    }


def test_dead_controller_is_reported_from_every_call():
    cluster = tq.init(num_storage_units=1, storage_capacity="16MiB", max_staleness=0, consumer_batch_size=4)
    try:
        results: dict[str, tuple[BaseException | None, float]] = {}
        clients = {name: tq.connect(cluster.address) for name in _blocked_calls(cluster.address)}
        clients["acquire"].acquire(4)  # the whole budget: the next acquire waits
        killed = threading.Event()
        kill_time = []

        def run(name, fn):
            try:
                fn(clients[name])
                results[name] = (None, 0.0)
            except BaseException as exc:  # noqa: BLE001
                results[name] = (exc, time.monotonic() - kill_time[0] if killed.is_set() else -1.0)

        threads = [
            threading.Thread(target=run, args=item, daemon=True) for item in _blocked_calls(cluster.address).items()
        ]
        for t in threads:
            t.start()
        with tq.connect(cluster.address) as probe:
            eventually(lambda: probe.status()["admission"]["waiting"] >= 1, 10, "acquire parked")
        kill_time.append(time.monotonic())
        killed.set()
        cluster.backend.procs[0].send_signal(signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a call still hangs on the dead controller"
        for name, (exc, after) in results.items():
            assert isinstance(exc, tq.ServiceError), (name, exc)
            assert "controller" in str(exc), (name, exc)
            assert 0 <= after < 10, (name, after)
        print({name: round(after, 2) for name, (_, after) in results.items()})
        for c in clients.values():
            c.close()
    finally:
        cluster.shutdown()


async def test_dead_controller_is_reported_to_async_calls():
    cluster = tq.init(num_storage_units=1, storage_capacity="16MiB")
    try:
        client = await tq.connect_async(cluster.address)
        task = asyncio.ensure_future(client.lookup("nobody", timeout=600))
        versions = client.versions()
        nxt = asyncio.ensure_future(versions.__anext__())
        await client.status()
        cluster.backend.procs[0].send_signal(signal.SIGKILL)
        started = time.monotonic()
        for fut in (task, nxt):
            with pytest.raises(tq.ServiceError, match="controller"):
                await asyncio.wait_for(fut, 30)
        assert time.monotonic() - started < 10
        await client.close()
    finally:
        cluster.shutdown()


def _unit_proc(cluster: tq.Cluster, unit_id: int) -> subprocess.Popen:
    return cluster.backend.procs[1 + unit_id]


def test_a_stalled_controller_keeps_its_live_units(cluster, client):
    """A controller that could not run for longer than a unit's dead-after (CPU starved,
    suspended) heard nobody meanwhile: it must not retire its live units for its own silence."""
    client.put(_td(8))
    ctl = cluster.backend.procs[0]
    ctl.send_signal(signal.SIGSTOP)
    try:
        time.sleep(7.0)  # the fault itself: a stall longer than the 5 s dead-after
    finally:
        ctl.send_signal(signal.SIGCONT)
    resumed = client.status()["uptime_s"]
    status = eventually(lambda: (s := client.status())["uptime_s"] > resumed + 2.5 and s, 20, "two ping rounds")
    assert status["retired_units"] == {} and sorted(status["units"]) == ["0", "1"]
    assert status["counters"]["samples_lost"] == 0 and status["partitions"]["train"]["samples"] == 8


def test_dead_unit_is_retired_its_samples_lost_and_prompts_requeued(cluster, client):
    client.put(_td(4), partition="prompts")  # a put goes whole to the emptiest unit,
    put_anew(cluster.address, _td(4), partition="prompts")  # a new producer's to the other one
    taken = client.get_meta(["x"], 8, task="rollout", partition="prompts", timeout=10)
    client.ack(taken)
    halves = [taken.select(list(range(4, 8))), taken.select(list(range(4)))]
    puts = [(put_anew(cluster.address, _td(4), partition="train", source=half), half) for half in halves]
    on_dead = [i for r, _ in puts for i, u in zip(r.indexes, r.units) if u == 1]
    assert 0 < len(on_dead) < 8, "both units hold responses"
    dead_prompts = sum(1 for u in taken.units if u == 1)
    assert 0 < dead_prompts < 8, "both units hold prompts"
    live_sources = sum(1 for r, half in puts for u, s in zip(r.units, half.units) if u == 1 and s == 0)
    assert live_sources, "a response on the dead unit has its prompt on the live one"
    responses = next(r for r, _ in puts if r.units[0] == 1)
    survivors = [i for r, _ in puts for i in r.indexes if i not in on_dead]
    proc = _unit_proc(cluster, 1)
    proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    status = eventually(lambda: (s := client.status())["retired_units"] and s, 20, "unit 1 retired")
    print(f"unit retired {time.monotonic() - started:.2f} s after SIGKILL")
    assert list(status["units"]) == ["0"]
    assert status["counters"]["samples_lost"] == len(on_dead) + dead_prompts
    assert status["partitions"]["train"]["samples"] == 8 - len(on_dead)
    # prompts of lost responses whose prompt survived are offered to producers again
    again = client.get_meta(["x"], 8, task="rollout", partition="prompts", timeout=2, allow_partial=True)
    assert len(again) == live_sources
    # the survivors are served and readable; the lost ones never again
    meta = client.get_meta(["x"], 8, task="t", timeout=2, allow_partial=True)
    assert sorted(meta.indexes) == sorted(survivors)
    assert client.get_data(meta)["x"].shape == (len(meta), 4)
    client.ack(meta)
    # a client that still asks the dead unit hears a ServiceError naming it, within seconds
    started = time.monotonic()
    with pytest.raises(tq.ServiceError, match="storage unit 1"):
        client.get_data(responses)
    assert time.monotonic() - started < 10
    # new puts go to the surviving unit only; a sealed partition drains
    assert set(client.put(_td(4)).units) == {0}
    client.seal("train")
    assert sum(len(m) for _, m in client.stream(["x"], 4, task="t", timeout=10)) == 4
    # a unit that comes back registers again and takes new rows
    with _unit_back(cluster, 1):
        status = client.status()
        assert sorted(status["units"]) == ["0", "1"] and not status["retired_units"]
        with tq.connect(cluster.address) as fresh:
            assert 1 in fresh.put(_td(8), partition="more").units  # the emptiest unit


@pytest.mark.parametrize("use_shm", [False, True], ids=["tcp", "shm"])
def test_clients_connected_before_a_unit_restarted_reach_it_again(cluster, use_shm):
    """A unit that restarted listens at a new address (and maps a new arena): a client that
    learned the old one on connect learns the new one when a call to the old one fails, and
    puts and reads there again (the put was aborted, so it is put once more)."""
    put_anew(cluster.address, _td(8))  # unit 0, the emptiest: the restarted unit 1 is emptier
    with tq.connect(cluster.address, use_shm=use_shm) as producer, tq.connect(cluster.address) as trainer:
        _unit_proc(cluster, 1).send_signal(signal.SIGKILL)
        eventually(lambda: producer.status()["retired_units"], 20, "unit 1 retired")
        with _unit_back(cluster, 1):
            meta = producer.put(_td(4), partition="after")
            assert set(meta.units) == {1}
            assert (1 in producer.mapped_units) == use_shm  # its new arena
            assert trainer.get_data(meta)["x"].tolist() == _td(4)["x"].tolist()
            assert producer.status()["counters"]["open_puts"] == 0


@contextlib.contextmanager
def _unit_back(cluster: tq.Cluster, unit_id: int) -> Iterator[None]:
    """Unit `unit_id` (dead and retired) started again with the same id, its stale arena
    removed first, until the block ends."""
    os.unlink(arena_path(cluster.cluster_id, unit_id))
    env = {**os.environ, "PYTHONPATH": ROOT, "SLUICE_SECRET": cluster.secret}
    command = [sys.executable, "-m", "storage", "--unit-id", str(unit_id), "--capacity", str(128 << 20)]
    command += ["--cluster-id", cluster.cluster_id, "--controller", cluster.address]
    back = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert back.stdout is not None and back.stdout.readline().startswith("SLUICE_STORAGE ")
        yield
    finally:
        back.send_signal(signal.SIGTERM)
        back.wait(10)


def test_a_producer_whose_mapped_unit_died_puts_to_the_live_one(cluster, client):
    """A mapped producer reserves its next put's space on its last unit along with the put's
    `BeginPut`; when that unit died meanwhile, the put asks again as any put does and lands on
    the live unit, within seconds, and the next one reserves nothing on the dead unit."""
    first = client.put(_td(4))
    (dead,) = set(first.units)
    proc = _unit_proc(cluster, dead)
    proc.send_signal(signal.SIGKILL)
    eventually(lambda: client.status()["retired_units"], 20, f"unit {dead} retired")
    started = time.monotonic()
    assert set(client.put(_td(4)).units) == {1 - dead}
    assert time.monotonic() - started < 10
    started = time.monotonic()
    assert set(client.put(_td(4)).units) == {1 - dead}
    assert time.monotonic() - started < 1
    assert client.status()["counters"]["open_puts"] == 0


def test_put_to_a_hung_unit_fails_fast_and_frees_its_rows(cluster, client):
    client.put(_td(8))  # to unit 0, the emptiest
    proc = _unit_proc(cluster, 1)
    proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(tq.ServiceError, match="storage unit 1"):
            put_anew(cluster.address, _td(8), timeout=600)  # a new producer's first put: to unit 1
        assert time.monotonic() - started < 10
        status = client.status()
        assert status["counters"]["open_puts"] == 0
        assert status["partitions"]["train"]["committed"] == status["partitions"]["train"]["samples"]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_unit_registration_needs_the_cluster_secret(cluster, client, tmp_path):
    """The hijack of issue 9: an unauthenticated RegisterUnit reusing a live unit's id and
    pointing shm_path at an unrelated file is refused and counted; nothing changes."""
    victim = tmp_path / "unrelated"
    victim.write_bytes(b"keep me" * 4096)
    live = client.units[0]
    fake = UnitInfo(0, "tcp://127.0.0.1:9", live.capacity, str(victim), live.host_id)
    channel = peer(cluster.address)
    for secret in ["", "guess"]:
        reply = ask(channel, RegisterUnit(fake, secret))
        assert reply.code == "protocol" and "secret" in reply.message, reply
    channel.close()
    status = client.status()
    assert status["counters"]["registrations_refused"] == 2
    assert status["units"]["0"]["address"] == live.address
    client.put(_td(8))
    assert victim.read_bytes() == b"keep me" * 4096


def test_client_maps_only_its_clusters_arena_files(cluster, tmp_path):
    """A unit advertising any other shm path is reached over TCP, never mapped."""
    from transfer_queue.host import open_arena

    with tq.connect(cluster.address) as client:
        unit = client.units[0]
        assert unit.unit_id in client.mapped_units  # the genuine arena is mapped
        assert open_arena(client.cluster_id, 0, unit.shm_path, unit.capacity) is not None
        other = tmp_path / "other"
        other.write_bytes(bytes(unit.capacity))
        link = tmp_path / "link"
        link.symlink_to(unit.shm_path)
        for path in (str(other), str(link), f"/dev/shm/sluice-{client.cluster_id}-u1", "/dev/shm/../dev/shm/x"):
            assert open_arena(client.cluster_id, 0, path, unit.capacity) is None
        assert open_arena(client.cluster_id, 0, unit.shm_path, unit.capacity * 2) is None  # too small a file
