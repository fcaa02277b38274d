"""The trainer's versions packed on its GPU, so that a delta's compare runs on the device.

With deltas on and CUDA weights staged in host memory, a publisher rank packs each version
into a GPU buffer first (device to device, in the staging layout) and copies it to its host
slot from there, one copy per bucket. The compare then reads the new and the previous version
where they already are, at device memory speed; its changes (`delta.Changes`) stay there and
delta frames are encoded there, so only the frames (a few percent) cross to the host. The
cost is GPU memory: two
packed copies of the rank's weights (the version being staged and its base), held from the
first version of CUDA weights published with deltas on until the publisher closes
(or until the GPU has no memory for them: the compare then runs on the host).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .buckets import Destinations, pack
from .manifest import Manifest

__all__ = ["DevicePacks"]


class DevicePacks:
    """The last two versions of one rank, packed on its GPU: the newest (being staged and
    compared) and the one before (its base)."""

    def __init__(self) -> None:
        self._packs: list[tuple[int, Destinations]] = []  # (version, where it is packed), oldest first

    def base(self, version: int, manifest: Manifest) -> torch.Tensor | None:
        """The packed bytes of `version` laid out by `manifest`, if they are still held."""
        for held, destinations in self._packs:
            if held == version and destinations.manifest is manifest:
                return destinations.slot
        return None

    def pack(
        self, version: int, manifest: Manifest, tensors: Sequence[torch.Tensor], device: torch.device
    ) -> torch.Tensor:
        """Pack `tensors` as `version` on the caller's current stream, into the buffer that does
        not hold the newest version (it is the next compare's base); returns the packed bytes.
        The caller must have finished reading that buffer (its compare and its copy to the host)."""
        destinations = self._take(manifest, device)
        pack(manifest, tensors, destinations.slot, lambda _: None, destinations)
        self._packs.append((version, destinations))
        return destinations.slot

    def copy(self, version: int, manifest: Manifest, packed: torch.Tensor) -> torch.Tensor:
        """`pack` for a version packed on the GPU already (`packed`, laid out by `manifest`:
        a GPU staging slot), in one device-to-device copy."""
        destinations = self._take(manifest, packed.device)
        destinations.slot.copy_(packed)
        self._packs.append((version, destinations))
        return destinations.slot

    def _take(self, manifest: Manifest, device: torch.device) -> Destinations:
        """The buffer that does not hold the newest version, laid out by `manifest` (taken out
        of the list: the caller appends it with its new version)."""
        reuse = self._packs.pop(0) if len(self._packs) == 2 else None
        if reuse is not None and reuse[1].manifest is manifest:
            return reuse[1]
        del reuse  # a different layout: its buffer goes before the new one is allocated
        return Destinations(manifest, torch.empty(manifest.nbytes, dtype=torch.uint8, device=device))

    def clear(self) -> None:
        """Free the GPU buffers."""
        self._packs.clear()
