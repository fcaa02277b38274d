"""Space for writes of any size, through a real controller and storage units: a small put costs
its bytes (not a page per field), the controller's account of each unit agrees with the unit's
own, a long churn of small and large puts and clears never leaves a write waiting for an extent
while the unit has room, and a unit keeps no bytes of writes the controller did not plan."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import transfer_queue as tq
from tests.faults import unit_status
from tests.helpers import eventually
from tests.peers import ask, peer
from transfer_queue.wire.messages import AbortPut, BeginPut, ErrorReply, Write
from transfer_queue.wire.meta import FieldSpec
from transfer_queue.wire.sizes import arena_bytes


def _batch(rng: random.Random, n: int, tokens: int) -> TensorDict:
    """`n` samples of three fields: dense floats, a dense byte mask of odd size, ragged ids."""
    ids = [torch.arange(rng.randint(1, tokens), dtype=torch.int64) for _ in range(n)]
    return TensorDict(
        {
            "x": torch.ones(n, 150),
            "mask": torch.ones(n, 77, dtype=torch.uint8),
            "ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        },
        batch_size=[n],
    )


def _raw_bytes(td: TensorDict) -> list[int]:
    return [v.values().numel() * v.element_size() if v.is_nested else v.numel() * v.element_size() for v in td.values()]


def _accounts(client: tq.Client) -> tuple[int, int]:
    """(bytes the controller accounts on the units, bytes the units use), once every unit's use
    is within 1% below the controller's account of it (the frees reached the units)."""

    def settled() -> tuple[int, int] | None:
        units = client.status()["units"]
        pairs = [(units[str(u)]["bytes"], unit_status(info.address)["used"]) for u, info in client.units.items()]
        if all(0 <= ctl - used <= max(ctl // 100, 64) for ctl, used in pairs):
            return sum(ctl for ctl, _ in pairs), sum(used for _, used in pairs)
        return None

    return eventually(settled, 10, "the unit's use to match the controller's account")


@pytest.mark.parametrize("use_shm", [False, True])
def test_small_puts_cost_their_bytes_and_the_controller_accounts_them(make_cluster, use_shm: bool) -> None:
    cluster = make_cluster(storage_capacity="16MiB")
    rng = random.Random(1)
    with tq.connect(cluster.address, use_shm=use_shm) as client:
        td = TensorDict(
            {
                "x": torch.ones(4, 150),  # 2,400 bytes
                "tok": torch.ones(4, 40, dtype=torch.int64),  # 1,280
                "mask": torch.ones(4, 77, dtype=torch.uint8),  # 308
            },
            batch_size=[4],
        )
        client.put(td, partition="one")
        used = unit_status(client.units[0].address)["used"]
        assert used == sum(arena_bytes(n) for n in _raw_bytes(td)) == 4000  # a 4 KB put: 4 KB of arena
        raw = sum(_raw_bytes(td))
        for _ in range(200):
            batch = _batch(rng, 4, 60)
            raw += sum(_raw_bytes(batch))
            client.put(batch)
        ctl, used = _accounts(client)
        assert used <= 1.1 * raw, (used, raw)  # per field at most 15 bytes of alignment
        assert 0 <= ctl - used <= 4 * 201, (ctl, used)  # each field's bytes per row round up by < 1
        client.clear_partition()
        client.clear_partition("one")
        assert _accounts(client) == (0, 0)


def test_a_long_churn_of_small_and_large_puts_never_waits_for_an_extent(make_cluster) -> None:
    """Puts of 4 small samples and of 1-4 samples of 0.5-2 MiB, cleared mostly in order and sometimes out of
    it, with the live bytes up to 60% of the unit: every write finds an extent at once."""
    capacity = 32 << 20
    cluster = make_cluster(storage_capacity=capacity)
    rng = random.Random(7)
    with tq.connect(cluster.address, use_shm=False) as client:
        address = client.units[0].address
        live: deque[tuple[tq.BatchMeta, int]] = deque()
        held = 0
        for step in range(300):
            if rng.random() < 0.85:
                meta = client.put(_batch(rng, 4, 60), timeout=5)
            else:
                rows = [torch.ones(rng.randint(128 << 10, 512 << 10)) for _ in range(rng.randint(1, 4))]
                big = torch.nested.nested_tensor(rows, layout=torch.jagged)
                meta = client.put(TensorDict({"big": big}, batch_size=[len(rows)]), "big", timeout=5)
            nbytes = client.status()["units"]["0"]["bytes"] - held
            live.append((meta, nbytes))
            held += nbytes
            while held > 0.6 * capacity:
                k = 0 if rng.random() < 0.8 else rng.randrange(len(live))
                old, nbytes = live[k]
                del live[k]
                client.clear(old)
                held -= nbytes
            if step % 25 == 0:
                _accounts(client)  # the frees reached the unit
        _accounts(client)
        status = unit_status(address)
        assert status["writes_waited"] == 0 and status["fields_split"] > 0, status
        client.clear_partition()
        client.clear_partition("big")
        assert _accounts(client) == (0, 0)
        assert unit_status(address)["free_extents"] == 1  # everything coalesced again


def test_a_unit_drops_writes_the_controller_did_not_plan(make_cluster) -> None:
    """A write of an open put's rows without the controller's ticket (or with another unit's,
    or for other rows) is refused and stores nothing; a write of new columns of rows that are no
    live sample is freed by the controller as soon as the unit reports it. Real puts go on."""
    cluster = make_cluster(num_storage_units=2, storage_capacity="16MiB")
    spec = {"x": FieldSpec("float32", (1000,))}
    frame = [np.zeros(4000, np.float32)]
    with tq.connect(cluster.address, use_shm=False) as client:
        controller = peer(cluster.address)
        plan = controller.call(BeginPut("train", spec, 4, 4000))
        unit_id = plan.units[0]
        other = 1 - unit_id
        address = client.units[unit_id].address
        unit = peer(address)
        forged = [
            Write("train", plan.indexes, spec, put=plan.indexes[0]),  # no ticket
            Write("train", plan.indexes, spec, put=plan.indexes[0], ticket=b"\0" * 16),
            Write("train", [9, 10, 11, 12], spec, put=9, ticket=plan.tickets[unit_id]),  # other rows
            Write("other", plan.indexes, spec, put=plan.indexes[0], ticket=plan.tickets[unit_id]),
        ]
        for msg in forged:
            refused = ask(unit, msg, frame)
            assert isinstance(refused, ErrorReply) and refused.code == "protocol", refused
        status = unit_status(address)
        assert status["unplanned"] == len(forged) and status["used"] == 0 and not status["rows"]
        controller.call(AbortPut("train", plan.indexes))
        to_other = Write("train", plan.indexes, spec, put=plan.indexes[0], ticket=plan.tickets[unit_id])
        other_unit = peer(client.units[other].address)
        refused = ask(other_unit, to_other, frame)  # the ticket is for another unit
        assert isinstance(refused, ErrorReply) and refused.code == "protocol", refused
        for i in range(20):  # "new columns" of rows that do not exist: stored, reported, freed
            unit.post(
                Write(f"fuzz{i % 3}", [1000 + i, 2000 + i], {"y": FieldSpec("uint8", (50_000,))}), [bytes(100_000)]
            )
        eventually(lambda: unit_status(address)["used"] == 0 and not unit_status(address)["rows"], 10, "strays freed")
        client.put(TensorDict({"x": torch.ones(8, 1000)}, batch_size=[8]))
        meta = client.get_meta(["x"], 8, task="t", timeout=5)
        assert client.get_data(meta)["x"].sum().item() == 8000
        client.clear(meta)
        assert _accounts(client) == (0, 0)
        for channel in (unit, other_unit, controller):
            channel.close()
