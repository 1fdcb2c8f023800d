"""Serve deliberately broken exports of a good drafter in vLLM and run `eagle3-hf check` on each.

Every export vLLM refuses or serves at τ ≈ 1 that `check` passes is a missing check rule. Writes
broken_exports.json and broken_exports.md (the table of docs/contracts.md, "What vLLM does with broken
exports") to --output.

    .venv/bin/python scripts/vllm_broken_exports.py --drafter demo_out/small/export \
        --verifier smollm2-135m-instruct --output demo_out/small/broken_exports
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_hf.engines.table import EAGLE3
from eagle3_hf.engines.vllm.vllm_env import VllmError, run_vllm
from eagle3_hf.engines.vllm.vllm_request import GenerationRequest
from eagle3_hf.evaluation.evaluate import load_prompts, render_prompt
from eagle3_hf.evaluation.vllm_engine import cut_final_step
from eagle3_hf.publish.check import check_drafter
from eagle3_hf.verifier.loading import load_tokenizer, resolve_verifier

Edit = Callable[[dict, dict], None]


def _shift_top_ids(cfg: dict, w: dict) -> None:  # the SGLang convention (id - 1) written into vLLM's key
    cfg["eagle_aux_hidden_state_layer_ids"] = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])


def _shift_all_ids(cfg: dict, w: dict) -> None:  # consistent everywhere, but not the layers it was trained on
    for key in ("eagle_aux_hidden_state_layer_ids", "aux_hidden_state_indices"):
        cfg[key] = [i + 1 for i in cfg[key]]
    nested = cfg["eagle_config"]
    nested["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in nested["eagle_aux_hidden_state_layer_ids"]]


def _d2t_absolute(cfg: dict, w: dict) -> None:
    w["d2t"] = w["d2t"] + torch.arange(len(w["d2t"]))


def _no_draft_vocab_size(cfg: dict, w: dict) -> None:
    del cfg["draft_vocab_size"]


def _architectures_llama(cfg: dict, w: dict) -> None:
    cfg["architectures"] = ["LlamaForCausalLM"]


def _bf16(cfg: dict, w: dict) -> None:
    for name, t in w.items():
        if t.is_floating_point():
            w[name] = t.to(torch.bfloat16)
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"


def _full_draft_vocab(cfg: dict, w: dict) -> None:  # the same drafter, its lm_head spread over the whole vocabulary
    vocab, kept = int(cfg["vocab_size"]), torch.arange(len(w["d2t"])) + w["d2t"]
    head = torch.full((vocab, w["lm_head.weight"].shape[1]), 0.0)
    head[kept] = w["lm_head.weight"]
    w["lm_head.weight"] = head
    w["d2t"], w["t2d"] = torch.zeros(vocab, dtype=torch.int64), torch.ones(vocab, dtype=torch.bool)
    cfg["draft_vocab_size"] = vocab


def _rename(old: str, new: str) -> Edit:
    def edit(cfg: dict, w: dict) -> None:
        w[new] = w.pop(old)
    return edit


def _prefix_model(cfg: dict, w: dict) -> None:
    for name in list(w):
        if name.startswith("midlayer."):
            w["model." + name] = w.pop(name)


def _norm_before_residual(cfg: dict, w: dict) -> None:
    cfg["norm_before_residual"] = True


def _tied(cfg: dict, w: dict) -> None:
    cfg["tie_word_embeddings"] = True


def _no_t2d(cfg: dict, w: dict) -> None:
    del w["t2d"]


VARIANTS: dict[str, tuple[str, Edit | None]] = {
    "good": ("the export as written", None),
    "aux-ids-sglang-in-vllm-key": ("top-level `eagle_aux_hidden_state_layer_ids` holds the SGLang ids (each - 1)",
                                   _shift_top_ids),
    "aux-ids-shifted-everywhere": ("every aux-id key + 1, consistently (not the layers it was trained on)",
                                   _shift_all_ids),
    "d2t-absolute": ("`d2t` holds absolute target ids, not offsets", _d2t_absolute),
    "no-draft-vocab-size": ("`draft_vocab_size` missing from config.json", _no_draft_vocab_size),
    "architectures-llama": ("`architectures: [LlamaForCausalLM]`", _architectures_llama),
    "bf16-weights": ("weights saved in bf16, served in fp32", _bf16),
    "draft-vocab-is-vocab": ("the same drafter with draft vocabulary = the whole vocabulary (`d2t` all zero)",
                             _full_draft_vocab),
    "misnamed-hidden-norm": ("`midlayer.hidden_norm` saved as `midlayer.hidden_layernorm`", _rename(
        "midlayer.hidden_norm.weight", "midlayer.hidden_layernorm.weight")),
    "model-prefixed-names": ("`model.midlayer.*` names", _prefix_model),
    "norm-before-residual": ("`norm_before_residual: true` (trained with false)", _norm_before_residual),
    "tied-embeddings": ("`tie_word_embeddings: true`", _tied),
    "no-t2d": ("`t2d` missing", _no_t2d),
}


def write_variant(src: Path, dst: Path, edit: Edit | None) -> Path:
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    if edit:
        edit(cfg, w)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(dst / "model.safetensors"))
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", required=True, help="a good export (standard layout)")
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--output", required=True)
    parser.add_argument("--only", nargs="*", default=None, help="variant names (default: all)")
    args = parser.parse_args(argv)

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.verifier)
    prompts, _ = load_prompts("mt-bench", args.num_prompts)
    ids = [render_prompt(tokenizer, [{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    request = GenerationRequest(verifier=resolve_verifier(args.verifier), prompts=ids,
                                max_new_tokens=args.max_new_tokens, k=3, method=EAGLE3.vllm_method)
    plain = run_vllm(request, threads=torch.get_num_threads())["plain"]["outputs"]
    rows = []
    for name, (what, edit) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        path = write_variant(Path(args.drafter), out / name, edit)
        findings = check_drafter(str(path), verifier=args.verifier, engine="vllm")
        errors = sorted({f.code for f in findings if f.level == "error"})
        warnings = sorted({f.code for f in findings if f.level == "warning"})
        start = time.perf_counter()
        try:
            res = run_vllm(request.replace(drafter=str(path), plain=False), threads=torch.get_num_threads())["spec"]
            steps = [a for o, c in zip(res["outputs"], res["spec"])
                     for a in cut_final_step(c["per_step_accepted"], len(o), args.max_new_tokens)]
            drafts = sum(c["drafts"] for c in res["spec"])
            accepted = sum(c["accepted"] for c in res["spec"])
            vllm = {"served": True, "tau": 1 + accepted / drafts if drafts else None,
                    "tau_as_evaluate_counts": 1 + sum(steps) / len(steps) if steps else None,
                    "identical_to_plain": res["outputs"] == plain}
        except VllmError as exc:
            vllm = {"served": False, "error": str(exc).split(": ", 1)[-1]}
        vllm["seconds"] = round(time.perf_counter() - start, 1)
        rows.append({"variant": name, "what": what, "vllm": vllm, "check_errors": errors, "check_warnings": warnings})
        print(json.dumps(rows[-1]), flush=True)
    (out / "broken_exports.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| export | vLLM 0.32 (CPU) | `eagle3-hf check --engine vllm` |", "|---|---|---|"]
    for r in rows:
        v = r["vllm"]
        served = (f"serves, τ {v['tau']:.2f}" + ("" if v["identical_to_plain"] else ", output differs from plain!")
                  if v["served"] else f"refuses: {v['error'][:160]}")
        verdict = ("errors: " + ", ".join(r["check_errors"])) if r["check_errors"] else (
            "passes" + (f" (warnings: {', '.join(r['check_warnings'])})" if r["check_warnings"] else ""))
        lines.append(f"| {r['what']} | {served} | {verdict} |")
    (out / "broken_exports.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
