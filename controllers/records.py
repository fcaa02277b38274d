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


class Header(_Rec, tag="header"):
    cluster_id: str
    next_index: int = 0


class Unit(_Rec, tag="unit"):
    info: UnitInfo


class Retired(_Rec, tag="retired"):
    unit_id: int


class Placed(_Rec, tag="placed"):
    """New rows first..first+n-1 on `units`: a BeginPut's (committed later) or keys' (committed)."""

    partition: str
    first: int
    units: list[int]
    row_bytes: int
    fields: dict[str, FieldSpec]
    committed: bool = False


class Committed(_Rec, tag="committed"):
    put: CommitPut


class Freed(_Rec, tag="freed"):
    partition: str
    indexes: list[int]


class Acked(_Rec, tag="acked"):
    partition: str
    task: str
    indexes: list[int]


class Sealed(_Rec, tag="sealed"):
    partition: str


class Dropped(_Rec, tag="dropped"):
    partition: str


class Keyed(_Rec, tag="keyed"):
    """TransferQueue keys given to the rows at global `indexes` (their rows are `Placed`)."""

    partition: str
    keys: list[str]
    indexes: list[int]


class Tagged(_Rec, tag="tagged"):
    """Tags merged into `keys`' tags (dict update), one per key."""

    partition: str
    keys: list[str]
    tags: list[dict[str, Any]]


class Version(_Rec, tag="version"):
    version: int


class Table(_Rec, tag="table"):
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


Record = Union[Header, Unit, Retired, Placed, Committed, Freed, Acked, Sealed, Dropped, Keyed, Tagged, Version, Table]
