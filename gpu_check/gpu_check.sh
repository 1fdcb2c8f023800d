#!/usr/bin/env bash
# One command on one GPU (H200: within 8 minutes, a deadline of its own at 7): the Trainer's bf16 step at the
# Llama-3.1-8B and Kimi-K2.5 drafter shapes (tokens/s, MFU, peak memory against `eagle3-hf plan`, host syncs), bf16
# training against fp32 on each TTT step's logits, a tiny extraction + speculative decoding with the lossless check,
# the greedy head at Kimi-K2.5's shape, the loader against the plan and the hashing rate; flex_attention apart
# (optional). Writes $OUT/gpu_check.json (or gpu_check.json, or --out FILE).
#
#   gpu_check/gpu_check.sh                       # on the GPU machine
#   gpu_check/gpu_check.sh --device cpu --tiny   # the same code at a tiny shape (CI)
#
# Needs python3 with torch, transformers, accelerate, safetensors, numpy and pyyaml (all in a stock PyTorch GPU
# image: gpu_check/README.md); PYTHON selects another interpreter. GPU_CHECK_TIMEOUT (470 s) kills a run that
# outlives its own deadline.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
# freed tensors leave the resident set at once (the CPU path measures peak memory from it)
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "${PYTHON:-python3}" -m gpu_check.gpu_check "$@"
