#!/usr/bin/env bash
# The demo's pipeline with a DFlash drafter (a block drafter: docs/guide.md, section 8, "DFlash route, end to end")
# on the embedded default (SmolLM2-135M-Instruct, offline), with real CLI commands:
# [regenerate, or the demo's own data when examples/demo.sh already made it] -> train --drafter-kind dflash
# (block 4, 1 layer, 16 anchors per row; no vocab step: DFlash drafts from the verifier's whole vocabulary) ->
# evaluate (block speculative decoding on MT-bench, our decoder) -> check (SGLang, vLLM, llama.cpp)
# [-> vllm: the drafter served by vLLM, when `make vllm` installed it] [-> export --format gguf -> llamacpp: served
# by llama-server beside the verifier's GGUF, when `make llamacpp` built it] [-> push when HF_REPO_ID is set]
# -> summary of τ per engine.
#
#   make demo-dflash                               # small
#   DEMO_SIZE=tiny bash examples/demo_dflash.sh    # smoke run: 3-6 min with both engines on a shared 2-core machine
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE="${DEMO_SIZE:-small}"
OUT="${DEMO_OUT:-demo_out/dflash_$SIZE}"
DATA="${DEMO_DATA:-demo_out/$SIZE}"  # examples/demo.sh's output at the same size, reused when it holds the data
VERIFIER="smollm2-135m-instruct"
# The block: BLOCK tokens, the anchor (the verifier's newest token) and BLOCK - 1 masked positions, so every
# verify forward checks BLOCK - 1 drafts: evaluate's --k and the engines' draft count.
BLOCK=4; LAYERS=1; ANCHORS=16; K=$(( BLOCK - 1 ))
source examples/demo_sizes.sh  # PROMPTS, GEN_TOKENS, MAX_LEN, DRAFT_VOCAB, EVAL_Q, EVAL_TOKENS, SWEEP_*, RECIPE_OVERRIDES
# The demo's recipe (examples/recipes/small_cpu.yaml: lr 2e-3, cosine, one 256-token row per process and step,
# 6 epochs, the epoch with the best simulated τ kept), measured for EAGLE-3; no DFlash recipe is measured yet. Its
# TTT keys do not apply to a block drafter; the DFlash flags below are the block's shape.
RECIPE=examples/recipes/small_cpu.yaml
TRAIN_ROW="${DEMO_TRAIN_ROW:-256}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per process, as examples/demo.sh explains
START=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }
timed() { local name=$1; shift; local t0; t0=$(date +%s); "$@"; echo "$name $(( $(date +%s) - t0 ))" >> "$OUT/timings.txt"; }
: > "$OUT/timings.txt"

if [ -f "$DATA/features/manifest.json" ] && [ -d "$DATA/prepared" ]; then
  stage "data: the demo's regenerated answers and features in $DATA (examples/demo.sh, DEMO_SIZE=$SIZE)"
  FEATURES="$DATA/features"
else
  stage "regenerate: the verifier answers $PROMPTS training prompts (never MT-bench); the same pass keeps its hidden states"
  python -c "import json, sys; from eagle3_hf.demo_data.prompts import short_prompts
[print(json.dumps(p)) for p in short_prompts($PROMPTS)]" > "$OUT/prompts.jsonl"
  timed regenerate eagle3-hf regenerate --input "$OUT/prompts.jsonl" --output "$OUT/conversations.jsonl" \
    --verifier "$VERIFIER" --max-new-tokens "$GEN_TOKENS" --batch-size 64 --num-workers "${DEMO_WORKERS:-2}" \
    --features-out "$OUT/features" --prepared-out "$OUT/prepared" --max-seq-len "$MAX_LEN" --features-dtype bf16
  FEATURES="$OUT/features"
fi

# Data-parallel over gloo, one process per core, as in examples/demo.sh. The mask token (fed at the block's
# masked positions) is the tokenizer's highest-id special token absent from the data; the log names it.
TRAIN_PROCS="${DEMO_TRAIN_PROCS:-2}"
stage "train: a DFlash drafter, block $BLOCK, $LAYERS layer(s), $ANCHORS anchors per row ($RECIPE ${RECIPE_OVERRIDES[*]}, $TRAIN_PROCS processes)"
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
timed train accelerate launch --config_file accelerate_configs/cpu_2proc.yaml --num_processes "$TRAIN_PROCS" \
  --main_process_port "$PORT" \
  examples/train.py --config "$RECIPE" --verifier "$VERIFIER" --features "$FEATURES" --output-dir "$OUT/drafter" \
  --max-seq-len "$TRAIN_ROW" --drafter-kind dflash --block-size "$BLOCK" --dflash-layers "$LAYERS" \
  --dflash-anchors "$ANCHORS" "${RECIPE_OVERRIDES[@]}"

stage "evaluate: block speculative decoding on $EVAL_Q MT-bench questions x $EVAL_TOKENS tokens (k=$K, greedy), our decoder"
timed evaluate eagle3-hf evaluate --drafter "$OUT/drafter" --verifier "$VERIFIER" --prompts mt-bench \
  --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k "$K" --temperature 0 --output "$OUT/eval" \
  --write-to-drafter --no-progress

# A DFlash drafter's directory is already the layout all three engines read: no export to the standard layout.
stage "check the drafter for SGLang, vLLM and llama.cpp"
timed check eagle3-hf check "$OUT/drafter" --verifier "$VERIFIER" --engine all
timed check_llamacpp eagle3-hf check "$OUT/drafter" --verifier "$VERIFIER" --engine llamacpp

if [ "${DEMO_VLLM:-1}" != 0 ] && python -c "from eagle3_hf.engines.vllm.vllm_env import vllm_python; vllm_python()" 2>/dev/null; then
  stage "vllm: the drafter served by vLLM (method dflash) on the same $EVAL_Q MT-bench questions (k=$K, greedy)"
  timed vllm eagle3-hf evaluate --engine vllm --skip-transformers --drafter "$OUT/drafter" --verifier "$VERIFIER" \
    --prompts mt-bench --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k "$K" --temperature 0 \
    --output "$OUT/eval_vllm" --no-progress
else
  echo; echo "(vLLM not installed: \`make vllm\` adds a stage that serves the drafter in vLLM)"
fi

if [ "${DEMO_LLAMACPP:-1}" != 0 ] && python -c "from eagle3_hf.engines.llamacpp_env import find_llamacpp; find_llamacpp()" 2>/dev/null; then
  stage "export: the drafter as a GGUF (llama.cpp's converter), beside the embedded verifier's own GGUF"
  timed export eagle3-hf export "$OUT/drafter" --output "$OUT/gguf" --format gguf --verifier "$VERIFIER"
  stage "llama.cpp: the drafter served by llama-server (draft-dflash) on the same $EVAL_Q MT-bench questions (k=$K, greedy)"
  timed llamacpp eagle3-hf evaluate --engine llamacpp --skip-transformers --drafter "$OUT/drafter" \
    --verifier "$VERIFIER" --prompts mt-bench --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k "$K" \
    --temperature 0 --output "$OUT/eval_llamacpp" --no-progress
else
  echo; echo "(llama.cpp not built: \`make llamacpp\` adds the GGUF export and a stage that serves it in llama.cpp)"
fi

if [ -n "${HF_REPO_ID:-}" ]; then
  stage "push to the Hub as $HF_REPO_ID"
  GGUF=(); if [ -f "$OUT/gguf/dflash-drafter-f16.gguf" ]; then GGUF=(--gguf "$OUT/gguf/dflash-drafter-f16.gguf"); fi
  HF_HUB_OFFLINE=0 eagle3-hf push "$OUT/drafter" --repo-id "$HF_REPO_ID" "${GGUF[@]}"
fi

stage "summary ($(( $(date +%s) - START )) s; stage times in $OUT/timings.txt)"
python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
training = json.loads((out / "drafter" / "eagle3_training.json").read_text())
print(f"{'simulated τ (validation)':26s} {training['metrics']['simulated_acceptance_length']:.3f}")
for label, name in (("τ, our decoder", "eval/eagle3_evaluation.json"),
                    ("τ served by vLLM", "eval_vllm/eagle3_evaluation_vllm.json"),
                    ("τ served by llama.cpp", "eval_llamacpp/eagle3_evaluation_llamacpp.json")):
    path = out / name
    if not path.is_file():
        print(f"{label:26s} (not run)")
        continue
    ev = json.loads(path.read_text())
    print(f"{label:26s} {ev['acceptance_length']:.3f}  (k={ev.get('k')}, lossless {ev.get('lossless')}; {path})")
EOF
