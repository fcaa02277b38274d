"""`python -m controllers --config JSON`: run a controller, print `SLUICE_CONTROLLER <address>`.

Storage units register only with the cluster secret, read from `SLUICE_SECRET` (a random one
when unset: then no unit can join, which is only right for tests of the controller alone).
"""

from __future__ import annotations

import argparse
import os

import msgspec

from transfer_queue.host import reachable
from transfer_queue.wire.auth import from_env
from transfer_queue.wire.messages import ClusterConfig
from transfer_queue.wire.rpc import run_service

from .metrics import serve_prometheus
from .service import Controller


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m controllers", description=__doc__)
    parser.add_argument("--config", default="{}", help="ClusterConfig as JSON")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--cluster-id", default=None)
    args = parser.parse_args()
    config = msgspec.json.decode(args.config, type=ClusterConfig)

    async def make() -> Controller:
        ctl = Controller(
            config,
            f"tcp://{config.host}:{args.port or '*'}",
            args.cluster_id,
            os.environ.get("SLUICE_SECRET"),
            from_env(),
        )
        if config.metrics_port is not None:
            serve_prometheus(ctl.status, config.metrics_port, config.host)
        return ctl

    run_service(make, lambda ctl: f"SLUICE_CONTROLLER {reachable(ctl.address)}")


if __name__ == "__main__":
    main()
