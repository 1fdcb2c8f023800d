"""Drafter quality against speculators 0.9.0 on the same data: ours and its EAGLE-3 drafter, trained on the
same packed batches for the same steps from the same seed, both evaluated by our tools.

1. ours: `eagle3-hf train` (our recipe: trainable lm_head, soft cross-entropy, TTT 3 with γ = 0.8, AdamW,
   cosine schedule with 5 % warm-up, `--lr`);
2. the batches our Trainer feeds it, in its order (its own train dataloader, `set_epoch` per epoch as its
   loop calls it), dumped as safetensors with the verifier's embedding and lm_head rows;
3. speculators: experiments/speculators_train.py in `.bench-venv/speculators` trains its `Eagle3DraftModel` on
   those batches with its recipe (see that file) and saves the speculators layout;
4. both checkpoints are read by `Eagle3DraftModel.from_pretrained` (ours: our layout; theirs: the
   speculators reader) and measured the same way: validation per-step accuracy and simulated τ on the same
   validation split, then `eagle3-hf evaluate` on each `--eval` prompt set (real τ, k=3, greedy, lossless).

    .venv/bin/python -m bench.train_step --setup-speculators          # once: .bench-venv/speculators
    .venv/bin/python -m experiments.quality_vs_speculators --features demo_out/small/features \
        --max-train-tokens 25600 [--epochs 3] [--lr 2e-3 --spec-lr 1e-3] [--eval dev=40 mt-bench=0]

--features is an `eagle3-hf extract` (or `regenerate --features-out`) directory holding vocab.safetensors
(`make demo` writes one). Stages whose output exists are reused with `--reuse` (e.g. to re-evaluate). Writes a
table to stdout and `results.json` under --output-dir. `experiments/speculators_lr_sweep.py` runs this at
several learning rates and sets each side's best against the other's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

import torch

from eagle3_hf.constants import TRAINING_FILE

from bench.train_step import REPO, SPEC_PYTHON, speculators_available
from experiments.runs import CLI, evaluate_drafter_cli, parse_eval_sets, run_logged

SPEC_TRAINER = "experiments.speculators_train"  # run as a module by the speculators venv
DEFAULT_LR = {"ours": 2e-3, "speculators": 1e-3}  # ours: the small demo's; speculators: its CLI default


def our_train_argv(args: argparse.Namespace, output_dir: Path) -> list[str]:
    """The `eagle3-hf train` arguments of our run; the batch dump parses the same ones."""
    return ["--verifier", args.verifier, "--features", args.data_dir, "--output-dir", str(output_dir),
            "--num-train-epochs", str(args.epochs), "--learning-rate", str(args.lr),
            "--max-seq-len", str(args.max_seq_len), "--per-device-train-batch-size", str(args.batch_size),
            "--warmup-steps", "0.05", "--lr-scheduler-type", "cosine",
            "--validation-fraction", str(args.validation_fraction), "--logging-steps", "10",
            "--eval-strategy", "no", "--save-strategy", "no", "--seed", str(args.seed),
            *(["--max-train-tokens", str(args.max_train_tokens)] if args.max_train_tokens else []),
            *shlex.split(args.ours_args)]


def dump_batches(args: argparse.Namespace, train_argv: list[str], ours_dir: Path, work: Path) -> int:
    """The batches our Trainer trains on, in its order, one safetensors file per optimizer step (real
    tokens of its rows back to back, document ids unique within the step), plus the verifier's embedding,
    lm_head rows, vocabulary mapping and the drafter's shapes. Returns the number of steps."""
    from safetensors.torch import save_file
    from transformers import Trainer

    from eagle3_hf import Eagle3Config
    from eagle3_hf.train.arguments import parse_args
    from eagle3_hf.train.setup import build_datasets, load_vocabulary
    from eagle3_hf.verifier.loading import verifier_io_weights

    model_args, data_args, targs = parse_args(train_argv)
    train, _evals, collator, info = build_datasets(data_args, model_args)
    # the Trainer's own dataloader and sampler; the model is never run
    loader = Trainer(model=torch.nn.Linear(1, 1), args=targs, train_dataset=train,
                     data_collator=collator).get_train_dataloader()
    steps = 0
    for epoch in range(int(args.epochs)):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        for batch in loader:
            real = batch["document_ids"] != -1  # [B, L]
            docs = batch["document_ids"] + torch.arange(batch["document_ids"].shape[0]).unsqueeze(1) * 10_000
            steps += 1
            save_file({
                "input_ids": batch["input_ids"][real], "aux_hidden_states": batch["aux_hidden_states"][real],
                "last_hidden_state": batch["last_hidden_state"][real], "loss_mask": batch["loss_mask"][real],
                "position_ids": batch["position_ids"][real], "document_ids": docs[real],
            }, str(work / f"batch-{steps:05d}.safetensors"))
    config = Eagle3Config.from_pretrained(ours_dir)
    d2t, t2d = load_vocabulary(data_args, info, config)
    embed, head = verifier_io_weights(args.verifier)
    save_file({"embed_tokens": embed.contiguous(), "lm_head_rows": head[t2d].contiguous(), "d2t": d2t, "t2d": t2d},
              str(work / "verifier.safetensors"))
    rope = config.rope_parameters or {}
    spec = {
        "model": {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                  "intermediate_size": config.intermediate_size, "num_heads": config.num_attention_heads,
                  "num_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
                  "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.rms_norm_eps,
                  "rope_theta": rope.get("rope_theta", 10000.0), "draft_vocab_size": config.draft_vocab_size},
        "aux_layer_ids": list(info["aux_layer_indices"]), "verifier": args.verifier, "attn": "sdpa",
        "ttt_steps": 3, "threads": args.threads, "seed": args.seed, "log_every": 10,
        "recipe": {"optimizer": args.spec_optimizer, "lr": args.spec_lr, "step_weight": args.spec_step_weight,
                   "warmup_ratio": None},
    }
    (work / "spec.json").write_text(json.dumps(spec, indent=1), encoding="utf-8")
    return steps


def validation_metrics(args: argparse.Namespace, drafter_dir: Path) -> dict:
    """Per-step accuracy and simulated τ on the validation split, through our model and our metrics."""
    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.features.reader import FeatureDataset
    from eagle3_hf.train.metrics import drafter_step_accuracies
    from eagle3_hf.verifier.loading import verifier_io_weights

    model = Eagle3DraftModel.from_pretrained(drafter_dir)
    embed, _head = verifier_io_weights(args.verifier)
    model.load_verifier_embeddings(embed)
    data = FeatureDataset(args.data_dir, "validation", args.validation_fraction, verify="none")
    metrics = drafter_step_accuracies(model, data, max_seq_len=args.max_seq_len, ttt_steps=3)
    metrics["layout"] = getattr(model, "source_layout", "?")
    return metrics


def reader_agreement(spec_dir: Path, work: Path, verifier: str, ttt_steps: int = 3) -> list[float]:
    """Per TTT step, the fraction of positions of the first batch where our forward of their checkpoint (read
    by our speculators-layout reader) proposes the draft token their own forward proposed. Their position
    j of a document is our position j (feature j, token j + 1); each document's last i + 1 positions have
    no step-i token on either side."""
    from safetensors.torch import load_file

    from eagle3_hf import Eagle3DraftModel
    from eagle3_hf.verifier.loading import verifier_io_weights

    theirs = load_file(str(work / "speculators_drafts.safetensors"))
    batch = {k: v.unsqueeze(0) for k, v in load_file(str(sorted(work.glob("batch-*.safetensors"))[0])).items()}
    model = Eagle3DraftModel.from_pretrained(spec_dir)
    model.load_verifier_embeddings(verifier_io_weights(verifier)[0])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], aux_hidden_states=batch["aux_hidden_states"],
                    position_ids=batch["position_ids"], document_ids=batch["document_ids"], ttt_steps=ttt_steps)
    docs = batch["document_ids"][0]
    keep_ours = torch.ones_like(docs, dtype=torch.bool)  # their row drops each document's last position
    keep_ours[:-1] = docs[1:] == docs[:-1]
    keep_ours[-1] = False
    agreement = []
    for i in range(ttt_steps):
        ours = out.logits[i][0].argmax(-1)[keep_ours & out.step_valid[i][0]]
        their_docs = docs[keep_ours]
        valid = torch.zeros_like(their_docs, dtype=torch.bool)  # step i needs i more tokens of the document
        valid[: len(valid) - i] = their_docs[i:] == their_docs[: len(their_docs) - i] if i else True
        agreement.append(float((ours == theirs[f"step_{i}"][valid]).float().mean()))
    return agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", dest="data_dir", required=True, help="features directory with vocab.safetensors")
    parser.add_argument("--output-dir", default=str(REPO / "bench" / "out" / "quality_vs_speculators"))
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--lr", type=float, default=DEFAULT_LR["ours"], help="our learning rate (the small demo's)")
    parser.add_argument("--batch-size", type=int, default=2, help="packed rows per optimizer step")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--max-train-tokens", type=int, default=0,
                        help="train on a seeded, source-stratified subset of this many tokens (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-args", default="", help="more `eagle3-hf train` arguments for ours (an ablation, "
                        "e.g. \"--init-lm-head verifier --freeze-lm-head --ttt-step-weight 1.0\")")
    parser.add_argument("--spec-optimizer", default="muon", choices=["muon", "adamw"],
                        help="speculators' optimizer (its 0.9.0 CLI default: muon)")
    parser.add_argument("--spec-lr", type=float, default=DEFAULT_LR["speculators"],
                        help="speculators' lr (its CLI default)")
    parser.add_argument("--spec-step-weight", type=float, default=1.0,
                        help="speculators' ttt_step_loss_decay (its default 1.0)")
    parser.add_argument("--eval", nargs="+", default=["mt-bench=0"], metavar="PROMPTS=N",
                        help="prompt sets to decode both drafters on (`evaluate --prompts`), N prompts each (0: all)")
    parser.add_argument("--eval-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reuse", action="store_true", help="skip stages whose output exists")
    args = parser.parse_args()
    note = speculators_available()
    if note:
        raise SystemExit(note)
    out = Path(args.output_dir)
    ours_dir, spec_dir, work = out / "ours", out / "speculators", out / "batches"
    for d in (out, work):
        d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    torch.set_num_threads(args.threads)
    previous = out / "results.json"  # a rerun keeps the seconds of the stages it reuses
    seconds: dict[str, float] = (json.loads(previous.read_text(encoding="utf-8"))["seconds"]
                                 if args.reuse and previous.is_file() else {})

    train_argv = our_train_argv(args, ours_dir)
    if not (args.reuse and (ours_dir / "model.safetensors").is_file()):
        print(f"ours: eagle3-hf train {' '.join(train_argv)}", flush=True)
        seconds["train_ours"] = run_logged([*CLI, "train", *train_argv], out / "train_ours.log", env, REPO)
    if not (args.reuse and (spec_dir / "model.safetensors").is_file()):
        steps = dump_batches(args, train_argv, ours_dir, work)
        ours_steps = json.loads((ours_dir / TRAINING_FILE).read_text())["log_history"][-1].get("step")
        if ours_steps is not None and ours_steps != steps:
            raise SystemExit(f"dumped {steps} batches but our Trainer ran {ours_steps} steps")
        print(f"speculators: {steps} steps on the dumped batches", flush=True)
        spec_env = dict(env, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
        seconds["train_speculators"] = run_logged([str(SPEC_PYTHON), "-m", SPEC_TRAINER, "--work", str(work),
                                                   "--out", str(spec_dir)], out / "train_speculators.log", spec_env,
                                                  REPO)
        for f in sorted(work.glob("batch-*.safetensors"))[1:]:  # the first one stays for the agreement check
            f.unlink()

    agreement = reader_agreement(spec_dir, work, args.verifier)
    print(f"their proposals reproduced by our reader + forward, per TTT step: {agreement}", flush=True)
    eval_sets = parse_eval_sets(args.eval)
    results = {}
    for name, d in (("ours", ours_dir), ("speculators", spec_dir)):
        row = {"validation": validation_metrics(args, d), "eval": {}}
        for prompts, n in eval_sets:
            row["eval"][f"{prompts}={n}"] = evaluate_drafter_cli(d, args.verifier, prompts, n, args.eval_tokens,
                                                                 out, env)
        results[name] = row

    print(f"\n{'drafter':12s} {'layout':12s} {'val acc0/1/2':>17s} {'val sim τ':>9s} {'prompts':>12s} {'real τ':>7s} "
          f"{'per-position acceptance':>24s} {'lossless':>8s}")
    for name, row in results.items():
        v = row["validation"]
        accs = "/".join(f"{v[f'acc_{i}']:.3f}" for i in range(3))
        for label, e in row["eval"].items():
            pos = "/".join(f"{a:.3f}" for a in e["per_position_acceptance"])
            print(f"{name:12s} {v['layout']:12s} {accs:>17s} {v['simulated_acceptance_length']:9.3f} {label:>12s} "
                  f"{e['acceptance_length']:7.3f} {pos:>24s} {str(e['lossless']):>8s}")
    last = list(results["ours"]["eval"])[-1]
    ratio = (results["ours"]["eval"][last]["acceptance_length"]
             / results["speculators"]["eval"][last]["acceptance_length"])
    print(f"ours / speculators real τ ({last}): {ratio:.3f}; stage seconds {json.dumps(seconds)}")
    (out / "results.json").write_text(json.dumps({"args": vars(args), "seconds": seconds, "results": results,
                                                  "reader_agreement": agreement,
                                                  "ours_over_speculators_tau": ratio}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
