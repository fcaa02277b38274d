"""No import circle inside a package: each module can be read knowing only the modules it imports
(imports under TYPE_CHECKING count too: a reader follows them the same way)."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("transfer_queue", "controllers", "storage", "weight_sync", "recipes", "benchmarks")


def _cycles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The groups of `package`'s modules that import each other in a circle (Tarjan's strongly
    connected components of more than one module, or one that imports itself)."""
    modules = sorted(graph.find_descendants(package) | {package})
    inside = set(modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & inside) for m in modules}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in edges[module]:
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1 or module in edges[module]:
                found.append(sorted(group))

    for module in modules:
        if module not in order:
            visit(module)
    return found


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(graph: grimp.ImportGraph, package: str) -> None:
    assert _cycles(graph, package) == []


def test_a_cycle_is_found() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert _cycles(graph, "pkg") == [["pkg.a", "pkg.b"]]
