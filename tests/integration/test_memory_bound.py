"""After a flood of producers a storage unit gives frame memory back to the system (a loop timer
calls `malloc_trim`, keeping 5% of capacity warm). While the flood lasts, frames in flight on
the sockets (one per producer) and writes waiting for space (bounded by the capacity) come on
top of the arena. Measured and bounded here; the issue's goal of capacity + 10% is not reached."""

from __future__ import annotations

import threading

import torch
from tensordict import TensorDict

import transfer_queue as tq

from .faults import eventually, unit_status

CAPACITY = 64 << 20
BATCH = 4 << 20


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(key)


def test_flooded_unit_gives_its_frame_memory_back():
    with tq.init(num_storage_units=1, storage_capacity=CAPACITY) as cluster, cluster.connect() as client:
        pid = cluster.backend.procs[1].pid
        eventually(lambda: unit_status(client.units[0].address)["prefaulted"], 60, "arena pre-faulted")
        base = _status_kib(pid, "VmRSS")  # interpreter + libraries + the whole (touched) arena
        stop = threading.Event()
        outcome = {"put": 0, "refused": 0}

        def produce() -> None:
            with tq.connect(cluster.address, use_shm=False) as producer:
                td = TensorDict({"x": torch.ones(16, BATCH // 64, dtype=torch.float32)}, batch_size=[16])
                while not stop.is_set():
                    try:
                        producer.put(td, timeout=2.0)
                        outcome["put"] += 1
                    except tq.CapacityError:
                        outcome["refused"] += 1

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
        peak = _status_kib(pid, "VmHWM")
        # each look is traffic too, so the unit trims within a second of it
        eventually(lambda: unit_status(client.units[0].address)["served"]
                   and _status_kib(pid, "VmRSS") - base <= CAPACITY // 2, 10, "frame memory given back")
        end = _status_kib(pid, "VmRSS")
        print(f"\nunit RSS: base {base >> 20} MiB (with the {CAPACITY >> 20} MiB arena), peak {peak >> 20} MiB "
              f"(+{(peak - base) / CAPACITY:.0%} of capacity), after the flood {end >> 20} MiB "
              f"(+{(end - base) / CAPACITY:.0%}); {outcome}")
        # kept afterwards: measured +6% to +38% of capacity (allocator fragmentation); the goal,
        # +10%, is not reached yet
        assert end - base <= CAPACITY // 2, (end - base) >> 20
        # at the peak: frames ZeroMQ has received but the unit has not stored yet (one per
        # producer in flight), some of them waiting for space
        assert peak - base <= 8 * BATCH + CAPACITY // 4, (peak - base) >> 20
