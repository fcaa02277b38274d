"""Byte sizes: as people write them ("2GiB", "512MB") for the API, the CLI and the services, and
as a storage unit's arena charges them (`ALIGN`, `arena_bytes`), which clients and the controller
account the same way."""

from __future__ import annotations

import re

from .errors import SchemaError

__all__ = ["ALIGN", "arena_bytes", "parse_bytes"]

ALIGN = 16
"""A storage unit stores each field of a write as one extent of its arena, starting on a multiple
of ALIGN bytes (the largest dtype's itemsize, so a mapped reader can view any field in place) and
occupying its bytes rounded up to ALIGN."""

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 10**6,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 10**9,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 10**12,
    "TIB": 1 << 40,
}


def parse_bytes(size: int | str) -> int:
    """`"2GiB"`, `"512MB"`, `1 << 30` -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", size)
    if not match or match.group(2).upper() not in _UNITS:
        raise SchemaError(f"cannot read {size!r} as a size; use e.g. '2GiB', '512MB' or an int")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def arena_bytes(nbytes: int) -> int:
    """Bytes a field of `nbytes` occupies in a storage unit's arena (`ALIGN`)."""
    return -(-nbytes // ALIGN) * ALIGN
