"""Read llama.cpp's source (the tree `make llamacpp` unpacks) for which verifier architectures its graphs capture
EAGLE-3's layer inputs: Hugging Face architecture -> the converter's GGUF arch (`conversion/__init__.py` names the
module, its `@ModelBase.register` class the `model_arch`) -> the model class `llama_model_mapping` builds
(`src/llama-model.cpp`) -> the file under `src/models/` that defines its graph (following `using graph = ...` and
the base struct in `src/models/models.h`) -> whether that graph sets `res->t_layer_inp[il]`, which
`llama_context::extract_layer_inputs` (`src/llama-context.cpp`) needs for every id the drafter asks."""

from __future__ import annotations

import ast
import re
from pathlib import Path


def converter_arch(tree: Path, hf_arch: str) -> str | None:
    """The GGUF MODEL_ARCH name (e.g. "LLAMA") llama.cpp's converter writes for a text model of `hf_arch`."""
    index = (tree / "conversion" / "__init__.py").read_text()
    found = re.search(rf'"{re.escape(hf_arch)}":\s*"(\w+)"', index)  # the text models' map comes first
    if not found:
        return None
    module = ast.parse((tree / "conversion" / f"{found.group(1)}.py").read_text())
    classes = {c.name: c for c in module.body if isinstance(c, ast.ClassDef)}

    def arch_of(cls: ast.ClassDef) -> str | None:
        for node in cls.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "model_arch" for t in node.targets):
                return ast.unparse(node.value).rpartition(".")[2]
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                got = arch_of(classes[base.id])
                if got:
                    return got
        return None

    for cls in classes.values():
        registered = [a.value for d in cls.decorator_list if isinstance(d, ast.Call)
                      and ast.unparse(d.func).endswith("register") for a in d.args if isinstance(a, ast.Constant)]
        arch = arch_of(cls) if hf_arch in registered else None
        if arch and arch != "MMPROJ":
            return arch
    return None


def graph_file(tree: Path, gguf_arch: str) -> Path | None:
    """The src/models/*.cpp file defining the graph llama.cpp builds for the converter's MODEL_ARCH.`gguf_arch`
    (the two enums meet by the arch's name: gguf-py's MODEL_ARCH_NAMES, src/llama-arch.cpp's LLM_ARCH_NAMES)."""
    names = (tree / "gguf-py" / "gguf" / "constants.py").read_text()
    name = re.search(rf'MODEL_ARCH\.{gguf_arch}:\s*"([^"]+)"', names)
    enum = re.search(rf'\{{\s*LLM_ARCH_(\w+),\s*"{re.escape(name.group(1))}"\s*\}}',
                     (tree / "src" / "llama-arch.cpp").read_text()) if name else None
    if not enum:
        return None
    mapping = (tree / "src" / "llama-model.cpp").read_text()
    found = re.search(rf"case LLM_ARCH_{enum.group(1)}:\s*(?:case LLM_ARCH_\w+:\s*)*return new (\w+)\(", mapping)
    return _graph_of(tree, found.group(1), set()) if found else None


def _graph_of(tree: Path, cls: str, seen: set[str]) -> Path | None:
    if cls in seen:
        return None
    seen.add(cls)
    for path in sorted((tree / "src" / "models").glob("*.cpp")):
        if re.search(rf"\b{cls}::graph(?:<[^>]*>)?::graph\(", path.read_text(errors="replace")):
            return path
    header = (tree / "src" / "models" / "models.h").read_text()
    struct = re.search(rf"struct {cls}\s*:\s*public (\w+)\s*\{{(.*?)\n\}};", header, re.S)
    if not struct:
        return None
    alias = re.search(r"using graph = (\w+)::graph", struct.group(2))
    return _graph_of(tree, alias.group(1) if alias else struct.group(1), seen)


def captures_layer_inputs(path: Path) -> bool:
    return "t_layer_inp[" in path.read_text(errors="replace")
