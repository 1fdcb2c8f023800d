#!/usr/bin/env bash
# The whole pipeline on the embedded default (SmolLM2-135M-Instruct, offline), with real CLI commands:
# regenerate (answers + features in one pass) -> vocab -> train (accelerate launch) -> evaluate (chain speculative
# decoding on MT-bench) -> tree (a short SGLang-style sweep on development prompts, the fastest tree on the same
# MT-bench questions) -> export -> check [-> vllm: the export served by vLLM, when `make vllm` installed it]
# [-> llamacpp: the export as a GGUF served by llama-server, when `make llamacpp` built it]
# -> summary [-> push when HF_REPO_ID is set].
#
#   make demo                      # small: the time of the last run is in docs/results/demo.md
#   DEMO_SIZE=large make demo      # more data, longer training, all 80 MT-bench questions
#   DEMO_SIZE=tiny bash examples/demo.sh   # seconds-scale smoke run (what CI executes)
set -euo pipefail
cd "$(dirname "$0")/.."

SIZE="${DEMO_SIZE:-small}"
OUT="${DEMO_OUT:-demo_out/$SIZE}"
VERIFIER="smollm2-135m-instruct"
source examples/demo_sizes.sh  # PROMPTS, GEN_TOKENS, MAX_LEN, DRAFT_VOCAB, EVAL_Q, EVAL_TOKENS, SWEEP_*, RECIPE_OVERRIDES
# The training recipe is examples/recipes/small_cpu.yaml (chosen by experiments/recipe.py: docs/results/recipe.md):
# lr 2e-3, cosine, one 256-token row per process and optimizer step (512 tokens with 2 processes), 6 epochs, the
# epoch with the best simulated τ kept. The tiny size overrides its epochs, lr and validation split.
RECIPE=examples/recipes/small_cpu.yaml
TRAIN_ROW="${DEMO_TRAIN_ROW:-256}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# One thread per process by default: these models are small, and on a shared 2-core machine two threads per
# process were measured 5-10x slower (oversubscription). Set OMP_NUM_THREADS=2 on an idle machine.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
START=$(date +%s)
stage() { echo; echo "=== [$(( $(date +%s) - START ))s] $*"; }
timed() { local name=$1; shift; local t0; t0=$(date +%s); "$@"; echo "$name $(( $(date +%s) - t0 ))" >> "$OUT/timings.txt"; }
: > "$OUT/timings.txt"

stage "regenerate: the verifier answers $PROMPTS training prompts (never MT-bench); the same pass keeps its hidden states"
python -c "import json, sys; from eagle3_hf.demo_data.prompts import short_prompts
[print(json.dumps(p)) for p in short_prompts($PROMPTS)]" > "$OUT/prompts.jsonl"
# One verifier pass for answers and features (replaces prepare + extract): aux hidden states (2, N//2, N-3),
# post-norm final state and greedy tokens of prompt + answer -> sharded safetensors, plus the prepared dataset
# (input_ids + assistant loss mask) for vocab. Two processes, one per core, share the length-sorted batches.
# DEMO_ENGINE=vllm: vLLM's CPU build answers and extracts instead (`make vllm` first; README: the demo's time both ways).
if [ "${DEMO_ENGINE:-transformers}" = vllm ]; then
  ENGINE_ARGS=(--engine vllm --threads "${DEMO_VLLM_THREADS:-2}" --vllm-batch-size 32 --no-progress)
else
  ENGINE_ARGS=(--batch-size 64 --num-workers "${DEMO_WORKERS:-2}")
fi
timed regenerate eagle3-hf regenerate --input "$OUT/prompts.jsonl" --output "$OUT/conversations.jsonl" \
  --verifier "$VERIFIER" --max-new-tokens "$GEN_TOKENS" "${ENGINE_ARGS[@]}" \
  --features-out "$OUT/features" --prepared-out "$OUT/prepared" --max-seq-len "$MAX_LEN" --features-dtype bf16

stage "vocab: the $DRAFT_VOCAB most frequent assistant tokens"
timed vocab eagle3-hf vocab --data "$OUT/prepared" --draft-vocab-size "$DRAFT_VOCAB" --output "$OUT/features/vocab.safetensors"

# Data-parallel over gloo, one process per core; each takes one row of $TRAIN_ROW tokens per step.
TRAIN_PROCS="${DEMO_TRAIN_PROCS:-2}"
stage "train: accelerate launch examples/train.py --config $RECIPE ${RECIPE_OVERRIDES[*]} (from scratch, $TRAIN_PROCS processes)"
PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
timed train accelerate launch --config_file accelerate_configs/cpu_2proc.yaml --num_processes "$TRAIN_PROCS" \
  --main_process_port "$PORT" \
  examples/train.py --config "$RECIPE" --verifier "$VERIFIER" --features "$OUT/features" --output-dir "$OUT/drafter" \
  --max-seq-len "$TRAIN_ROW" "${RECIPE_OVERRIDES[@]}"

# The chain's evaluation and the tree sweep are one process and one thread each: they run side by side, one per
# core (each speed ratio interleaves plain and speculative decoding in its own process, so both sides of a ratio
# share the other core's load). The chain's output goes to $OUT/evaluate.log and is shown when it is done.
stage "evaluate: chain speculative decoding on $EVAL_Q MT-bench questions x $EVAL_TOKENS tokens (k=3, greedy), beside the tree sweep"
timed evaluate eagle3-hf evaluate --drafter "$OUT/drafter" --verifier "$VERIFIER" --prompts mt-bench \
  --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k 3 --temperature 0 --output "$OUT/eval" \
  --write-to-drafter --no-progress > "$OUT/evaluate.log" 2>&1 &
CHAIN=$!

# SGLang serves trees (--speculative-eagle-topk > 1): a short sweep on development prompts (never MT-bench, never
# trained on) recommends a configuration only as far as its speed intervals separate, and ranks the trees by the
# same rule; the first tree then decodes the same MT-bench questions as the chain above.
stage "tree: sweep (steps 3, top-k 1/4, draft tokens 4/8) on $SWEEP_Q development prompts, its first tree on MT-bench"
timed sweep eagle3-hf evaluate --drafter "$OUT/drafter" --verifier "$VERIFIER" --prompts dev --num-prompts "$SWEEP_Q" \
  --max-new-tokens "$SWEEP_TOKENS" --temperature 0 --sweep --sweep-steps 3 --sweep-topk 1 4 \
  --sweep-num-draft-tokens 4 8 --output "$OUT/sweep" --no-progress
read -r S K N < <(python -c "import json; best = json.load(open('$OUT/sweep/eagle3_sweep.json'))['best_tree']
print(best['steps'], best['topk'], best['num_draft_tokens'])")
timed evaluate_tree eagle3-hf evaluate --drafter "$OUT/drafter" --verifier "$VERIFIER" --prompts mt-bench \
  --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --steps "$S" --topk "$K" --num-draft-tokens "$N" \
  --temperature 0 --output "$OUT/eval_tree" --no-progress
wait "$CHAIN" || { cat "$OUT/evaluate.log" >&2; echo "demo: the chain's evaluation failed (log: $OUT/evaluate.log)" >&2; exit 1; }
echo; echo "--- the chain's evaluation ($OUT/evaluate.log)"; cat "$OUT/evaluate.log"
cp "$OUT/sweep/eagle3_sweep.json" "$OUT/drafter/"

stage "export the standard layout and check it for SGLang, vLLM and llama.cpp"
timed export eagle3-hf export "$OUT/drafter" --output "$OUT/export" --format standard
cp "$OUT/drafter/eagle3_training.json" "$OUT/drafter/eagle3_evaluation.json" "$OUT/drafter/eagle3_sweep.json" "$OUT/export/"
timed check eagle3-hf check "$OUT/export" --verifier "$VERIFIER" --engine all

# A real engine: vLLM's CPU build serves the export on the same questions (token-identical to plain vLLM at
# temperature 0, τ from vLLM's own metrics). Runs when `make vllm` installed it (DEMO_VLLM=0 skips it).
if [ "${DEMO_VLLM:-1}" != 0 ] && python -c "from eagle3_hf.engines.vllm.vllm_env import vllm_python; vllm_python()" 2>/dev/null; then
  stage "vllm: the export served by vLLM on the same $EVAL_Q MT-bench questions (k=3, greedy)"
  timed vllm eagle3-hf evaluate --engine vllm --skip-transformers --drafter "$OUT/export" --verifier "$VERIFIER" \
    --prompts mt-bench --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k 3 --temperature 0 \
    --output "$OUT/eval_vllm" --write-to-drafter --no-progress
else
  echo; echo "(vLLM not installed: \`make vllm\` adds a stage that serves the drafter in vLLM)"
fi

# llama.cpp: the export converted to GGUF by llama.cpp's own converter and served by llama-server beside the
# embedded verifier's own GGUF (token-identical to plain llama-server, τ from its draft counters). Runs when
# `make llamacpp` built it (DEMO_LLAMACPP=0 skips it).
if [ "${DEMO_LLAMACPP:-1}" != 0 ] && python -c "from eagle3_hf.engines.llamacpp_env import find_llamacpp; find_llamacpp()" 2>/dev/null; then
  stage "llama.cpp: the export as a GGUF, served by llama-server on the same $EVAL_Q MT-bench questions (k=3, greedy)"
  timed llamacpp eagle3-hf evaluate --engine llamacpp --skip-transformers --drafter "$OUT/export" --verifier "$VERIFIER" \
    --prompts mt-bench --num-prompts "$EVAL_Q" --max-new-tokens "$EVAL_TOKENS" --k 3 --temperature 0 \
    --output "$OUT/eval_llamacpp" --no-progress
else
  echo; echo "(llama.cpp not built: \`make llamacpp\` adds a stage that serves the drafter in llama.cpp)"
fi

if [ -n "${HF_REPO_ID:-}" ]; then
  stage "push to the Hub as $HF_REPO_ID"
  HF_HUB_OFFLINE=0 eagle3-hf push "$OUT/export" --repo-id "$HF_REPO_ID"
fi

stage "summary"
# the small demo's table is committed: docs/results/demo.md and README.md's copy of it are rewritten from this run
RESULTS=()
if [ "$SIZE" = small ] && [ -z "${DEMO_OUT:-}" ]; then RESULTS=(--results docs/results/demo.md); fi
python examples/demo_summary.py "$OUT" --seconds "$(( $(date +%s) - START ))" "${RESULTS[@]}"
