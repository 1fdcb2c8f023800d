"""The package's import graph has no cycle, counting imports inside functions too: a cycle means two
modules each own half of a rule, which is how a contract ends up written twice."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_hf"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the eagle3_hf modules it imports anywhere in its body (module level or in a function)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                # `from .x import y` names module x.y when y is a submodule, else something inside x
                targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
                           for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "eagle3_hf.checkpoint" in graph["eagle3_hf.modeling_eagle3"]  # the walk sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_cycle_through_function_level_imports():
    graph = {"a": {"b"}, "b": set(), "c": {"a"}}
    assert find_cycle(graph) is None
    graph["b"].add("c")
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_checkpoint_is_at_the_bottom_of_the_house():
    graph = import_graph()
    assert graph["eagle3_hf.checkpoint"] <= {"eagle3_hf.configuration_eagle3", "eagle3_hf.verifier_family"}
    assert graph["eagle3_hf.configuration_eagle3"] <= {"eagle3_hf.verifier_family"}
    assert not graph["eagle3_hf.verifier_family"]  # the family helpers sit below everything
