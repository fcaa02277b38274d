"""GPU staging beside a publisher's host staging, for the GPU-staging transports it serves with
host ones (`cuda_ipc`, `NixlTransport(memory="cuda")`).

A publisher on "auto" given `model=` of CUDA tensors, in a process with CUDA, offers `cuda_ipc`
beside `shm`, `ucx` and `tcp` (named transports may mix `cuda_ipc` with host ones for any
weights). The GPU memory that costs (`slots` × the rank's model bytes on the weights' device) is
taken only once a subscriber leases a version over `cuda_ipc` (`turn_on`, from the server
thread; with `model=` the slots are then allocated in the background): from then on each
version of CUDA weights is packed into a GPU slot first (device to device; the trainer waits
for that pack only) and copied to its host slot from there, so a co-located subscriber with
CUDA tensors applies device to device and others read host staging as before. A version that
reached only host staging (staged before the first such lease, or CPU weights) is copied host
to device into a GPU slot at its first GPU lease (`catch_up`, on a thread of its own), unless
GPU staging holds a newer one already. A GPU slot is leased only once complete (a lease waits
for its copy or its pack), and reused only once its readers released it.

Once the GPU has no memory for a slot (or allocating one fails otherwise), GPU staging stops
for good (`error` says why): it lets go of each slot as soon as no reader holds it and no
pack or copy is writing it (`SlotTable.retire`: its memory is back in PyTorch's allocator
then, though shared over CUDA IPC: `transfer_queue.cuda.ipc_share`), host staging goes on,
GPU-staging leases fail with `GpuStagingStoppedError` and the reason, and the rank's
description of its slots for a GPU-staging transport carries it, so that subscribers that
offered host transports too read host staging from then on (`WeightSubscriber`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from transfer_queue import GpuStagingStoppedError, TimeoutError, WeightSyncError
from transfer_queue.cuda import side_stream, synchronize

from .manifest import Manifest
from .staging import Slot, SlotTable

__all__ = ["GpuMirror"]

log = logging.getLogger("sluice.weight_sync")


class GpuMirror:
    """The GPU slots of one publisher rank that serves host and GPU-staging transports."""

    def __init__(self, slots: int, lease_timeout: float, ids: Iterator[int], timeout: float):
        self.table = SlotTable(slots, shared=True, lease_timeout=lease_timeout, ids=ids)
        """The GPU slots; its lease ids come from the host table's counter (`ids`), so a
        `Release` names one lease in either."""
        self.timeout = timeout
        self.on = False
        """Whether versions are staged here too (set by `turn_on`, read by `publish`)."""
        self.error = ""
        """Why GPU staging stopped or never started (no CUDA, no GPU memory); "" while it works."""
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="sluice-ws-mirror")
        self._copying: set[int] = set()
        """Versions being caught up (server thread only)."""
        self._failed: tuple[int, str] = (-1, "")
        """The last version whose catch-up failed, and why: its leases fail with that rather
        than copy it again."""
        self._nbytes = 0
        """The model's bytes, when the publisher was given `model=` (slots are then allocated at `turn_on`)."""

    def place(self, device: torch.device, nbytes: int) -> None:
        """The GPU slots go on `device` (the CUDA weights', first given by `model=` or a
        `publish`) and are allocated, `nbytes` each, in the background as GPU staging turns on,
        not in the next `publish`."""
        if self.table.device is None:
            self.table.device = device
            self._nbytes = nbytes

    def turn_on(self) -> None:
        """A subscriber leased a version over a GPU-staging transport: stage the next versions
        on the GPU too, its slots allocated now in the background once `place`d. Server thread.

        Raises:
            GpuStagingStoppedError: this process has no CUDA, or GPU staging stopped for lack
                of memory.
        """
        if not self.error and not self.on and not torch.cuda.is_available():
            self.error = "this publisher's process has no CUDA: it cannot stage versions on a GPU"
        self.check()
        if self.on:
            return
        self.on = True
        log.info(
            "a subscriber reads GPU staging: staging versions on %s too (%d slots of %s bytes)",
            self.table.device or "the weights' GPU",
            len(self.table.slots),
            self._nbytes or "the model's",
        )
        if self._nbytes and self.table.device is not None:
            self.table.prepare_in_background(self._nbytes, self.stop)

    def check(self) -> None:
        """Raises `GpuStagingStoppedError` with the reason if GPU staging stopped or cannot start."""
        if self.error:
            raise GpuStagingStoppedError(self.error)

    def claim(self, version: int, manifest: Manifest) -> Slot | None:
        """The GPU slot to stage `version` into, once on; `place`d before. None while off, once
        the GPU had no memory for it (GPU leases then fail with `error`), or when no slot is
        free now: `publish` never waits for GPU readers (host staging's readers would wait with
        it), and a version staged on the host alone reaches GPU staging by a catch-up."""
        if not self.on or self.error:
            return None
        try:
            slot = self._claim(version, manifest.nbytes, 0.0)
        except TimeoutError:
            return None
        except WeightSyncError:  # stopped: no memory for the slot
            return None
        slot.manifest = manifest
        return slot

    def _claim(self, version: int, nbytes: int, timeout: float, keep_newer: bool = False) -> Slot:
        """`SlotTable.claim`, where allocating the slot's memory failing stops GPU staging.

        Raises:
            GpuStagingStoppedError: no memory for the slot (GPU staging stopped).
            WeightSyncError: as `SlotTable.claim`.
            TimeoutError: as `SlotTable.claim`.
        """
        try:
            return self.table.claim(version, nbytes, timeout, keep_newer=keep_newer)
        except RuntimeError as exc:  # the allocator's: torch.OutOfMemoryError on a GPU
            self.stop(exc)
            raise GpuStagingStoppedError(self.error) from exc

    def stop(self, exc: BaseException) -> None:
        """Allocating GPU staging failed (`exc`: `torch.OutOfMemoryError` when the GPU had no
        memory): stop it for good and free each slot as it is let go (`SlotTable.retire`);
        its leases fail with the reason, which the rank's slot description carries too."""
        if self.error:
            return
        if isinstance(exc, torch.OutOfMemoryError):
            self.error = f"no GPU memory to stage versions on {self.table.device}: {exc}"
        else:
            self.error = f"allocating GPU staging on {self.table.device} failed: {exc}"
        log.warning("%s; freeing GPU staging, host staging goes on", self.error)
        self.table.retire()

    def on_its_way(self, version: int) -> bool:
        """Whether `version` is being copied or staged here (its leases wait for it). Server thread."""
        if version in self._copying:
            return True
        slot = self.table.find(version)
        return slot is not None and not slot.complete

    def why(self, version: int) -> str:
        """Why copying `version` to GPU staging failed ("": it did not fail; GPU staging that
        stopped is `check`'s)."""
        return self._failed[1] if self._failed[0] == version else ""

    def catch_up(self, host: SlotTable, version: int, device: torch.device | None, done: Callable[[], None]) -> None:
        """Copy `version` from its `host` slot into a GPU slot on the copier thread, unless it
        is being copied already, its last copy failed, or the host holds it no longer;
        `done` is called (from that thread) once it is there or failed. The slots live on
        `device` (the CUDA weights'; None: the current device) unless placed before. Server thread."""
        if version in self._copying or self._failed[0] == version or not self.on or self.error:
            return
        if self.table.device is None:
            self.table.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        got = host.lease(version)
        if got is None:
            return
        try:
            self._copier.submit(self._copy, host, version, got, done)
        except RuntimeError:  # the publisher is closing
            host.release(got[0])
            return
        self._copying.add(version)

    def _copy(self, host: SlotTable, version: int, got: tuple[int, Slot], done: Callable[[], None]) -> None:
        """The catch-up of `version` (copier thread): its host slot, leased as `got`, into a GPU slot."""
        lease, source = got
        slot = None
        try:
            manifest = source.manifest
            source.wait_filled(manifest.nbytes, version, self.timeout)
            if not host.pin:
                host.pin_all()  # host-to-device copies at pinned speed, for this and the next
            slot = self._claim(version, manifest.nbytes, self.timeout, keep_newer=True)
            slot.manifest = manifest
            device = self.table.device
            assert device is not None  # placed by `catch_up`
            _copy_whole(slot.mapped.tensor[: manifest.nbytes], source.mapped.tensor[: manifest.nbytes], device)
            with host.cond:
                if host.leased(lease) is not source or source.version != version:
                    raise WeightSyncError(f"version {version}'s host slot was reused while it was copied to the GPU")
            self.table.advance(slot, manifest.nbytes, complete=True)
        except Exception as exc:  # noqa: BLE001 - its leases fail with the reason
            log.warning("copying version %d to GPU staging failed: %s", version, exc)
            self._failed = (version, f"copying it to GPU staging failed: {exc}")
            if isinstance(exc, torch.cuda.OutOfMemoryError):  # the copy's own memory
                self.stop(exc)
            if slot is not None:
                self.table.fail(slot)
        finally:
            host.release(lease)
            done()

    def finished(self, version: int) -> None:
        """The catch-up of `version` ended (server thread, after `done`)."""
        self._copying.discard(version)

    def close(self) -> None:
        """Wait for a copy under way, then free the GPU slots."""
        self._copier.shutdown(wait=True, cancel_futures=True)
        self.table.close()


def _copy_whole(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
    """Copy host `src` into `dst` on `device` and wait for it: on a CUDA device on a side stream
    of its own, after the packs `publish` queued so far (`transfer_queue.cuda.background_copies`:
    one failed into the same slot may still run), and neither the trainer's stream nor later
    packs wait for it."""
    if device.type != "cuda":
        dst.copy_(src)
        return
    with torch.cuda.device(device), side_stream(device, "catch-up", after="background"):
        dst.copy_(src, non_blocking=True)
        synchronize(device)  # the current stream here: the side stream
