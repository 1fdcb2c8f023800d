#!/usr/bin/env bash
# One command on one GPU (H200: well under 8 minutes): the Trainer's bf16 step at the Llama-3.1-8B and Kimi-K2.5 drafter shapes with sdpa
# and flex_attention (tokens/s, MFU, peak memory against `eagle3-hf plan`, host syncs, bf16 vs fp32), then a tiny extraction +
# speculative-decoding run with the lossless check. Writes $OUT/gpu_check.json (or gpu_check.json, or --out FILE).
#
#   gpu_check/gpu_check.sh                       # on the GPU machine
#   gpu_check/gpu_check.sh --device cpu --tiny   # the same code at a tiny shape (CI)
#
# Needs torch, transformers, accelerate, safetensors and numpy (a transformers dependency); nothing else:
# the extraction writes shards directly and never reads a `datasets` dataset. PYTHON selects the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
# freed tensors leave the resident set at once (the CPU path measures peak memory from it)
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
exec "${PYTHON:-python}" gpu_check/gpu_check.py "$@"
