"""The rooms of `eagle3_hf/features/` say what they hold, and the folder decides which room a module is in:
`features/routes/` holds the routes (one module per way to get hidden states, opened only through the table,
features/table.py), `features/commands/` the feature commands, and every other module of `features/` is the core
(the FeatureSource interface, the table, the store, its writer and reader, rounding, packing, the one online
collator). Read from the source with `ast`, so an import inside a function counts too:

- training (`eagle3_hf/train/`, the training script) imports no route: it asks the table;
- the core imports no route, except the table (the registry that names them);
- a command imports the table and the core, never a route;
- a route imports only the core, never another route.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.source_imports import PACKAGE, imported

FEATURES = PACKAGE / "features"
# Route-to-route imports present when this test was written: each was to go, and the last went with the vllm-server
# row's own module. A new one fails the test; the list may only shrink, and is empty.
KNOWN: set[tuple[str, str]] = set()


def room(path: Path) -> str:
    """`routes`, `commands` or `core`: the folder of features/ a module lives in decides."""
    sub = path.relative_to(FEATURES).parts
    return sub[0] if len(sub) > 1 and sub[0] in ("routes", "commands") else "core"


def feature_modules(kind: str) -> dict[str, Path]:
    """The modules of one room, named relative to features/ (`table`, `routes.vllm_offline`)."""
    return {".".join(p.relative_to(FEATURES).with_suffix("").parts): p for p in sorted(FEATURES.rglob("*.py"))
            if p.name != "__init__.py" and room(p) == kind}


def routes_of(names: set[str]) -> set[str]:
    """The route modules (every module under features/routes/, a new one included) among `names`."""
    prefix = "eagle3_hf.features."
    return {route for route in feature_modules("routes") for n in names
            if n == prefix + route or n.startswith(prefix + route + ".")}


def test_training_imports_no_route():
    files = sorted((PACKAGE / "train").glob("*.py")) + [PACKAGE / "scripts" / "train.py"]
    bad = {f"{p.relative_to(PACKAGE.parent)} imports {', '.join(sorted(routes_of(imported(p))))}" for p in files
           if routes_of(imported(p))}
    assert not bad, ("training must reach the feature routes only through features/table.py (open_source, "
                     f"FeatureSpec): {'; '.join(sorted(bad))}")


def test_the_core_imports_no_route():
    bad = {f"features/{name.replace('.', '/')}.py imports {', '.join(sorted(routes_of(imported(path))))}"
           for name, path in feature_modules("core").items() if name != "table" and routes_of(imported(path))}
    assert not bad, ("a core module of features/ may not import a route (name it in the table, table.py, which "
                     f"imports it when opened): {'; '.join(sorted(bad))}")


def test_commands_import_no_route():
    bad = {f"features/{name.replace('.', '/')}.py imports {', '.join(sorted(routes_of(imported(path))))}"
           for name, path in feature_modules("commands").items() if routes_of(imported(path))}
    assert not bad, f"a command reaches a route through the table (features/table.py): {'; '.join(sorted(bad))}"


def test_routes_import_only_the_core():
    found = set()
    for name, path in feature_modules("routes").items():
        found |= {(name, other) for other in routes_of(imported(path)) if other != name}
    new = sorted(found - KNOWN)
    assert not new, ("a route imports another route; move what they share into the core (interface.py, "
                     "engine_states.py, write.py, ...): "
                     + "; ".join(f"features/{a.replace('.', '/')}.py imports {b}" for a, b in new))
    gone = sorted(KNOWN - found)
    assert not gone, "no longer imported, remove from KNOWN: " + "; ".join(f"{a} -> {b}" for a, b in gone)


def test_every_route_and_command_is_in_its_folder():
    """The rooms hold something: a move that empties one (or a rename of the folder) fails here, not silently."""
    assert feature_modules("routes") and feature_modules("commands") and "table" in feature_modules("core")
