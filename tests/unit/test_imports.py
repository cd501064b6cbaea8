"""torchtitan's modules import each other one way only: no import cycle, even through imports inside functions.

A cycle held together by a function-level import works until someone moves that import to the top (or imports
the modules in the other order); base types live in modules of their own so that never has to happen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "torchtitan"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """torchtitan modules an Import / ImportFrom node names (a `from pkg import sub` counts as pkg.sub)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level:  # relative: resolve against the importing module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = {target} if target in known else set()
    for alias in node.names:
        if f"{target}.{alias.name}" in known:
            found.add(f"{target}.{alias.name}")
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> torchtitan modules it imports anywhere in its source (top level, functions, TYPE_CHECKING)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            edges |= _imported(node, name, path.name == "__init__.py", known)
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None. Iterative depth-first search with white/grey/black colouring."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles until none is left, each found after cutting the closing edge of the previous ones."""
    graph = {k: set(v) for k, v in graph.items()}
    cycles = []
    while (cycle := find_cycle(graph)) is not None:
        cycles.append(cycle)
        graph[cycle[-2]].discard(cycle[-1])
    return cycles


def test_find_cycle_reports_a_cycle_and_accepts_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert all_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b", "a"], ["c", "d", "c"]]


def test_graph_sees_function_level_and_relative_imports(tmp_path):
    tree = ast.parse("def f():\n    from torchtitan.config import errors\n    from . import manager\n")
    known = {"torchtitan.config", "torchtitan.config.errors", "torchtitan.config.manager"}
    found = set()
    for node in ast.walk(tree):
        found |= _imported(node, "torchtitan.config.validate", False, known)
    assert found == {"torchtitan.config", "torchtitan.config.errors", "torchtitan.config.manager"}


def test_no_import_cycle_between_torchtitan_modules():
    graph = import_graph()
    assert len(graph) > 30 and graph["torchtitan.train"], "the scan found no modules or no imports"
    cycles = all_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
