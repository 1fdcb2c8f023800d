"""`eagle3-hf diff-features A B`: how far apart are two extractions of the same samples?

The check that would have caught the reference run's 15 % acceptance before training: compare features from
transformers against the serving engine's capture (or bf16 against fp8, a quantized verifier against the
original), layer by layer, on the samples both hold. A is the reference. Per layer: cosine similarity and
relative error ||b - a|| / ||a|| per token (mean and the worst 5 %), plus how often the greedy tokens agree.
With --drafter, a drafter's step accuracies on each extraction show what the difference costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..features.reader import FeatureDataset

_HEADER_FIELDS = ("source", "dtype", "aux_layer_indices", "tokenizer_fingerprint")


def _layer_stats(cos: list[np.ndarray], rel: list[np.ndarray]) -> dict[str, float]:
    c, r = np.concatenate(cos), np.concatenate(rel)
    return {"cos_mean": float(c.mean()), "cos_p5": float(np.percentile(c, 5)), "cos_min": float(c.min()),
            "rel_err_mean": float(r.mean()), "rel_err_p95": float(np.percentile(r, 95)), "rel_err_max": float(r.max())}


def diff_features(a_dir: str | Path, b_dir: str | Path, max_samples: int | None = None) -> dict[str, Any]:
    """Compare extractions A (reference) and B on their common samples (same id and same tokens)."""
    # an extraction still running may be compared (only its common samples are): a warning says how many it holds
    a = FeatureDataset(a_dir, split="all", verify="none", allow_partial=True)
    b = FeatureDataset(b_dir, split="all", verify="none", allow_partial=True)
    if a.hidden_size != b.hidden_size:
        raise ValueError(f"{a_dir} has hidden size {a.hidden_size}, {b_dir} has {b.hidden_size}: not the same verifier")
    b_index = {sid: i for i, sid in enumerate(b.sample_ids)}
    common = [(i, b_index[sid]) for i, sid in enumerate(a.sample_ids) if sid in b_index]
    if max_samples is not None:
        common = common[:max_samples]
    warnings = []
    for key in _HEADER_FIELDS:
        if a.manifest.get(key) != b.manifest.get(key):
            warnings.append(f"{key} differs: A {a.manifest.get(key)!r}, B {b.manifest.get(key)!r}")
    names = [f"aux[{i}]" for i in a.aux_layer_indices] + ["last"]
    cos: dict[str, list[np.ndarray]] = {n: [] for n in names}
    rel: dict[str, list[np.ndarray]] = {n: [] for n in names}
    agree = agree_loss = tokens = loss_tokens = 0
    mismatched: list[str] = []
    for ia, ib in common:
        x, y = a[ia], b[ib]
        if not torch.equal(x["input_ids"], y["input_ids"]):
            mismatched.append(x["sample_id"])
            continue
        h = a.hidden_size
        pairs = [(x["aux_hidden_states"][:, k * h:(k + 1) * h], y["aux_hidden_states"][:, k * h:(k + 1) * h])
                 for k in range(3)] + [(x["last_hidden_state"], y["last_hidden_state"])]
        for name, (p, q) in zip(names, pairs):  # [T, H] each
            cos[name].append(torch.nn.functional.cosine_similarity(p, q, dim=-1, eps=1e-12).numpy())
            rel[name].append(((q - p).norm(dim=-1) / p.norm(dim=-1).clamp_min(1e-12)).numpy())
        same = x["verifier_greedy"] == y["verifier_greedy"]
        agree += int(same.sum())
        tokens += same.numel()
        agree_loss += int(same[x["loss_mask"]].sum())
        loss_tokens += int(x["loss_mask"].sum())
    compared = len(common) - len(mismatched)
    a_ids, b_ids = set(a.sample_ids), set(b.sample_ids)
    return {
        "a": {"dir": str(a_dir), **{k: a.manifest.get(k) for k in _HEADER_FIELDS}},
        "b": {"dir": str(b_dir), **{k: b.manifest.get(k) for k in _HEADER_FIELDS}},
        "samples_compared": compared, "tokens_compared": tokens,
        "only_in_a": len(a_ids - b_ids), "only_in_b": len(b_ids - a_ids),
        "token_mismatch": len(mismatched), "token_mismatch_ids": mismatched[:20],
        "layers": {n: _layer_stats(cos[n], rel[n]) for n in names} if compared else {},
        "greedy_agreement": agree / tokens if tokens else None,
        "greedy_agreement_loss_tokens": agree_loss / loss_tokens if loss_tokens else None,
        "warnings": warnings,
    }


def format_report(report: dict[str, Any]) -> str:
    """A readable table of `diff_features`' result."""
    lines = []
    for side in ("a", "b"):
        r = report[side]
        lines.append(f"{side.upper()}: {r['dir']}  (source {r['source']}, dtype {r['dtype']}, "
                     f"aux {r['aux_layer_indices']})")
    lines.append(f"samples compared {report['samples_compared']}, tokens {report['tokens_compared']}  "
                 f"(only in A {report['only_in_a']}, only in B {report['only_in_b']}, "
                 f"different tokens {report['token_mismatch']})")
    lines += [f"warning: {w}" for w in report["warnings"]]
    if report["layers"]:
        lines.append(f"{'layer':<10} {'cos mean':>10} {'cos p5':>10} {'rel.err mean':>13} {'rel.err p95':>12}")
        for name, s in report["layers"].items():
            lines.append(f"{name:<10} {s['cos_mean']:>10.6f} {s['cos_p5']:>10.6f} {s['rel_err_mean']:>13.5f} "
                         f"{s['rel_err_p95']:>12.5f}")
    if report["greedy_agreement"] is not None:
        lines.append(f"greedy agreement {100 * report['greedy_agreement']:.2f} % "
                     f"(assistant tokens {100 * (report['greedy_agreement_loss_tokens'] or 0):.2f} %)")
    for side in ("a", "b"):
        acc = report.get("drafter", {}).get(side)
        if acc is not None:
            lines.append(f"drafter on {side.upper()}: " + json.dumps(acc))
    return "\n".join(lines)


def add_arguments(parser) -> None:
    parser.add_argument("a", help="reference feature directory")
    parser.add_argument("b", help="feature directory to compare with it")
    parser.add_argument("--max-samples", type=int, default=None, help="compare at most this many common samples")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this file")
    parser.add_argument("--drafter", default=None, help="a drafter: report its step accuracies on A and on B")
    parser.add_argument("--verifier", default=None, help="verifier for a drafter saved without embed_tokens")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)


def run(args) -> int:
    report = diff_features(args.a, args.b, max_samples=args.max_samples)
    if args.drafter:
        from ..model.modeling_eagle3 import Eagle3DraftModel
        from ..train.metrics import drafter_step_accuracies

        verifier = None
        if args.verifier:
            from ..verifier.loading import load_verifier

            verifier = load_verifier(args.verifier)
        model = Eagle3DraftModel.from_pretrained(args.drafter, verifier=verifier).eval()
        report["drafter"] = {"path": args.drafter}
        for side, path in (("a", args.a), ("b", args.b)):
            ds = FeatureDataset(path, split="all", verify="none", allow_partial=True)
            report["drafter"][side] = drafter_step_accuracies(model, ds, max_seq_len=args.max_seq_len,
                                                              batch_size=args.batch_size)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0
