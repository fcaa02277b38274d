"""A controller SIGKILLed mid-run and restarted from its journal loses no acked put.

Producers put samples tagged with unique ids and a consumer acks them while the controller is
killed; the storage units keep serving. The restarted controller (same port, `journal=`)
replays the journal: every put that was acked before or after the kill is delivered, no sample
whose ack was answered is delivered again, and versions and seals survive. An ack that failed as
the controller died may or may not have been journaled first: its samples are neither counted
delivered nor lost.
"""

from __future__ import annotations

import signal
import threading

import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import eventually


def _batch(first: int, n: int = 8) -> TensorDict:
    ids = torch.arange(first, first + n, dtype=torch.int64)
    return TensorDict({"id": ids, "x": ids.float().repeat_interleave(256).view(n, 256)}, batch_size=[n])


def test_a_controller_killed_mid_run_restarts_from_its_journal_and_loses_no_acked_put(tmp_path):
    journal = tmp_path / "controller.journal"
    with tq.init(num_storage_units=2, storage_capacity="64MiB", journal=journal) as cluster:
        stop = threading.Event()
        acked_puts: set[int] = set()  # sample ids whose put returned
        acked: list[int] = []  # sample ids whose ack was answered
        unsure: set[int] = set()  # ids whose ack failed: the controller may have journaled it before it died
        failures = {"producer": 0, "consumer": 0}

        def produce(lane: int) -> None:
            next_id = lane << 32
            client = None
            while not stop.is_set():
                try:
                    client = client or cluster.connect()
                    client.put(_batch(next_id), timeout=2.0)
                    acked_puts.update(range(next_id, next_id + 8))
                except tq.SluiceError:  # the controller is gone: reconnect (until it is back) and go on
                    failures["producer"] += 1
                    if client is not None:
                        client.close()
                    client = None
                next_id += 8
            if client is not None:
                client.close()

        def consume() -> None:
            client = None
            while not stop.is_set():
                try:
                    client = client or cluster.connect()
                    meta = client.get_meta(["id", "x"], 8, task="train", timeout=0.5, allow_partial=True)
                    if not len(meta):
                        continue
                    ids = client.get_data(meta)["id"].tolist()
                    try:
                        client.ack(meta)
                    except tq.SluiceError:
                        unsure.update(ids)
                        raise
                    acked.extend(ids)
                except tq.SluiceError:
                    failures["consumer"] += 1
                    if client is not None:
                        client.close()
                    client = None
            if client is not None:
                client.close()

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(2)] + [threading.Thread(target=consume)]
        with cluster.connect() as client:
            client.set_version(3)
        for t in threads:
            t.start()
        eventually(lambda: len(acked_puts) >= 400 and len(acked) >= 200, 60, "puts and acks before the kill")
        cluster.backend.procs[0].send_signal(signal.SIGKILL)
        cluster.backend.procs[0].wait()
        killed_at = len(acked_puts)
        # the clients notice (ServiceError after 5 s of silence), then the controller comes back
        eventually(
            lambda: failures["producer"] >= 2 and failures["consumer"] >= 1, 30, "clients saw the controller die"
        )
        cluster.restart_controller()
        consumed_at = len(acked)
        eventually(lambda: len(acked_puts) >= killed_at + 400, 60, "puts after the restart")
        eventually(lambda: len(acked) > consumed_at, 60, "acks after the restart")
        stop.set()
        for t in threads:
            t.join(60)
        with cluster.connect() as client:
            assert client.get_version() == 3
            client.seal("train")
            rest = []
            while True:  # everything not acked yet, until the sealed partition is drained
                meta = client.get_meta(["id"], 64, task="train", timeout=5.0, allow_partial=True)
                if not len(meta):
                    break
                rest.extend(client.get_data(meta)["id"].tolist())
                client.ack(meta)
            status = client.status()
        delivered = acked + rest
        lost = acked_puts - set(delivered) - unsure
        assert len(unsure) <= 8 * failures["consumer"]
        duplicated = len(acked) - len(set(acked))
        print(
            f"\njournal: {len(acked_puts)} samples acked by put ({killed_at} before the kill), {len(acked)} "
            f"acked by the consumer, lost {len(lost)}, duplicated acks {duplicated}; failures {failures}; "
            f"journal {journal.stat().st_size} bytes"
        )
        assert not lost, sorted(lost)[:10]
        assert duplicated == 0
        assert status["counters"]["open_puts"] == 0
