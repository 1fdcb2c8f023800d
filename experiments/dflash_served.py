"""A DFlash export served by llama.cpp and vLLM beside our own decoder: the accepted drafts per cycle, engine by engine.

    .venv/bin/python -m experiments.dflash_served --out runs/dflash_served [--alpha 0.5] [--engines llamacpp vllm]
    .venv/bin/python -m experiments.dflash_served --out runs/dflash_served2 --alpha 0.4 --num-prompts 8 \
        --max-new-tokens 48

Builds a random 6-layer Llama verifier (hidden 256, head_dim 64, which vLLM's CPU attention takes) with the
embedded default's tokenizer, whose greedy answers repeat one token per prompt, and a 2-layer DFlash drafter with
block 5 whose mask token is that token and whose o_proj / down_proj are scaled by `--alpha`: at 0.5 its blocks are
accepted whole in some cycles and not at all in others, so the per-cycle records compare the drafter's math across
engines (at small alpha every draft is accepted, at large none; at 0.4 the drafts drift off the repeated token
after some cycles). Then runs `eagle3-hf evaluate --engine llamacpp` and `--engine vllm` (k = 4, fp32, CPU), which
print τ and how many prompts have equal accepted drafts at every cycle. The results are stated in docs/contracts.md
("A block drafter: DFlash").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

PROMPTS = ["Name a color.", "What is two plus two?", "Write a haiku about the sea.", "Hello!", "Tell me a joke.",
           "What is the capital of France?", "List three fruits.", "Why is the sky blue?"]


def build(out: Path, alpha: float, num_prompts: int = 4) -> None:
    """The verifier, the drafter and the prompts under `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagle3_hf.decoding import greedy_generate
    from eagle3_hf.evaluation.evaluate import render_prompt
    from eagle3_hf.model.configuration_dflash import DFlashConfig
    from eagle3_hf.model.modeling_dflash import DFlashDraftModel
    from eagle3_hf.verifier.loading import default_verifier_dir

    tokenizer = AutoTokenizer.from_pretrained(default_verifier_dir())
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    verifier = LlamaForCausalLM(config).eval().requires_grad_(False)
    verifier.save_pretrained(out / "verifier")
    tokenizer.save_pretrained(out / "verifier")
    first = render_prompt(tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    repeated = greedy_generate(verifier, first, 8, eos_token_id=[]).tokens[-1]
    drafter_config = DFlashConfig.from_verifier(verifier.config, mask_token_id=repeated, num_hidden_layers=2,
                                                block_size=5)
    torch.manual_seed(0)
    drafter = DFlashDraftModel(drafter_config).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.mul_(alpha)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    drafter.load_verifier_embeddings(verifier)
    drafter.save_pretrained(out / "drafter")
    (out / "prompts.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                                               for i, p in enumerate(PROMPTS[:num_prompts])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--num-prompts", type=int, default=4, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--engines", nargs="+", choices=["llamacpp", "vllm"], default=["llamacpp", "vllm"])
    args = parser.parse_args(argv)
    from eagle3_hf.cli import main as cli

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    build(out, args.alpha, args.num_prompts)
    codes = []
    for engine in args.engines:
        extra = ["--verifier-gguf", "convert"] if engine == "llamacpp" else []
        codes.append(cli(["evaluate", "--engine", engine, "--drafter", str(out / "drafter"), "--verifier",
                          str(out / "verifier"), "--prompts", str(out / "prompts.jsonl"), "--k", "4",
                          "--max-new-tokens", str(args.max_new_tokens), "--output", str(out / f"eval_{engine}"),
                          "--no-progress", *extra]))
    return max(codes, default=0)


if __name__ == "__main__":
    raise SystemExit(main())
