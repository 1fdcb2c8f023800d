# The demo sizes, shared by examples/demo.sh and examples/demo_dflash.sh (sourced with SIZE set): how many training
# prompts the verifier answers and how long, the longest prepared sample, the draft vocabulary (EAGLE-3 only), the
# MT-bench questions and tokens evaluated, the tree sweep's development prompts, and the recipe's overrides (the
# tiny size trains one epoch, at a lower rate, on a larger validation split).
case "$SIZE" in
  tiny)  PROMPTS=12;   GEN_TOKENS=16;  MAX_LEN=256;  DRAFT_VOCAB=1024; EVAL_Q=2;  EVAL_TOKENS=12; SWEEP_Q=2; SWEEP_TOKENS=12
         RECIPE_OVERRIDES=(--num-train-epochs 1 --learning-rate 1e-3 --validation-fraction 0.3) ;;
  small) PROMPTS=600;  GEN_TOKENS=128; MAX_LEN=1024; DRAFT_VOCAB=4096; EVAL_Q=10; EVAL_TOKENS=64; SWEEP_Q=5; SWEEP_TOKENS=48
         RECIPE_OVERRIDES=() ;;
  large) PROMPTS=1200; GEN_TOKENS=128; MAX_LEN=1024; DRAFT_VOCAB=8192; EVAL_Q=80; EVAL_TOKENS=64; SWEEP_Q=10; SWEEP_TOKENS=64
         RECIPE_OVERRIDES=() ;;
  *) echo "DEMO_SIZE must be tiny, small or large" >&2; exit 2 ;;
esac
