"""docs/architecture.md's module map names every module of the source packages, and only those.

The map is the one list of modules (package docstrings point to it), so it must not drift: a
new module without a row, or a row for a module that was moved or removed, fails here. A row
stands for a `.py` file (`storage/arena.py`) or, ending in `/`, for a package (its
`__init__.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("transfer_queue", "controllers", "storage", "weight_sync", "recipes")
BEGIN, END = "<!-- module-map:begin -->", "<!-- module-map:end -->"


def map_rows() -> list[str]:
    """The paths in the first column of the map's table, in order."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"docs/architecture.md needs one {BEGIN} ... {END}"
    table = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    rows = [line for line in table.strip().splitlines()[2:]]  # past the header and its rule
    paths = []
    for line in rows:
        match = re.fullmatch(r"\| `([^`]+)` \| .+ \|", line)
        assert match, f"not a map row (| `path` | what it is |): {line!r}"
        paths.append(match.group(1))
    return paths


def source_modules() -> set[str]:
    """Every package (as `dir/`) and every module but `__init__.py` of the source packages."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            rel = path.relative_to(ROOT)
            found.add(f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix())
    return found


def test_the_map_names_every_module_once():
    rows = map_rows()
    duplicated = sorted({p for p in rows if rows.count(p) > 1})
    assert not duplicated, f"named twice in the module map: {duplicated}"
    missing = sorted(source_modules() - set(rows))
    assert not missing, f"add these to docs/architecture.md's module map: {missing}"


def test_every_module_the_map_names_exists():
    gone = sorted(set(map_rows()) - source_modules())
    assert not gone, f"the module map names modules that do not exist: {gone}"
