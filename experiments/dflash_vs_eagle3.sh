#!/bin/bash
# The DFlash go/no-go (docs/results/dflash.md): today's EAGLE-3 recipe against DFlash drafters on the demo's
# features, each training run one process with OMP_NUM_THREADS=1 so that its CPU seconds are its own (the page
# compares them), then our decoder on the same MT-bench questions (chain k=3 against blocks of 4: three drafts per
# verify either way, greedy). One row per call, so a session can run the rows it has time for:
#   bash experiments/dflash_vs_eagle3.sh data                 # the demo's regenerate + vocab (600 prompts), once
#   bash experiments/dflash_vs_eagle3.sh eagle3 SEED [OBJECTIVE]  # examples/recipes/small_cpu.yaml, 6 epochs (kl)
#   bash experiments/dflash_vs_eagle3.sh dflash SEED ANCHORS STEPS [LAYERS] [BLOCK]
#   bash experiments/dflash_vs_eagle3.sh eval NAME [PROMPTS] [TEMPERATURE]  # NAME: a run directory under $T
#                   (PROMPTS: the first N MT-bench questions, default 20, or `dev`: the 40 development prompts, which
#                    the sweep chooses on; greedy by default; T > 0 writes eval_T<t>_NAME, dev eval_dev_NAME)
#   bash experiments/dflash_vs_eagle3.sh served NAME ENGINE [q4|f32]  # ENGINE vllm or llamacpp: tokens/s against
#                                 plain decoding in that engine, 10 questions (llama.cpp: the embedded Q4_1 verifier
#                                 GGUF, or the verifier converted at f32); an EAGLE-3 run is exported first
# Each training run's `/usr/bin/time -v` (user + sys seconds) is in its log: DFlash's STEPS are chosen so that its
# CPU seconds match the EAGLE-3 run's.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
T=${T:-runs/dflash_vs_eagle3}; V=smollm2-135m-instruct; F=$T/data/features
mkdir -p "$T"
case "${1:-}" in
  data)
    mkdir -p $T/data
    python -c "import json; from eagle3_hf.demo_data.prompts import short_prompts
[print(json.dumps(p)) for p in short_prompts(600)]" > $T/data/prompts.jsonl
    eagle3-hf regenerate --input $T/data/prompts.jsonl --output $T/data/conversations.jsonl --verifier $V \
      --max-new-tokens 128 --batch-size 64 --num-workers 2 --features-out $F --prepared-out $T/data/prepared \
      --max-seq-len 1024 --features-dtype bf16
    eagle3-hf vocab --data $T/data/prepared --draft-vocab-size 4096 --output $F/vocab.safetensors ;;
  eagle3)
    seed=$2 objective=${3:-kl}
    name=e3_seed$seed; [ "$objective" = kl ] || name=e3_${objective}_seed$seed
    /usr/bin/time -v eagle3-hf train --config examples/recipes/small_cpu.yaml --verifier $V --features $F \
      --output-dir $T/$name --max-seq-len 256 --seed "$seed" --objective "$objective" > $T/$name.log 2>&1 ;;
  dflash)
    seed=$2 anchors=$3 steps=$4 layers=${5:-1} block=${6:-4}
    name=df_b${block}_l${layers}_a${anchors}_s${steps}_seed$seed
    /usr/bin/time -v eagle3-hf train --config examples/recipes/small_cpu.yaml --verifier $V --features $F \
      --output-dir $T/$name --max-seq-len 256 --seed "$seed" --drafter-kind dflash --block-size "$block" \
      --dflash-layers "$layers" --dflash-anchors "$anchors" --max-steps "$steps" \
      --eval-strategy steps --eval-steps $((steps / 2)) --save-strategy steps --save-steps $((steps / 2)) \
      > $T/$name.log 2>&1 ;;
  eval)
    temperature=${4:-0} out=$T/eval_$2 prompts=(--prompts mt-bench --num-prompts "${3:-20}")
    [ "$temperature" = 0 ] || out=$T/eval_T${temperature}_$2
    if [ "${3:-}" = dev ]; then prompts=(--prompts dev); out=$T/eval_dev_$2; fi
    eagle3-hf evaluate --drafter $T/$2 --verifier $V "${prompts[@]}" \
      --max-new-tokens 64 --k 3 --temperature "$temperature" --output "$out" --no-progress ;;
  served)
    name=$2 engine=$3 gguf=${4:-q4} drafter=$T/$2 extra=()
    kind=$(python -c "from eagle3_hf.engines.table import checkpoint_kind; print(checkpoint_kind('$drafter').name)")
    if [ "$kind" = eagle3 ]; then  # the training layout: the engines read the standard export
      [ -f "$T/${name}_export/config.json" ] || eagle3-hf export "$drafter" --output "$T/${name}_export" --format standard
      drafter=$T/${name}_export
    fi
    [ "$engine" = llamacpp ] && [ "$gguf" = f32 ] && extra=(--verifier-gguf convert)
    eagle3-hf evaluate --engine "$engine" --skip-transformers --drafter "$drafter" --verifier $V --prompts mt-bench \
      --num-prompts 10 --max-new-tokens 64 --k 3 --temperature 0 --output "$T/served_${engine}_${gguf}_$name" \
      --no-progress "${extra[@]}" ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
