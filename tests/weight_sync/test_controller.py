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
