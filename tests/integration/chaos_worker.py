"""A producer or consumer process for the fault-injection tests; the test SIGKILLs it at random.

    python -m tests.integration.chaos_worker producer ADDRESS FIRST_ID
    python -m tests.integration.chaos_worker consumer ADDRESS [PARTITION]

Each prints `READY` once connected. A producer puts batches of 8 samples with ids FIRST_ID, FIRST_ID + 1, ... and prints
`PUT id...` once a put returned (acked). A consumer leases 8 samples at a time, checks every
payload against its id (a torn sample would not match), prints `GOT id...`, acks, prints
`ACKED id...` and clears them (`LATE id...` instead when its lease ran out and another consumer
was handed them: that one acks them); it exits with `DRAINED` once the sealed partition is empty,
and with `DEAD <error>` when a service it needs died.
"""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDict

import transfer_queue as tq

WIDTH = 1024
BATCH = 8


def payload(ids: torch.Tensor) -> torch.Tensor:
    return ids.float().unsqueeze(1) * torch.ones(1, WIDTH)


def produce(client: tq.Client, first: int) -> None:
    next_id = first
    while True:
        ids = torch.arange(next_id, next_id + BATCH)
        client.put(TensorDict({"id": ids, "x": payload(ids)}, batch_size=[BATCH]), timeout=1.0)
        print("PUT", *ids.tolist(), flush=True)
        next_id += BATCH


def consume(client: tq.Client, partition: str) -> None:
    while True:
        try:
            meta = client.get_meta(["id", "x"], BATCH, task="train", partition=partition, timeout=5, lease_timeout=2)
        except tq.TimeoutError:
            continue
        if not len(meta):
            print("DRAINED", flush=True)
            return
        try:
            batch = client.get_data(meta)
        except tq.ServiceError:  # a storage unit died: its samples are lost, the others come again
            print("LOST", flush=True)
            client.nack(meta)
            continue
        if not torch.equal(batch["x"], payload(batch["id"])):
            print("TORN", *batch["id"].tolist(), flush=True)
        ids = batch["id"].tolist()
        print("GOT", *ids, flush=True)
        try:
            client.ack(meta)
        except tq.LeaseExpiredError:  # starved past the lease: another consumer has these, and acks them
            print("LATE", *ids, flush=True)
            continue
        print("ACKED", *ids, flush=True)
        client.clear(meta)


def main() -> None:
    role, address = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    try:
        with tq.connect(address) as client:
            print("READY", flush=True)
            if role == "producer":
                produce(client, int(sys.argv[3]))
            else:
                consume(client, sys.argv[3] if len(sys.argv) > 3 else "train")
    except tq.ServiceError as exc:
        print("DEAD", str(exc).replace("\n", " "), flush=True)


if __name__ == "__main__":
    main()
