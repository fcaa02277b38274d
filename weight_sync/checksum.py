"""Validation mode: xxh3-64 checksums proving a subscriber holds exactly the trainer's snapshot.

Three points are compared. Right after staging, the publisher hashes every staged tensor
(`Snapshot.take`). When a subscriber verifies a version (the `Verify` request, while it holds a
lease), the publisher re-hashes the tensors it read (any that changed since staging is named as
corrupt) and hashes exactly the boxes it read. The subscriber hashes what arrived before applying
it (what landed in its own tensors, where it copies straight from a mapped slot) and compares
(`compare`), naming every tensor that differs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
import xxhash

from transfer_queue import WeightSyncError

from .manifest import Manifest
from .plan import Plan, Read
from .protocol import Checksums

__all__ = ["checksum", "box_checksum", "Snapshot", "compare"]


def checksum(tensor: torch.Tensor) -> int:
    """xxh3-64 of `tensor`'s bytes, row-major (a GPU tensor's are copied to the host first: a
    validating subscriber's tensors may live there)."""
    flat = tensor.reshape(-1).view(torch.uint8)
    return xxhash.xxh3_64_intdigest((flat if flat.device.type == "cpu" else flat.cpu()).numpy().data.cast("B"))


def box_checksum(slot: torch.Tensor, read: Read) -> int:
    """xxh3-64 of `read`'s box bytes (row-major) in `slot`, a uint8 staging tensor."""
    piece = slot[read.offset : read.end].view(*read.shape, read.itemsize)
    return checksum(piece[tuple(slice(l, h) for l, h in zip(read.lo, read.hi))])


@dataclass(frozen=True)
class Snapshot:
    """Checksums of every tensor of one staged version, taken right after staging."""

    starts: list[int]
    sums: list[int]
    names: list[str]

    @classmethod
    def take(cls, manifest: Manifest, slot: torch.Tensor) -> Snapshot:
        starts = [manifest.start(e) for e in manifest.entries]
        sums = [checksum(slot[s : s + e.nbytes]) for s, e in zip(starts, manifest.entries)]
        return cls(starts, sums, [e.name for e in manifest.entries])

    def verify(self, manifest: Manifest, slot: torch.Tensor, reads: list[Read]) -> Checksums:
        """Checksums of `reads`' boxes, and the names of the tensors they come from that no
        longer match this snapshot."""
        corrupt, checked, values = [], set(), []
        for read in reads:
            i = bisect.bisect_right(self.starts, read.offset) - 1
            if i not in checked:
                checked.add(i)
                if checksum(slot[self.starts[i] : self.starts[i] + manifest.entries[i].nbytes]) != self.sums[i]:
                    corrupt.append(self.names[i])
            values.append(box_checksum(slot, read))
        return Checksums(values, corrupt)


def compare(plan: Plan, checksums: dict[int, Checksums], arrived: list[torch.Tensor] | None = None) -> None:
    """Raise `WeightSyncError` naming every tensor whose bytes differ from the publisher's
    (`checksums[rank]` lists rank's reads in plan order): the bytes that `arrived`, one tensor
    per copy of `plan` in order, before they are applied; without them, what the copies wrote."""
    bad = set()
    seen: dict[int, int] = {}
    for n, copy in enumerate(plan.copies):
        i = seen.get(copy.rank, 0)
        seen[copy.rank] = i + 1
        if checksum(copy.dst if arrived is None else arrived[n]) != checksums[copy.rank].values[i]:
            binding = copy.binding
            bad.add(binding.target if binding.target == binding.source else f"{binding.target} (from {binding.source})")
    if bad:
        where = "after apply" if arrived is None else "in what arrived"
        raise WeightSyncError(f"checksum mismatch {where} in {len(bad)} tensor(s): {', '.join(sorted(bad))}")
