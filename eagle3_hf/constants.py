"""Names and fixed values that a writer and its readers must agree on, each defined once.

docs/contracts.md describes what each file holds. Importing this module costs nothing (no torch), so
every stage, the CLI and the examples can use it.
"""

# ---------------------------------------------------------------- file names
PREPARE_META = "eagle3_prepare.json"  # prepared dataset (`eagle3-hf prepare`): format, tokenizer, options, counts
MANIFEST = "manifest.json"  # features directory (`eagle3-hf extract`): samples, shards, aux layer indices
VOCAB_FILE = "vocab.safetensors"  # draft vocabulary (`eagle3-hf vocab`): d2t, t2d, tokenizer fingerprint
TRAINING_FILE = "eagle3_training.json"  # drafter directory: recipe and measured per-step metrics (model card)
TRAINING_ARGS_FILE = "eagle3_training_args.json"  # drafter checkpoint: the TrainingArguments, as JSON
EVALUATION_FILE = "eagle3_evaluation.json"  # `eagle3-hf evaluate`: acceptance length summary (model card)
# `eagle3-hf evaluate --sweep`: every configuration's figures and the best (model card)
SWEEP_FILE = "eagle3_sweep.json"
ACCEPTANCE_FILE = "acceptance.csv"  # `eagle3-hf evaluate`: one row per prompt and turn

# ---------------------------------------------------------------- packed batches
PAD_DOCUMENT = -1  # document id of padding positions in a packed row

VLLM_EVALUATION_FILE = "eagle3_evaluation_vllm.json"  # `evaluate --engine vllm`, beside eagle3_evaluation.json
LLAMACPP_EVALUATION_FILE = "eagle3_evaluation_llamacpp.json"  # `evaluate --engine llamacpp`, beside it too

# ---------------------------------------------------------------- servers
# The API key of `serve-features` / `serve-vllm` and their clients (features/api_key.py). The feature server
# script (engines/vllm/vllm_feature_server.py) runs without this package and spells the name itself.
API_KEY_ENV = "EAGLE3_HF_API_KEY"
