"""The rooms of `eagle3_hf/features/` say what they hold: the core (the FeatureSource interface, the table of
sources, the store, its writer and reader, rounding, packing, the one online collator) and the routes (one module
per way to get hidden states, opened only through the table, features/sources.py). Read from the source with `ast`,
so an import inside a function counts too:

- training (`eagle3_hf/train/`, the training script) imports no route: it asks the table;
- the core imports no route (the table names them as strings and imports them when a route is opened);
- a route imports only the core, never another route.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "eagle3_hf"
FEATURES = "eagle3_hf.features"
CORE = {"source", "sources", "records", "store", "shard_writer", "write", "quantize", "packing", "reader", "collator",
        "feature_cache", "verify", "ordered_pool", "api_key", "vllm_states", "vllm_spec", "prepared_from_shards",
        "generated_samples", "generation_workers"}
# Route-to-route imports present when this test was written, in modules being reworked separately: each is to go.
# One that is gone must leave this list too (the test says so), so the list only shrinks.
KNOWN = {("vllm_offline", "vllm_server"), ("transformers_generation", "vllm_generation"),
         ("serve_vllm", "serve_features")}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Every module `path` imports (absolute names; `from X import y` counts X and X.y)."""
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def routes_of(names: set[str]) -> set[str]:
    """The feature modules among `names` that are not core (every module of features/ that is not CORE is a route,
    a new one included)."""
    modules = {p.stem for p in (PACKAGE / "features").glob("*.py") if p.stem != "__init__"}
    return {n.split(".")[2] for n in names
            if n.startswith(FEATURES + ".") and n.split(".")[2] in modules and n.split(".")[2] not in CORE}


def test_training_imports_no_route():
    files = sorted((PACKAGE / "train").glob("*.py")) + [PACKAGE / "scripts" / "train.py"]
    bad = {f"{p.relative_to(PACKAGE.parent)} imports {', '.join(sorted(routes_of(imported(p))))}" for p in files
           if routes_of(imported(p))}
    assert not bad, ("training must reach the feature routes only through features/sources.py (open_source, "
                     f"FeatureSpec): {'; '.join(sorted(bad))}")


def test_the_core_imports_no_route():
    bad = {f"features/{name}.py imports {', '.join(sorted(routes_of(imported(PACKAGE / 'features' / f'{name}.py'))))}"
           for name in sorted(CORE) if routes_of(imported(PACKAGE / "features" / f"{name}.py"))}
    assert not bad, ("a core module of features/ may not import a route (name it in the table, sources.py, which "
                     f"imports it when opened): {'; '.join(sorted(bad))}")


def test_routes_import_only_the_core():
    found = set()
    for path in sorted((PACKAGE / "features").glob("*.py")):
        if path.stem not in CORE and path.stem != "__init__":
            found |= {(path.stem, other) for other in routes_of(imported(path)) if other != path.stem}
    new = sorted(found - KNOWN)
    assert not new, ("a route imports another route; move what they share into the core (source.py, vllm_states.py, "
                     "write.py, ...): " + "; ".join(f"features/{a}.py imports {b}" for a, b in new))
    gone = sorted(KNOWN - found)
    assert not gone, "no longer imported, remove from KNOWN: " + "; ".join(f"{a} -> {b}" for a, b in gone)
