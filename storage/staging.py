"""Staged writes: a large written field kept in the frame it arrived in, and served from there,
until it must be copied into the arena.

A storage unit copies every written frame into its arena, and for a TCP stream that copy costs
~20% of the throughput in memory traffic, though only ~6% of the CPU. A batch that is consumed
and freed soon after its put need never be copied, so a unit stages a write's large fields (see
`STAGE_BYTES`, `STAGE_SHARE`) and copies one only when it must: a mapped reader needs the arena's
bytes, a read run spans chunks, or staged frames exceed their share of memory (oldest first).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import numpy as np

from .arena import Arena, Chunk
from .space import Placed, chunks_of

__all__ = ["STAGE_BYTES", "STAGE_SHARE", "Staging"]

STAGE_BYTES = 1 << 20
"""A written field of this many bytes or more is staged; smaller ones are copied at once."""
STAGE_SHARE = 64
"""Only writes of at most capacity / STAGE_SHARE bytes are staged (about a third of the share
staged frames may hold): a larger one would push the ones before it out at once, so staging it
would only hold more memory (more fresh pages to fault in) before the same copies."""


class Staging:
    """The staged chunks of one arena, oldest first. Each holds its frame in `Chunk.staged`."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self._chunks: OrderedDict[Chunk, None] = OrderedDict()
        self.bytes = 0
        """Bytes of frames staged now."""
        self.copied = 0
        """Bytes of staged frames copied into the arena after all (the rest were freed uncopied)."""

    def store(self, placed: Placed, frames: Iterable[Any]) -> None:
        """Put a write's frames into its freshly allocated extents: large fields in one piece
        staged (when the write is small enough to stage), the rest copied into the arena now."""
        stage = sum(c.nbytes for c in chunks_of(placed)) <= self.arena.capacity // STAGE_SHARE
        array = self.arena.array
        for pieces, frame in zip(placed, frames):
            data = np.frombuffer(frame, dtype=np.uint8)
            chunk = pieces[0].chunk
            if stage and len(pieces) == 1 and chunk.nbytes >= STAGE_BYTES:
                chunk.staged = data
                self._chunks[chunk] = None
                self.bytes += chunk.nbytes
                continue
            for chunk, _, _, start in pieces:
                if chunk.nbytes:
                    array[chunk.offset : chunk.offset + chunk.nbytes] = data[start : start + chunk.nbytes]

    def keep(self, most: int) -> None:
        """Copy staged frames into the arena, oldest first, until at most `most` bytes stay
        staged."""
        self.drop_freed()
        for chunk in list(self._chunks):
            if self.bytes <= most:
                return
            self._unstage(chunk)

    def copy(self, chunks: Iterable[Chunk]) -> None:
        """Copy the staged ones of `chunks` into the arena now (a reader needs the arena's bytes)."""
        for chunk in chunks:
            if chunk.staged is not None:
                self._unstage(chunk)

    def drop_freed(self) -> None:
        """Forget, uncopied, the frames of chunks whose rows were all freed or replaced: their
        extents may belong to other writes by now."""
        for chunk in [c for c in self._chunks if c.refs <= 0]:
            self._forget(chunk)

    def clear(self) -> None:
        for chunk in list(self._chunks):
            self._forget(chunk)

    def _unstage(self, chunk: Chunk) -> None:
        if chunk.refs > 0:
            self.arena.array[chunk.offset : chunk.offset + chunk.nbytes] = chunk.staged
            self.copied += chunk.nbytes
        self._forget(chunk)

    def _forget(self, chunk: Chunk) -> None:
        chunk.staged = None
        del self._chunks[chunk]
        self.bytes -= chunk.nbytes
