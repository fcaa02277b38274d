"""Against a real `tq.init` cluster: the publisher announces the channel and records each
version in the controller only once it is complete everywhere; subscribers find the channel
through the controller alone."""

from __future__ import annotations

import time

import transfer_queue as tq

from .harness import CTX, Subscribers, check
from .workers import BUCKET, kill, publisher


def test_versions_reach_the_controller_only_when_complete():
    with tq.init(num_storage_units=1, storage_capacity="64MiB") as cluster, tq.connect(cluster.address) as client:
        commands, out = CTX.Queue(), CTX.Queue()
        proc = CTX.Process(
            target=publisher, args=(out, commands, cluster.address, "auto", {"bucket_bytes": BUCKET}), daemon=True
        )
        proc.start()
        try:
            out.get(timeout=60)
            groups = [
                Subscribers(1, None, transport, address=cluster.address, first_id=i, timeout=5.0)
                for i, transport in enumerate(["shm", "tcp"])
            ]
            start = client.version
            commands.put(("publish", start + 1))
            assert client.wait_version(start + 1, timeout=30) == start + 1
            for group in groups:
                group.wait_applied(start + 1)
            commands.put(("publish", start + 2, True))  # staging stalls half way
            while out.get(timeout=30)[0] != "stalled":
                pass
            time.sleep(0.5)
            assert client.version == start + 1, "an incomplete version reached the controller"
            kill(proc)
            assert client.version == start + 1
            for group in groups:
                group.wait_errors(timeout=60)
                for summary in group.finish().values():
                    check(summary, start + 1)
        finally:
            if proc.is_alive():
                kill(proc)


def test_a_subscriber_that_finds_the_channel_through_the_controller_may_wait_without_a_deadline():
    """`wait(v, timeout=math.inf)` through the controller (`address=`): it waits for the channel
    to be announced and the version to come (it raised SchemaError at once: the controller's
    lookup refuses a timeout above 1e9 s)."""
    import math
    import threading

    import torch

    from weight_sync import WeightPublisher, WeightSubscriber

    with tq.init(num_storage_units=1, storage_capacity="64MiB") as cluster:
        mine = {"w": torch.zeros(8)}
        got: list[int] = []
        with WeightSubscriber(cluster.address, mine, timeout=2.0) as sub:
            waiting = threading.Thread(target=lambda: got.append(sub.wait(1, timeout=math.inf)), daemon=True)
            waiting.start()
            with WeightPublisher(cluster.address, "shm") as pub:
                pub.publish({"w": torch.ones(8)}, version=1)
                waiting.join(60)
            assert got == [1] and torch.equal(mine["w"], torch.ones(8))
