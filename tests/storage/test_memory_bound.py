"""A storage unit's RSS stays within its capacity + 10% under a flood of producers.

The controller admits a put only when its units have room, and at most capacity / 20 bytes of
open puts travel to a unit as data frames at once (`controllers/intake.py`); a unit refuses at
once frames it cannot place beyond that (`storage/service.py`). So the memory a unit holds
outside its arena (frames in flight, waiting writes) stays a small share of its capacity."""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import eventually, unit_status
from tests.helpers import status_bytes

CAPACITY = 64 << 20
BATCH = 4 << 20  # 6% of the capacity per put


def test_flooded_unit_stays_within_capacity_plus_ten_percent():
    with tq.init(num_storage_units=1, storage_capacity=CAPACITY) as cluster, cluster.connect() as client:
        pid = cluster.backend.procs[1].pid
        eventually(lambda: unit_status(client.units[0].address)["prefaulted"], 60, "arena pre-faulted")
        base = status_bytes(pid)  # interpreter + libraries + the whole (touched) arena
        stop = threading.Event()
        outcome = {"put": 0, "refused": 0}
        errors: list[BaseException] = []

        def produce() -> None:
            with tq.connect(cluster.address, use_shm=False) as producer:
                td = TensorDict({"x": torch.ones(16, BATCH // 64, dtype=torch.float32)}, batch_size=[16])
                while not stop.is_set():
                    try:
                        producer.put(td, timeout=2.0)
                        outcome["put"] += 1
                    except tq.CapacityError:
                        outcome["refused"] += 1
                    except BaseException as exc:  # noqa: BLE001 - reported by the test
                        errors.append(exc)
                        return

        def consume() -> None:
            with tq.connect(cluster.address) as consumer:
                while not stop.is_set():
                    meta = consumer.get_meta(["x"], 16, task="t", timeout=1.0, allow_partial=True)
                    if len(meta):
                        consumer.clear(meta)

        threads = [threading.Thread(target=produce) for _ in range(8)] + [threading.Thread(target=consume)]
        for t in threads:
            t.start()
        eventually(lambda: outcome["put"] >= 60, 120, "60 puts through a full unit")
        stop.set()
        for t in threads:
            t.join(60)
        peak = status_bytes(pid, "VmHWM")
        print(
            f"\nunit RSS: base {base >> 20} MiB (with the {CAPACITY >> 20} MiB arena), peak {peak >> 20} MiB "
            f"(+{(peak - base) / CAPACITY:.1%} of capacity); {outcome}"
        )
        assert not errors, errors
        assert peak - base <= CAPACITY // 10, f"peak {(peak - base) / CAPACITY:.1%} of capacity over the arena"
