"""The package's import graph: no cycle (counting imports inside functions too: a cycle means two modules each
own half of a rule, which is how a contract ends up written twice), and the subpackages in layers, each
importing only those below it, so the folder names read as the architecture. Imports under `if TYPE_CHECKING:`
are annotations' names only, never run, and are no edge. The tests keep a rule of their own: no test module
imports another, nor a conftest; what they share is in tests/helpers/."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_hf"
TESTS = Path(__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (its `else` branch is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def import_graph() -> dict[str, set[str]]:
    """module -> the eagle3_hf modules it imports anywhere in its body (module level or in a function), type
    checkers' imports (`if TYPE_CHECKING:`) aside."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
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


def imported_top_levels(path: Path) -> set[str]:
    """Top-level names of every absolute import in a file, function-level imports included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names


# bottom to top: a subpackage may import itself and those before it, never one after it
LAYERS = ["constants", "errors", "nodes", "engines", "verifier", "model", "publish", "demo_data", "data", "features",
          "train", "decoding", "evaluation", "scripts", "cli"]
# the one upward edge: `Eagle3DraftModel.push_to_hub` (transformers' API, on the model) runs the publish step,
# imported inside that method
ALLOWED_UPWARD = {("eagle3_hf.model.modeling_eagle3", "eagle3_hf.publish.hub")}
# old import paths, kept as aliases of the moved modules: above everything
ALIASES = {"eagle3_hf", "eagle3_hf.configuration_eagle3", "eagle3_hf.modeling_eagle3"}


def layer_of(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, deps in graph.items() if m not in ALIASES for d in deps
            if d not in ALIASES and layer_of(d) > layer_of(m)}


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
    assert "eagle3_hf.model.checkpoint" in graph["eagle3_hf.model.modeling_eagle3"]  # the walk sees real edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_type_checking_imports_are_no_edge():
    tree = ast.parse("from typing import TYPE_CHECKING\nimport typing\n\nif TYPE_CHECKING:\n    import a\n"
                     "else:\n    import b\nif typing.TYPE_CHECKING:\n    import c\n\n\ndef f():\n    import d\n")
    imported = {alias.name for node in runtime_nodes(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported == {"typing", "b", "d"}


def test_the_walk_finds_a_cycle_through_function_level_imports():
    graph = {"a": {"b"}, "b": set(), "c": {"a"}}
    assert find_cycle(graph) is None
    graph["b"].add("c")
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_checkpoint_is_at_the_bottom_of_the_house():
    graph = import_graph()
    assert graph["eagle3_hf.model.checkpoint"] <= {"eagle3_hf.model.configuration_eagle3", "eagle3_hf.verifier.family"}
    assert graph["eagle3_hf.model.configuration_eagle3"] <= {"eagle3_hf.verifier.family"}
    assert not graph["eagle3_hf.verifier.family"]  # the family helpers sit below everything


def test_every_module_lives_in_a_known_layer():
    unplaced = [m for m in import_graph() if m not in ALIASES and m.split(".")[1] not in LAYERS]
    assert not unplaced, f"modules outside the layers (add their subpackage to LAYERS): {unplaced}"


def test_subpackages_import_only_the_layers_below():
    edges = upward_edges(import_graph())
    assert edges == ALLOWED_UPWARD, f"imports against the layering: {sorted(edges - ALLOWED_UPWARD)}"


def test_the_layer_check_sees_an_upward_import():
    graph = {"eagle3_hf.data.prepare": {"eagle3_hf.train.trainer"}, "eagle3_hf.train.trainer": set()}
    assert upward_edges(graph) == {("eagle3_hf.data.prepare", "eagle3_hf.train.trainer")}


def test_the_package_never_imports_experiments_or_bench():
    offenders = {str(p.relative_to(PACKAGE.parent)): sorted(found) for p in PACKAGE.rglob("*.py")
                 if (found := imported_top_levels(p) & {"experiments", "bench", "gpu_check", "tests"})}
    assert not offenders, offenders


def test_old_import_paths_are_the_moved_modules():
    from eagle3_hf import Eagle3Config, Eagle3DraftModel
    from eagle3_hf.configuration_eagle3 import Eagle3Config as OldConfig
    from eagle3_hf.modeling_eagle3 import Eagle3DraftModel as OldModel

    assert OldConfig is Eagle3Config and OldModel is Eagle3DraftModel


# ---------------------------------------------------------------- the tests' own imports


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports anywhere in its body; for `from m import a` both m and m.a (a may be a
    module); relative imports keep their dots (`from . import test_x` gives `.test_x`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            stem = "." * node.level + (node.module or "")
            if node.module:
                names.add(stem)
            names |= {f"{stem}.{alias.name}" if node.module else stem + alias.name for alias in node.names}
    return names


def is_test_module(name: str) -> bool:
    last = name.rpartition(".")[2]
    return last == "conftest" or last.startswith("test_")


def imports_of_tests(root: Path) -> dict[str, list[str]]:
    """File under `root` -> the test modules and conftests it imports (by any name: `test_x`, `tests.a.test_x`)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if names := sorted(n for n in imported_modules(path) if is_test_module(n)):
            found[path.relative_to(root).as_posix()] = names
    return found


def test_no_test_module_imports_another_test_module_or_conftest():
    assert "tests.helpers.data.make_prepared" in imported_modules(TESTS / "features" / "test_extract.py")  # real edges
    offenders = imports_of_tests(TESTS)
    assert not offenders, f"shared code belongs in tests/helpers/, shared fixtures in a conftest.py: {offenders}"


def test_the_test_import_check_finds_planted_violations(tmp_path):
    """Clean files pass; then a test module imports two others (one inside a function) and a helper imports
    conftest and, relatively, a test module: each is named."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "test_a.py").write_text(
        "from tests.helpers.data import rows\n\n\ndef test_a():\n    import os\n")
    (tmp_path / "helper.py").write_text("import json\nfrom tests.helpers.verifiers import make_tiny_verifier\n")
    assert imports_of_tests(tmp_path) == {}
    (tmp_path / "data" / "test_b.py").write_text(
        "from tests.data.test_extract import make_prepared\n\n\ndef test_b():\n    from test_a import rows\n")
    (tmp_path / "helper.py").write_text("from conftest import make_tiny_verifier\nfrom . import test_c\n")
    assert imports_of_tests(tmp_path) == {"data/test_b.py": ["test_a", "tests.data.test_extract"],
                                          "helper.py": [".test_c", "conftest"]}


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore is its module's own: what another module needs is public."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module not in (None, "__future__"):
                offenders += [f"{path.relative_to(PACKAGE.parent)}: {node.module}.{a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
    assert not offenders, offenders
