"""Training and evaluation name no drafter kind: what differs by kind is reached through its row in
engines/table.py (its model class, its KindTraining), so a third kind adds a row and its own modules, and the
Trainer, `evaluate` and the engine evaluations stay as they are. Read from the source with `ast` (an import inside
a function counts too; a docstring does not):

- the Trainer (train/trainer.py, train/kind_training.py), the training script and every module of evaluation/
  import no module of a kind
  (one whose file name carries a kind's name, or that a row names as its model or training);
- nor compare anything with a kind's name (a string constant equal to one).
"""

from __future__ import annotations

import ast
from pathlib import Path

from eagle3_hf.engines.table import KINDS

from tests.helpers.source_imports import PACKAGE, imported, module_name

GENERIC = [PACKAGE / "train" / "trainer.py", PACKAGE / "train" / "kind_training.py", PACKAGE / "scripts" / "train.py",
           *sorted((PACKAGE / "evaluation").glob("*.py"))]
# EAGLE-3-only features of evaluation/ present when this test was written (tree sweeps, per-step accuracies from
# two feature sets): they take an EAGLE-3 drafter by design. A new one fails the test; the list may only shrink.
KNOWN = {("evaluation/sweep.py", "eagle3_hf.model.modeling_eagle3"),
         ("evaluation/feature_diff.py", "eagle3_hf.model.modeling_eagle3")}


def kind_modules() -> set[str]:
    names = {where.split(":")[0] for row in KINDS for where in (row.model, row.training)}
    names |= {module_name(p) for p in PACKAGE.rglob("*.py")
              if any(row.name in p.stem for row in KINDS) and p.parent != PACKAGE}
    return names


def kind_names_compared(path: Path) -> list[int]:
    """Lines where a string constant equal to a kind's name appears outside a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    names = {row.name for row in KINDS}
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings]


def test_the_kind_modules_are_found():
    found = kind_modules()  # the rule below means something only if it sees each kind's own modules
    for row in KINDS:
        assert row.model.split(":")[0] in found and row.training.split(":")[0] in found
    assert {"eagle3_hf.train.dflash_loss", "eagle3_hf.model.configuration_eagle3"} <= found


def test_training_and_evaluation_import_no_kind_module():
    owned = kind_modules()
    bad = {(str(p.relative_to(PACKAGE)), name) for p in GENERIC for name in imported(p) if name in owned}
    assert bad <= KNOWN, ("reach a kind through its row in engines/table.py (model_class(), training_class()), "
                          f"not its modules: {sorted(bad - KNOWN)}")
    assert KNOWN <= bad, f"gone, take them off KNOWN: {sorted(KNOWN - bad)}"


def test_training_and_evaluation_compare_no_kind_name():
    bad = {str(p.relative_to(PACKAGE)): lines for p in GENERIC if (lines := kind_names_compared(p))}
    assert not bad, f"a kind's name in code (ask its row in engines/table.py instead): {bad}"
