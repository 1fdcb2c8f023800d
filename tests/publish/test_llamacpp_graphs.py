"""`check --engine llamacpp` refuses a verifier whose llama.cpp graph captures no layer inputs (DeepSeek-V3,
Kimi-K2.5, Gemma 3, Qwen2, ...): the rule in one line, and its table against llama.cpp's own source (the tree `make
llamacpp` unpacks; skipped without it)."""

from __future__ import annotations

import re

import pytest

from eagle3_hf.engines.llamacpp_env import LlamaCpp, llamacpp_dir
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.publish.llamacpp_graphs import LAYER_INPUT_GRAPHS

from tests.helpers.drafters import write_drafter
from tests.helpers.findings import codes, message
from tests.helpers.llamacpp_source import captures_layer_inputs, converter_arch, graph_file


@pytest.mark.parametrize("arch, level", [("DeepseekV3ForCausalLM", "error"), ("KimiK25ForConditionalGeneration",
                                          "error"), ("Gemma3ForCausalLM", "error"), ("LlamaForCausalLM", None),
                                         ("Qwen3ForCausalLM", None), ("FancyNewForCausalLM", "warning")])
def test_a_verifier_whose_graph_captures_no_layer_inputs_is_refused(arch, level, tmp_path):
    path = write_drafter(tmp_path / "d", verifier_architectures=[arch])
    found = check_drafter(path, engine="llamacpp")
    if level is None:
        assert "llamacpp-verifier-graph" not in codes(found)
        return
    assert "llamacpp-verifier-graph" in codes(found, level)
    said = message(found, "llamacpp-verifier-graph")
    if level == "error":
        assert f"src/models/{LAYER_INPUT_GRAPHS[arch][0]}" in said and "layer input tensor not found" in said
    assert "llamacpp-verifier-graph" not in codes(check_drafter(path))  # llama.cpp's alone, asked by name


def _tree():
    tree = LlamaCpp(llamacpp_dir()).tree
    if not (tree / "src" / "models" / "llama.cpp").is_file():
        pytest.skip(f"llama.cpp's source is not in {tree}: `make llamacpp` unpacks it")
    return tree


def test_the_table_is_what_llamacpps_source_says():
    """Every architecture of the table, followed through the converter, the arch names and the model mapping to
    its graph file, which sets res->t_layer_inp exactly where the table says; and the docstring's list of capturing
    files is every file that does."""
    tree = _tree()
    derived = {}
    for arch in LAYER_INPUT_GRAPHS:
        gguf = converter_arch(tree, arch)
        path = graph_file(tree, gguf) if gguf else None
        assert path is not None, f"{arch}: no graph found (converter arch {gguf})"
        derived[arch] = (path.name, captures_layer_inputs(path))
    assert derived == LAYER_INPUT_GRAPHS
    capturing = sorted(p.stem for p in (tree / "src" / "models").glob("*.cpp")
                       if re.search(r"t_layer_inp\[\w+\]\s*=", p.read_text(errors="replace")))
    from eagle3_hf.publish import llamacpp_graphs

    listed = re.search(r"only\s+these model files do so \(src/models/\): (.*?)\.\s", llamacpp_graphs.__doc__, re.S)
    assert listed and [n.strip() for n in listed.group(1).split(",")] == capturing
