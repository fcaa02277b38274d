"""The local lane against ZeroMQ, in lock step: the tiny co-located put + `get_data` (256 x 8,
4 fields, mapped arena) of one client over the services' local lanes and of one over ZeroMQ
(its lanes forgotten, as on another host), taking turns call by call on one cluster so that both
see the same load. Prints each side's medians and the ratio lane / ZeroMQ.

The unit's reports to the controller go over the controller's lane for both clients (the
cluster's own choice), so against a tree without lanes the saving is larger than printed.

    python benchmarks/local_lane.py [--reps 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import transfer_queue as tq
from benchmarks.gpu import FIXED, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    small = batch(torch.device("cpu"), FIXED)
    with tq.init(num_storage_units=1) as cluster:
        lane, zmq = tq.connect(cluster.address), tq.connect(cluster.address)
        zmq._core.lanes.clear()  # as a client on another host: ZeroMQ to every service (none opened yet)
        seconds: dict[str, list[float]] = {"lane": [], "zmq": []}
        for i in range(args.reps + 5):
            pair = (("lane", lane), ("zmq", zmq))
            for name, client in pair if i % 2 else pair[::-1]:
                t0 = time.perf_counter()
                meta = client.put(small, "lane")
                got = client.get_data(meta)
                elapsed = time.perf_counter() - t0
                assert all(torch.equal(got[n], t) for n, t in small.items())
                client.clear(meta)
                if i >= 5:
                    seconds[name].append(elapsed)
        assert {type(c).__name__ for c in lane._channels.values()} == {"LocalChannel"}
        assert {type(c).__name__ for c in zmq._channels.values()} == {"Channel"}
        med = {name: statistics.median(s) for name, s in seconds.items()}
        for name, m in med.items():
            print(f"{name:>4}: put + get_data {m * 1e3:.3f} ms (median of {args.reps})")
        print(f"lane / zmq: {med['lane'] / med['zmq']:.2f}")
        lane.close()
        zmq.close()


if __name__ == "__main__":
    main()
