"""Train an EAGLE-3 drafter for a verifier, on hidden states extracted with `eagle3-hf extract`.

The same script runs in every setting; only the launcher changes:

    # one CPU or GPU
    accelerate launch examples/train.py --data-dir feats/ --output-dir runs/drafter
    # 8 GPUs with DeepSpeed ZeRO-2 (configs in accelerate_configs/ and ds_configs/)
    accelerate launch --config_file accelerate_configs/8gpu_zero2.yaml examples/train.py --config examples/recipes/kimi_k25_8gpu_zero2.yaml
    # from an existing drafter instead of from scratch (a directory or a Hub repo id, any layout)
    accelerate launch examples/train.py --data-dir feats/ --finetune-from org/some-eagle3 --output-dir runs/ft

Arguments are transformers' TrainingArguments plus the model and data arguments in
eagle3_hf/train_cli.py; `--config FILE.yaml` gives defaults that the command line overrides. All the
machinery (trainer, loss, metrics, checkpoint layout) lives in the package.
"""

from eagle3_hf.train_cli import main

if __name__ == "__main__":
    main()
