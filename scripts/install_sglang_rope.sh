#!/usr/bin/env bash
# SGLang's rotary-embedding code, for the tests that compare the RoPE it computes for a drafter with transformers'
# (tests/helpers/engine_rope.py). The SGLang wheel is unpacked without its dependencies (importing
# sglang.srt.layers.rotary_embedding loads none of its GPU kernels on a CPU) beside the three small packages its
# import chain needs that the vLLM venv lacks, and runs on the vLLM venv's interpreter, whose transformers is the
# version this SGLang release pins (5.19.0). Installed once outside the clone; a stamp holding the pins makes a
# second run instant, a changed pin reinstalls.
set -euo pipefail

SGLANG_VERSION=0.5.23
WANT="sglang==$SGLANG_VERSION orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1"
VLLM_VENV="${EAGLE3_HF_VLLM_VENV:-$HOME/.cache/eagle3_hf/vllm-venv}"
DIR="${EAGLE3_HF_SGLANG_ROPE:-$HOME/.cache/eagle3_hf/sglang-rope}"
STAMP="$DIR/.eagle3_hf_sglang_rope"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "sglang-rope: $DIR (SGLang $SGLANG_VERSION)"
    exit 0
fi
if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    echo "sglang-rope needs the vLLM venv ($VLLM_VENV): run \`make vllm\` first" >&2
    exit 1
fi
rm -rf "$DIR"
mkdir -p "$DIR"
# shellcheck disable=SC2086 # WANT is a list of requirement specifiers
"$VLLM_VENV/bin/python" -m pip install -q --no-deps --target "$DIR/site" $WANT
echo "$WANT" > "$STAMP"
echo "sglang-rope: $DIR (SGLang $SGLANG_VERSION)"
