"""What one cycle of llama.cpp's EAGLE-3 loop costs beside one plain forward of the verifier, and so the τ a
verifier needs before speculative decoding pays in llama.cpp on this machine.

For each verifier GGUF given, a plain llama-server and one with the drafter (`draft-eagle3`, k drafts, p-min 0 so
every cycle drafts k) decode the same prompts, each prompt back to back on both, in alternating order. From the
server's own generation timings and its streamed draft counters (eagle3_hf/engines/llamacpp_server.py):

- forward = plain seconds per generated token (one verifier forward each);
- cycle = speculative seconds per verify cycle (draft k tokens: the EAGLE-3 encoder over the accepted positions'
  features, k decoder steps, then one verifier forward over k + 1 tokens);
- c = cycle / forward, a ratio within one run. A cycle emits τ tokens, so the speedup is τ / c and the break-even
  τ is c: a drafter must reach τ > c with this verifier here before llama.cpp's loop pays.

    .venv/bin/python -m bench.llamacpp_cycle --drafter DRAFTER_DIR --verifier smollm2-135m-instruct \
        --verifier-gguf default convert --num-prompts 6 --max-new-tokens 64 --output bench_out/llamacpp

Each --verifier-gguf is a file, `default` (the embedded default's own Q4_1 file) or `convert` (the verifier's
directory converted at --gguf-type). `make llamacpp` first. Prints one row per verifier file and writes JSON.

Larger verifiers: `--synthetic smollm2-360m smollm2-1.7b` builds Llamas of those published shapes with random
weights around the SmolLM2 tokenizer, and a random drafter for each (what a cycle costs does not depend on the
weights' values: with p-min 0 every cycle drafts k tokens whatever they are), converted at --synthetic-type. Their
τ is meaningless (≈ 1); their c, the break-even τ, is the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

from eagle3_hf.engines.llamacpp_env import find_llamacpp
from eagle3_hf.engines.llamacpp_server import LlamaServer
from eagle3_hf.publish.export import drafter_gguf, verifier_gguf_of


def measure(build, model: Path, drafter: Path, ids: list[list[int]], k: int, max_new: int, threads: int,
            out: Path) -> dict:
    ctx = max(len(i) for i in ids) + max_new + k + 16
    plain = LlamaServer(build, model, out / f"{model.stem}-plain.log", threads=threads, ctx_size=ctx)
    spec = LlamaServer(build, model, out / f"{model.stem}-spec.log", draft=drafter, k=k, p_min=0.0, threads=threads,
                       ctx_size=ctx)
    rows = []
    with plain, spec:
        plain.complete(ids[0], 4)
        spec.complete(ids[0], 4)
        for i, prompt in enumerate(ids):
            pair = {}
            order = [("plain", plain), ("spec", spec)]
            for name, server in order if i % 2 == 0 else order[::-1]:
                pair[name] = server.complete(prompt, max_new, probs=False, ignore_eos=True)
            rows.append(pair)
    tokens_plain = sum(len(r["plain"].tokens) for r in rows)
    seconds_plain = sum(r["plain"].seconds for r in rows)
    cycles = sum(len(r["spec"].accepted) for r in rows)
    seconds_spec = sum(r["spec"].seconds for r in rows)
    accepted = sum(sum(r["spec"].accepted) for r in rows)
    forward, cycle = seconds_plain / tokens_plain, seconds_spec / cycles
    tau = 1 + accepted / cycles
    return {"verifier_gguf": str(model), "size_mib": model.stat().st_size / 2**20, "forward_ms": 1e3 * forward,
            "cycle_ms": 1e3 * cycle, "cycle_over_forward": cycle / forward, "break_even_tau": cycle / forward,
            "tau": tau, "speedup_predicted": tau * forward / cycle,
            "speedup_measured": sum(len(r["spec"].tokens) for r in rows) / seconds_spec * seconds_plain / tokens_plain,
            "cycles": cycles, "prompts": len(rows)}


# the published SmolLM2 shapes (config.json of HuggingFaceTB/SmolLM2-360M-Instruct and -1.7B-Instruct)
SHAPES = {"smollm2-360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                               num_key_value_heads=5),
          "smollm2-1.7b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                               num_key_value_heads=32)}


def synthetic_pair(name: str, tokenizer_dir: Path, root: Path) -> tuple[Path, Path]:
    """(verifier dir, drafter dir): a random Llama of shape `name` with the SmolLM2 tokenizer, a random drafter."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3_hf import Eagle3Config, Eagle3DraftModel

    verifier_dir, drafter_dir = root / name, root / f"{name}-drafter"
    if not (drafter_dir / "config.json").is_file():
        config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2, rope_theta=100000.0, **SHAPES[name])
        torch.manual_seed(0)
        with torch.device("meta"):
            verifier = LlamaForCausalLM(config)
        verifier = verifier.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for p in verifier.parameters():
                p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
        verifier.save_pretrained(verifier_dir)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(verifier_dir)
        drafter_config = Eagle3Config.from_verifier(config, draft_vocab_size=4096)
        drafter = Eagle3DraftModel(drafter_config).eval()
        d2t = torch.zeros(4096, dtype=torch.long)  # the first 4,096 ids
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[:4096] = True
        drafter.set_vocab_mapping(d2t, t2d)
        drafter.save_pretrained(drafter_dir)
        del verifier
    return verifier_dir, drafter_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", required=True, help="drafter directory (standard layout)")
    p.add_argument("--verifier", default="smollm2-135m-instruct", help="the verifier the drafter was trained for")
    p.add_argument("--verifier-gguf", nargs="+", default=["default"], help="files, `default` or `convert`")
    p.add_argument("--gguf-type", default="f32")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    p.add_argument("--output", default="bench_out/llamacpp")
    p.add_argument("--synthetic", nargs="*", default=[], choices=sorted(SHAPES),
                   help="also random verifiers of these shapes, each with a random drafter (break-even τ only)")
    p.add_argument("--synthetic-type", default="q8_0", help="their GGUF type (default: %(default)s)")
    args = p.parse_args()

    from eagle3_hf.evaluation.evaluate import load_prompts, prompt_turns, render_prompt
    from eagle3_hf.verifier.loading import cache_dir, load_tokenizer, resolve_verifier

    build = find_llamacpp()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    verifier_dir = Path(resolve_verifier(args.verifier))
    drafter = drafter_gguf(build, args.drafter, verifier_dir, out / f"drafter-{args.gguf_type}.gguf",
                           args.gguf_type)
    tokenizer = load_tokenizer(args.verifier)
    prompts, _ = load_prompts("mt-bench", args.num_prompts)
    ids = [render_prompt(tokenizer, [{"role": "user", "content": prompt_turns(q)[0]}]) for q in prompts]
    results = []
    for given in args.verifier_gguf:
        model = verifier_gguf_of(build, args.verifier, verifier_dir, None if given == "default" else given,
                                 args.gguf_type, cache_dir() / "gguf")
        row = measure(build, model, drafter, ids, args.k, args.max_new_tokens, args.threads, out)
        results.append(row)
        print(f"{model.name} ({row['size_mib']:.0f} MiB): forward {row['forward_ms']:.1f} ms, cycle (k={args.k}) "
              f"{row['cycle_ms']:.1f} ms = {row['cycle_over_forward']:.2f} forwards -> break-even tau "
              f"{row['break_even_tau']:.2f}; tau {row['tau']:.3f}, speedup {row['speedup_measured']:.2f}x "
              f"(tau / c predicts {row['speedup_predicted']:.2f}x)", flush=True)
    for name in args.synthetic:
        v_dir, d_dir = synthetic_pair(name, verifier_dir, cache_dir() / "synthetic")
        d_gguf = drafter_gguf(build, str(d_dir), v_dir, out / f"{name}-drafter.gguf", args.synthetic_type)
        model = verifier_gguf_of(build, name, v_dir, "convert", args.synthetic_type, cache_dir() / "gguf")
        row = measure(build, model, d_gguf, ids, args.k, args.max_new_tokens, args.threads, out)
        row["synthetic"] = name
        results.append(row)
        print(f"{name} (random weights, {model.name}, {row['size_mib']:.0f} MiB): forward {row['forward_ms']:.1f} ms,"
              f" cycle {row['cycle_ms']:.1f} ms = {row['cycle_over_forward']:.2f} forwards -> break-even tau "
              f"{row['break_even_tau']:.2f}", flush=True)
    record = {"llamacpp": build.version(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "threads": args.threads, "k": args.k, "drafter": args.drafter,
              "results": results}
    (out / "llamacpp_cycle.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
