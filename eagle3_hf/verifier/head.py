"""The verifier's head without its body: the final norm and lm_head that turn an engine's last hidden state into
our post-norm state and greedy token (the engine routes and the importers need only these two tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from .capture import final_norm
from .family import text_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def load_verifier_head(verifier: PreTrainedModel | str | Path,
                       revision: str | None = None) -> tuple[nn.Module, nn.Module, Any]:
    """(final norm, lm_head, text config) of a verifier, in float32 on the CPU.

    A loaded model is used as is. For a checkpoint directory of safetensors only those tensors are read
    (the model is built on the meta device), so importing for a 1 T-parameter verifier needs megabytes.
    """
    if isinstance(verifier, nn.Module):
        return final_norm(verifier), verifier.get_output_embeddings(), text_config(verifier)
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from .loading import load_verifier, resolve_verifier

    path = Path(resolve_verifier(str(verifier)))
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:  # a Hub id or another format: load it whole
        model = load_verifier(str(verifier), revision=revision)
        return final_norm(model), model.get_output_embeddings(), text_config(model)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    norm, head, embed = final_norm(model), model.get_output_embeddings(), model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            where.update({k: f for k in st.keys()})
    tied = bool(getattr(config, "tie_word_embeddings", False))  # what transformers itself reads to tie them
    for module in (norm, head):
        state = {}
        for pname, _ in module.named_parameters(recurse=False):
            key = f"{names[id(module)]}.{pname}"
            if key not in where and module is head and pname == "weight" and tied:
                key = f"{names[id(embed)]}.weight"  # tied embeddings: the head is the embedding matrix
            if key not in where:
                untied = " (config.json has tie_word_embeddings false: the head is its own tensor)" \
                    if module is head and not tied else ""
                raise ValueError(f"{path}: tensor {key!r} not found in {[f.name for f in files]}{untied}")
            with safe_open(where[key], framework="pt") as st:
                state[pname] = st.get_tensor(key).float()
        module.load_state_dict(state, assign=True)
        module.float().requires_grad_(False)
    return norm, head, text_config(model)
