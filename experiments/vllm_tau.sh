#!/bin/bash
# The τ pair (issue 24 item 5): the demo's recipe trained on vLLM's features of the demo's own prepared data,
# beside the demo's drafter (trained on transformers' features of the same data); both evaluated on all 80
# MT-bench questions x 64 tokens (k=3, greedy) by our decoder and by vLLM (docs/results/vllm_features.md).
# After `make demo` and `make vllm`:
#   bash experiments/vllm_tau.sh               # extract (vLLM) + train + export
#   bash experiments/vllm_tau.sh eval_vllm tf  # vLLM serves the demo's export; `eval_vllm vllm`: the new one
#   python -m experiments.tree_attention --drafter DRAFTER --out OUT --only S3-K1-N4-chain   # our decoder's τ
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
D=${D:-demo_out/small}; T=${T:-runs/vllm_tau}; V=smollm2-135m-instruct
step=${1:-all}
if [ "$step" = extract ] || [ "$step" = all ]; then
  mkdir -p $T
  eagle3-hf extract --engine vllm --verifier $V --data $D/prepared --output $T/features_vllm --features-dtype bf16 --no-progress 2> $T/extract.log
  cp $D/features/vocab.safetensors $T/features_vllm/vocab.safetensors
fi
if [ "$step" = train ] || [ "$step" = all ]; then
  PORT=$(python -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  accelerate launch --config_file accelerate_configs/cpu_2proc.yaml --num_processes 2 --main_process_port "$PORT" \
    examples/train.py --verifier $V --features $T/features_vllm --output-dir $T/drafter_vllm \
    --num-train-epochs 6 --learning-rate 2e-3 --max-seq-len 256 \
    --per-device-train-batch-size 1 --warmup-steps 0.05 --lr-scheduler-type cosine \
    --validation-fraction 0.05 --logging-steps 10 --eval-strategy epoch --save-strategy epoch --save-total-limit 1 \
    --load-best-model-at-end true --seed 0 --disable-tqdm true > $T/train_vllm.log 2>&1
  eagle3-hf export $T/drafter_vllm --output $T/export_vllm --format standard
fi
if [ "$step" = eval_tf ]; then  # $2: which drafter (tf | vllm)
  dr=$([ "$2" = tf ] && echo $D/drafter || echo $T/drafter_vllm)
  eagle3-hf evaluate --drafter $dr --verifier $V --prompts mt-bench --max-new-tokens 64 --k 3 --temperature 0 \
    --output $T/eval_$2_by_transformers --no-progress > $T/eval_$2_by_transformers.log 2>&1
fi
if [ "$step" = eval_vllm ]; then
  ex=$([ "$2" = tf ] && echo $D/export || echo $T/export_vllm)
  eagle3-hf evaluate --engine vllm --skip-transformers --drafter $ex --verifier $V --prompts mt-bench \
    --max-new-tokens 64 --k 3 --temperature 0 --output $T/eval_$2_by_vllm --no-progress > $T/eval_$2_by_vllm.log 2>&1
fi
