"""The public Python API: the names `eagle3_hf` exports (lazily, so the CLI and the data stages import no torch),
and the README's "Python API" example run as written on a tiny verifier, its Hub lines against the loopback Hub."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eagle3_hf

ROOT = Path(__file__).resolve().parents[1]


def readme_python_example() -> str:
    """The code block under the README's '## Python API' heading."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Python API\n+```python\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no ```python block right under '## Python API'"
    return match.group(1)


def substituted(code: str, replacements: list[tuple[str, str, int]]) -> str:
    """`code` with each (old, new, count): old must occur exactly `count` times, so an edit of the README that
    this test would no longer exercise fails here instead of running something else."""
    for old, new, count in replacements:
        assert code.count(old) == count, f"the README's Python example has {old!r} {code.count(old)}x, not {count}x"
        code = code.replace(old, new)
    return code


def test_every_export_is_its_modules_object_and_dir_lists_it():
    assert eagle3_hf.__all__ == list(eagle3_hf._EXPORTS)  # the table and the static list name the same
    for name in eagle3_hf.__all__:
        value = getattr(eagle3_hf, name)
        assert value is getattr(importlib.import_module(value.__module__), name)
    assert set(eagle3_hf.__all__) <= set(dir(eagle3_hf))
    with pytest.raises(AttributeError, match="has no attribute 'Eagle3Nothing'"):
        eagle3_hf.Eagle3Nothing  # noqa: B018


def test_importing_the_package_imports_neither_torch_nor_transformers():
    """The exports are resolved on first use: `import eagle3_hf` and `dir()` stay light (the CLI's --help,
    the data stages), and `from eagle3_hf import Eagle3Config` brings the model code."""
    probe = ("import sys, eagle3_hf; names = dir(eagle3_hf); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
             "from eagle3_hf import Eagle3Config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split("\n")
    assert out[:2] == ["[]", "True"]


def test_the_readme_example_imports_only_the_top_level_api():
    """As `from trl import SFTTrainer, SFTConfig`: the example needs no module path inside the package."""
    imports = [node for node in ast.walk(ast.parse(readme_python_example()))
               if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {alias.name for node in imports if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in imports if isinstance(node, ast.ImportFrom)}
    assert modules == {"eagle3_hf", "transformers"}
    from_package = {alias.name for node in imports if isinstance(node, ast.ImportFrom)
                    and node.module == "eagle3_hf" for alias in node.names}
    assert from_package and from_package <= set(eagle3_hf.__all__)


def test_the_readme_example_trains_pushes_and_reloads_a_drafter(hub, tmp_path, monkeypatch):
    """The README's block, run with the tiny synthetic verifier as V and its features under ./features/, the
    sizes made tiny and ORG an organisation of the loopback Hub: it trains (evaluating and saving each epoch,
    the best τ kept), pushes through the drafter check with our model card, and the drafter downloaded from the
    Hub is the best checkpoint's weights."""
    from huggingface_hub import HfApi, ModelCard
    from safetensors.torch import load_file

    from tests.helpers.data import build_offline_data, save_verifier
    from tests.helpers.hub_server import WRITE_TOKEN, client_pointed_at

    verifier = save_verifier(tmp_path / "verifier")
    build_offline_data(tmp_path, verifier, num_samples=24, draft_vocab=64, aux_indices=None,
                       verifier_name=str(tmp_path / "verifier"))
    code = substituted(readme_python_example(), [
        ('"meta-llama/Llama-3.1-8B-Instruct"', repr(str(tmp_path / "verifier")), 1),
        ("draft_vocab_size=32000", "draft_vocab_size=64", 1),
        ("max_seq_len=2048", "max_seq_len=128", 2),
        ('"ORG/my-eagle3"', '"eagle-org/my-eagle3"', 2),
        ('Eagle3TrainingArguments(output_dir="runs/d", ',
         'Eagle3TrainingArguments(output_dir="runs/d", num_train_epochs=2, per_device_train_batch_size=2, '
         'disable_tqdm=True, report_to="none", ', 1),
    ])
    monkeypatch.chdir(tmp_path)  # "features/" and "runs/d" as the README names them
    monkeypatch.setenv("HF_TOKEN", WRITE_TOKEN)
    namespace: dict = {}
    torch.manual_seed(0)
    with client_pointed_at(hub.url, cache_dir=tmp_path / "cache"):
        exec(compile(code, "README.md (Python API)", "exec"), namespace)  # noqa: S102 (the repository's README)
        files = set(HfApi().list_repo_files("eagle-org/my-eagle3"))
        card = ModelCard.load("eagle-org/my-eagle3")

    assert {"config.json", "model.safetensors", "README.md"} <= files
    assert "eagle3" in card.data.tags  # ours, not transformers' generic card (base_model: a Hub id only)
    checkpoints = sorted((tmp_path / "runs" / "d").glob("checkpoint-*"))
    assert len(checkpoints) == 2  # one per epoch
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    evaluated = [e for e in state["log_history"] if "eval_simulated_acceptance_length" in e]
    assert len(evaluated) == 2 and state["best_model_checkpoint"] in [f"runs/d/{c.name}" for c in checkpoints]
    best = load_file(tmp_path / state["best_model_checkpoint"] / "model.safetensors")
    drafter, model = namespace["drafter"], namespace["model"]
    assert type(drafter) is eagle3_hf.Eagle3DraftModel and drafter is not model
    assert drafter.config.verifier_name_or_path == str(tmp_path / "verifier")  # V, read from its config
    reloaded = drafter.state_dict()
    assert set(best) <= set(reloaded)
    for name, tensor in best.items():  # the best checkpoint, loaded back at the end, is what the Hub serves,
        assert torch.equal(model.state_dict()[name].cpu(), tensor), name  # in bf16 (push's default)
        pushed = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(reloaded[name], pushed.to(reloaded[name].dtype)), name
