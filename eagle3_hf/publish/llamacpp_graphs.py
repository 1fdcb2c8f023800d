"""Which verifiers llama.cpp can serve an EAGLE-3 drafter beside: the target's graph must capture the input of
every layer the drafter reads, and most of llama.cpp's model graphs capture none.

Read in the llama.cpp tree `make llamacpp` builds (llama-cpp-python 0.3.36's `vendor/llama.cpp`, llama.cpp commit
0c1e570). `common/speculative.cpp` asks the target context for the drafter's layer ids
(`llama_set_embeddings_layer_inp`); after each target batch `llama_context::extract_layer_inputs`
(`src/llama-context.cpp`) copies `res->get_layer_inp(il)` for every id asked and aborts with "layer input tensor not
found" when the graph did not set it. A graph sets it with `res->t_layer_inp[il] = ...` in its layer loop, and only
these model files do so (src/models/): bailingmoe3, deepseek4, gemma4, hunyuan-vl, lfm2, llama, mimo2, minimax-01,
minimax-m2, muse-glimmer, nanbeige, nemotron-h, openai-moe, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next, qwen4exp.
Notably not deepseek2.cpp (DeepSeek-V3 and Kimi-K2.5: the converter writes both as DEEPSEEK2), gemma3.cpp,
qwen2.cpp, qwen2moe.cpp, glm4-moe.cpp, phi3.cpp, mistral3.cpp.

The table maps a Hugging Face architecture to the graph file llama.cpp runs for it: the converter's module for the
architecture (`conversion/__init__.py`) and its registered class's `model_arch`; that arch's name
(gguf-py `MODEL_ARCH_NAMES`, `src/llama-arch.cpp`); the class `llama_model_mapping` builds for it
(`src/llama-model.cpp`); the file defining that class's graph. tests/publish/test_llamacpp_graphs.py derives the same
table from the source when the build is there.
"""

from __future__ import annotations

from collections.abc import Sequence

from .llamacpp_rules import LLAMACPP, VERSION
from .report import Report

# Hugging Face architecture -> (llama.cpp graph file under src/models/, whether it captures layer inputs)
LAYER_INPUT_GRAPHS: dict[str, tuple[str, bool]] = {
    "LlamaForCausalLM": ("llama.cpp", True),
    "MistralForCausalLM": ("llama.cpp", True),
    "InternLM3ForCausalLM": ("llama.cpp", True),
    "Qwen3ForCausalLM": ("qwen3.cpp", True),
    "Qwen3MoeForCausalLM": ("qwen3moe.cpp", True),
    "Qwen3NextForCausalLM": ("qwen3next.cpp", True),
    "Qwen3_5ForConditionalGeneration": ("qwen35.cpp", True),
    "Qwen3_5MoeForConditionalGeneration": ("qwen35moe.cpp", True),
    "GptOssForCausalLM": ("openai-moe.cpp", True),
    "MiniMaxM2ForCausalLM": ("minimax-m2.cpp", True),
    "Gemma4ForCausalLM": ("gemma4.cpp", True),
    "Gemma4ForConditionalGeneration": ("gemma4.cpp", True),
    "Qwen2ForCausalLM": ("qwen2.cpp", False),
    "Qwen2MoeForCausalLM": ("qwen2moe.cpp", False),
    "DeepseekV3ForCausalLM": ("deepseek2.cpp", False),
    "KimiK25ForConditionalGeneration": ("deepseek2.cpp", False),
    "Gemma3ForCausalLM": ("gemma3.cpp", False),
    "Gemma3ForConditionalGeneration": ("gemma3.cpp", False),
    "Glm4MoeForCausalLM": ("glm4-moe.cpp", False),
    "Phi3ForCausalLM": ("phi3.cpp", False),
    "Mistral3ForConditionalGeneration": ("mistral3.cpp", False),
}


def check_llamacpp_verifier(architectures: Sequence[str] | None, rep: Report) -> None:
    """An error when llama.cpp's graph for the verifier captures no layer inputs (serving aborts at the first
    prompt); a warning when the architecture is not one read here; nothing when it is unknown."""
    if "llamacpp" not in rep.engines or not architectures:
        return
    arch = architectures[0]
    if arch not in LAYER_INPUT_GRAPHS:
        rep.add("warning", "llamacpp-verifier-graph", f"verifier architecture {arch}: whether llama.cpp's graph for "
                f"it captures the layer inputs an EAGLE-3 drafter reads was not read here ({VERSION}; read for: "
                f"{', '.join(a for a, (_, ok) in LAYER_INPUT_GRAPHS.items() if ok)})", LLAMACPP)
        return
    graph, captures = LAYER_INPUT_GRAPHS[arch]
    if not captures:
        rep.add("error", "llamacpp-verifier-graph", f"verifier architecture {arch}: llama.cpp's graph for it "
                f"(src/models/{graph}, {VERSION}) captures no layer inputs (no res->t_layer_inp), so serving an "
                "EAGLE-3 drafter beside it aborts at the first prompt ('layer input tensor not found', "
                "src/llama-context.cpp extract_layer_inputs); serve it with vLLM or SGLang", LLAMACPP)
