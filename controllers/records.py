"""The records of the controller's journal: one tagged msgspec struct per kind of change to the
sample tables (never pickle). The parts that make a change build its record; `journal` writes
and replays them."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from transfer_queue.wire.messages import CommitPut, UnitInfo
from transfer_queue.wire.meta import FieldSpec

__all__ = [
    "Acked",
    "Committed",
    "Dropped",
    "Freed",
    "Header",
    "Keyed",
    "Placed",
    "Record",
    "Retired",
    "Sealed",
    "Table",
    "Tagged",
    "Unit",
    "Version",
]


class _Rec(msgspec.Struct, frozen=True, tag_field="rec"):
    pass


class Header(_Rec, tag="header", frozen=True):
    cluster_id: str
    next_index: int = 0


class Unit(_Rec, tag="unit", frozen=True):
    info: UnitInfo


class Retired(_Rec, tag="retired", frozen=True):
    unit_id: int


class Placed(_Rec, tag="placed", frozen=True):
    """New rows first..first+n-1 on `units`: a BeginPut's (committed later) or keys' (committed)."""

    partition: str
    first: int
    units: list[int]
    row_bytes: int
    fields: dict[str, FieldSpec]
    committed: bool = False
    field_bytes: dict[str, int] = {}
    """Each field's bytes per row (`ledger.field_sizes`); {} in a journal written before them."""


class Committed(_Rec, tag="committed", frozen=True):
    put: CommitPut


class Freed(_Rec, tag="freed", frozen=True):
    partition: str
    indexes: list[int]


class Acked(_Rec, tag="acked", frozen=True):
    partition: str
    task: str
    indexes: list[int]


class Sealed(_Rec, tag="sealed", frozen=True):
    partition: str


class Dropped(_Rec, tag="dropped", frozen=True):
    partition: str


class Keyed(_Rec, tag="keyed", frozen=True):
    """TransferQueue keys given to the rows at global `indexes` (their rows are `Placed`)."""

    partition: str
    keys: list[str]
    indexes: list[int]


class Tagged(_Rec, tag="tagged", frozen=True):
    """Tags merged into `keys`' tags (dict update), one per key."""

    partition: str
    keys: list[str]
    tags: list[dict[str, Any]]


class Version(_Rec, tag="version", frozen=True):
    version: int


class Table(_Rec, tag="table", frozen=True):
    """One partition's live rows, as a compaction writes them."""

    name: str
    sealed: bool
    schema: dict[str, FieldSpec]
    sources: list[tuple[str, str]]
    columns: dict[str, list[int]]
    """Partition column name -> its values over the live rows (booleans as 0/1)."""
    ready: dict[str, list[int]]
    """Field -> 0/1 per live row."""
    consumed: dict[str, list[int]]
    """Task -> 0/1 per live row."""
    field_bytes: dict[str, list[int]] = {}
    """Field -> the bytes each live row holds of it (`Partition.field_bytes`)."""


Record = Union[Header, Unit, Retired, Placed, Committed, Freed, Acked, Sealed, Dropped, Keyed, Tagged, Version, Table]
