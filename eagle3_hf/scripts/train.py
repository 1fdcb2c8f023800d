"""Train an EAGLE-3 drafter for a verifier, on hidden states extracted with `eagle3-hf extract`.

This is the training script: read it top to bottom. It ships inside the package, so it runs from an
installed wheel: `eagle3-hf train ...` runs it, and so does `accelerate launch examples/train.py ...` (that
file only calls this one). The same script runs in every setting; only the launcher changes:

    # one CPU or GPU
    accelerate launch examples/train.py --features feats/ --output-dir runs/drafter
    # 8 GPUs with DeepSpeed ZeRO-3 (configs in accelerate_configs/ and ds_configs/)
    accelerate launch --config_file accelerate_configs/8gpu_zero3.yaml examples/train.py \
        --config examples/recipes/kimi_k25_8gpu_zero3.yaml
    # two nodes, data parallel (machine_rank 1 on the other; local disks: --per-node-features --save_on_each_node)
    accelerate launch --config_file accelerate_configs/multinode_ddp_template.yaml --machine_rank 0 \
        --main_process_ip HEAD examples/train.py --config examples/recipes/kimi_k25_8gpu_ddp.yaml
    # from an installed wheel, without the repository
    accelerate launch -m eagle3_hf.scripts.train --features feats/ --output-dir runs/drafter
    # from an existing drafter instead of from scratch (a directory or a Hub repo id, any layout)
    accelerate launch examples/train.py --features feats/ --finetune-from org/some-eagle3 --output-dir runs/ft
    # no features on disk: the verifier runs in the training process
    accelerate launch examples/train.py --features hf --prepared-dir prepared/ --output-dir runs/online
    # no features on disk: a vLLM feature server (`eagle3-hf serve-features`, another machine if need be)
    accelerate launch examples/train.py --features http://HOST:PORT --prepared-dir prepared/ --output-dir runs/o

Arguments are transformers' TrainingArguments plus TTT (`--ttt-steps`, `--ttt-step-weight`) and the model
and data arguments of `eagle3_hf.train.arguments`; `--config FILE.yaml` gives defaults that the command line
overrides; `--help` lists them all. The machinery (trainer, loss, metrics, checkpoint layout) lives in the
package; docs/contracts.md describes what the drafter is trained to match.
"""

from __future__ import annotations

import logging
import os

from transformers import set_seed
from transformers.trainer_utils import IntervalStrategy

from eagle3_hf.constants import TRAINING_FILE
from eagle3_hf.engines.table import kind
from eagle3_hf.features.store import merge_manifests
from eagle3_hf.train.arguments import parse_args
from eagle3_hf.train.nodes import check_training_nodes, spread_over_nodes
from eagle3_hf.train.setup import finetune_advice, finish_process
from eagle3_hf.train.shm import check_at_start
from eagle3_hf.train.trainer import Eagle3Trainer, training_summary, write_json
from eagle3_hf.train.training_data import (
    build_datasets,
    check_features_fit,
    endpoint_loader_workers,
    resolve_features_verifier,
    verify_features,
    warn_untrained_tails,
)
from eagle3_hf.verifier.checkpoint_files import verifier_io_weights
from eagle3_hf.verifier.family import logit_softcap, text_config
from eagle3_hf.verifier.loading import load_config, resolve_verifier
from eagle3_hf.verifier.remote_code import set_trusted

logger = logging.getLogger("eagle3_hf.train")


def main(argv: list[str] | None = None) -> dict:
    # 1. Arguments: model, data, and transformers' TrainingArguments with the TTT knobs.
    model_args, data_args, args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.should_log else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_trusted(model_args.trust_remote_code)  # the verifier's own code: only with --trust-remote-code
    verifier = resolve_features_verifier(data_args, model_args)  # --verifier unset: the one the features name
    verifier_config = load_config(resolve_verifier(verifier), revision=model_args.verifier_revision)
    # the node's /dev/shm against what its data-loader workers will hold, before a shard is read (a container's
    # 64 MB default ends a run with "Bus error" at step 0): refused in one line saying what to change
    check_at_start(args, data_args.features, data_args.max_seq_len, text_config(verifier_config).hidden_size,
                   ranks=int(os.environ.get("LOCAL_WORLD_SIZE") or 1), cuda=not args.use_cpu)

    # Over several nodes, what must be shared is checked now, in one line (train/nodes.py): --output-dir (or
    # --save_on_each_node), and --features (the same on every node, or with --per-node-features each node's part).
    nodes = check_training_nodes(data_args, args)

    # 2. Datasets: samples packed into rows of --max-seq-len (several documents per row, attention kept within
    #    each), their features read from shards or computed while training (--features); the draft vocabulary.
    #    A feature directory is opened from its manifest and the shards' headers only: every refusal that needs
    #    no shard bytes (verifier, tokenizer, vocabulary, drafter) comes before its checksums (step 5).
    with args.main_process_first(local=True, desc="open features"):
        features = build_datasets(data_args, model_args, verifier_config, node_parts=bool(nodes and nodes.parts))
    if args.process_index == 0:  # samples longer than the rows: extracted, stored, and their tails never trained on
        warn_untrained_tails(features, data_args)
    if nodes and nodes.parts:  # each node trains on its own part, every rank through the same number of batches
        features.train, features.evals = spread_over_nodes(features.train, features.evals, nodes.layout, args)
    train, evals = features.train, features.evals
    if features.endpoint:  # CPU: workers keep the next requests in flight; GPU: the head runs there, in this process
        args.dataloader_num_workers = endpoint_loader_workers(args.dataloader_num_workers)
    elif features.online:  # the verifier runs in the collator: in this process, on its device, never in CPU workers
        args.dataloader_num_workers = 0
    if args.dataloader_num_workers == 0:  # a DataLoader without workers takes neither
        args.dataloader_persistent_workers, args.dataloader_prefetch_factor = False, None
    check_features_fit(features, verifier_config, model_args)
    if not len(evals) and args.eval_strategy != "no":  # nothing to measure: no accuracy 0 / τ 1.0 logged as measured
        logger.warning("the validation split is empty (--validation-fraction %s): evaluation is off, no accuracy or "
                       "simulated τ is reported", data_args.validation_fraction)
        args.eval_strategy = IntervalStrategy.NO
        args.load_best_model_at_end = False  # no evaluation, no best checkpoint: the last one is kept

    # 3. Drafter: built by its kind (engines/table.py: EAGLE-3's one Llama layer over the draft vocabulary, from
    #    scratch or --finetune-from; DFlash's block drafter), seeded here so the seed also fixes its
    #    initialisation; the thinking mode the data was rendered in recorded with it.
    set_seed(args.seed)
    model, init, kind_recipe = kind(model_args.drafter_kind).training_class().build(
        model_args, data_args, verifier_config, features, nodes)

    # 4. Teacher: the verifier's embedding (frozen; engines share it at serving) and its lm_head rows for the
    #    draft vocabulary (DFlash: all of them, its own head too), read by tensor name so a huge verifier is never
    #    instantiated (an acceptance loss, --objective lk-*, keeps the other rows too: the verifier's mass outside
    #    the draft vocabulary).
    embed, head = verifier_io_weights(verifier, model_args.verifier_revision)
    model.load_verifier_embeddings(embed)
    model.attach_teacher(head, logit_softcap(verifier_config),
                         in_vocab_mass=args.training_objective().needs_in_vocab_mass)
    logger.info("drafter: %.1f M trainable parameters; %d train rows, %d eval rows (%s)",
                model.num_trainable_parameters() / 1e6, train.stats["rows"], evals.stats["rows"], train.stats)

    # 5. Checksums: each node's main process checks the shards against the manifest while the node's other ranks
    #    wait (features/verify.py): nothing to hash where the writer or an earlier start vouches for the files on
    #    disk, else every shard on --verify-threads threads, each recorded as it finishes so a relaunch resumes.
    #    How many were hashed goes into the summary (this node's count: its main process hashed).
    hashed = 0
    with args.main_process_first(local=True, desc="verify features"):
        if args.local_process_index == 0:
            hashed = verify_features(features, data_args)

    # 6. Train: the TTT loss, per-step accuracies and simulated acceptance length are Eagle3Trainer's; the
    #    rest (accelerate / DeepSpeed, accumulation, checkpoints, best model by simulated τ) is transformers'.
    trainer = Eagle3Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals,
                            data_collator=features.collator)
    if model_args.finetune_from and len(evals):
        before = trainer.evaluate(metric_key_prefix="source")
        init["source_metrics"] = before
        init["advice"] = finetune_advice(before.get("source_acc_0", float("nan")))
        logger.warning("finetune source before training: step-0 acc %.3f, simulated τ %.2f. %s",
                       before.get("source_acc_0", float("nan")),
                       before.get("source_simulated_acceptance_length", float("nan")), init["advice"])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final = trainer.evaluate() if len(evals) else {}

    # 7. Save the standard EAGLE-3 layout (what SGLang and vLLM load) and the summary the model card reports.
    trainer.save_model(args.output_dir)
    summary = training_summary(
        trainer, final, verifier=model_args.verifier, init=init,
        data={"name": features.source, "num_samples": train.stats["samples"], "num_tokens": train.stats["tokens"],
              "num_train_rows": train.stats["rows"], "packing": train.stats, "shards_hashed_at_start": hashed},
        recipe={"max_seq_len": data_args.max_seq_len, "init": init["init"], "features": data_args.features,
                "online": features.online, "drafter_kind": model_args.drafter_kind, **kind_recipe},
    )
    summary["log_history"] = trainer.state.log_history
    if args.should_save:  # rank 0, or each node's first process with --save_on_each_node
        assert args.output_dir is not None  # parse_args refuses a run without --output-dir
        write_json(os.path.join(args.output_dir, TRAINING_FILE), summary)
    # 8. Leave the process group cleanly: a gloo rank that exits with it alive can abort (SIGABRT) at
    #    interpreter shutdown, turning a finished run into a failed one.
    trainer.accelerator.wait_for_everyone()
    if data_args.cache_features and trainer.is_world_process_zero():  # every writer's journal, one manifest
        merge_manifests(data_args.cache_features)
    trainer.accelerator.end_training()
    return summary


def main_argv(argv: list[str]) -> int:
    """`eagle3-hf train ...`: the same arguments; a distributed rank then skips interpreter finalization."""
    main(argv)
    return finish_process(0)


def run_script(argv: list[str]) -> int:
    """As a script (`accelerate launch examples/train.py` or `-m eagle3_hf.scripts.train`): bad input is one
    `error:` line, no traceback, and a distributed rank skips interpreter finalization."""
    from eagle3_hf.errors import run_reporting_user_errors

    return finish_process(run_reporting_user_errors(main, argv))


if __name__ == "__main__":
    import sys

    sys.exit(run_script(sys.argv[1:]))
