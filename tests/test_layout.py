"""The package's house rules, read from its own source: no import cycles, and a fusion
family borrows from ``fx_passes/matching/``, never from another family
(``docs/architecture.md``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "prepfuse"
FAMILIES = ("dsv4_indexer", "dsv4", "gqa")  # longest first: dsv4_indexer is not dsv4


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere, inside functions too (a deferred
    import that breaks a cycle is still one): ``from a import b`` counts ``a.b`` when that
    is a module, else ``a``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    found.add(full)
                elif node.module in modules:
                    found.add(node.module)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) - {name} for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a package importing its own submodules is no cycle:
    ``a`` -> ``a.b`` edges are dropped), or None."""
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"p": {"p.x"}, "p.x": {"q"}, "q": set()}) is None


def _family(module: str) -> str | None:
    leaf = module.rsplit(".", 1)[-1]
    return next((f for f in FAMILIES if leaf == f or leaf.startswith(f + "_")), None)


@pytest.mark.parametrize("module", sorted(m for m in _graph() if m.startswith("prepfuse.fx_passes.fusion.")))
def test_a_fusion_family_borrows_only_from_matching(module):
    mine = _family(module)
    others = [d for d in _graph()[module] if d.startswith("prepfuse.fx_passes.fusion.") and _family(d) != mine]
    assert others == [], f"{module} imports {others} from another family"
