"""Speculative decoding on the default verifier: τ, per-position acceptance and speedup over plain greedy.

    .venv/bin/python bench/speculative.py [--drafter DIR_OR_REPO] [--num-prompts 3] [--k 3] [--max-new-tokens 32]
    .venv/bin/python bench/speculative.py --oracle 1.0    # the ceiling: drafts are the verifier's own tokens
    .venv/bin/python bench/speculative.py --drafter DIR --first-hits   # top-1/2/4/8 hit rate of the first draft
    .venv/bin/python bench/speculative.py --cycle-costs   # one cycle's pieces -> predicted speedup at each tau;
                                                          # tree verify (N = 4 .. 16) and K-wide draft costs

Runs on the embedded SmolLM2-135M-Instruct and the first N MT-bench questions (first turn). Plain and
speculative decoding of each prompt are timed back to back in one run, so the speedup is a ratio on the
same (shared, noisy) machine, never an absolute number. Without --drafter a randomly initialised drafter
is used: τ ≈ 1 and the speedup is the floor (drafting and verifying with nothing accepted). --oracle P
replaces the drafter by one that proposes the verifier's greedy continuation (right with probability P,
computed first by plain decoding) at zero drafting cost: what verification alone costs at a given τ here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from eagle3_hf import Eagle3Config, Eagle3DraftModel
from eagle3_hf.decoding import acceptance_stats, greedy_generate, speculative_decode
from eagle3_hf.evaluation.evaluate import evaluate_drafter, format_summary, load_prompts, render_prompt
from eagle3_hf.verifier.loading import DEFAULT_VERIFIER, load_tokenizer, load_verifier


def random_drafter(verifier, draft_vocab_size: int = 32000, seed: int = 0) -> Eagle3DraftModel:
    config = Eagle3Config.from_verifier(verifier.config, draft_vocab_size=draft_vocab_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    drafter = Eagle3DraftModel(config).eval()  # identity mapping onto the first draft_vocab_size ids
    drafter.load_verifier_embeddings(verifier)
    return drafter


class OracleDrafter:
    """Drafts the verifier's greedy continuation `reference`, wrong at random positions (rate 1 - hit_rate)."""

    def __init__(self, reference: list[int], verifier, hit_rate: float, seed: int = 0):
        self.reference, self.vocab_size = reference, verifier.config.vocab_size
        self.config = type("Config", (), {"aux_hidden_state_indices": [1, 2, 3]})()
        draws = torch.rand(len(reference) + 64, generator=torch.Generator().manual_seed(seed))
        self.wrong = (draws > hit_rate).tolist()

    def draft_to_target(self, ids):
        return ids

    def draft_step(self, input_ids, hidden_states, position_ids, past_key_values=None):
        q = input_ids.shape[1]
        logits = torch.zeros(1, q, self.vocab_size, device=input_ids.device)
        for j, t in enumerate((position_ids[0] + 2).tolist()):  # position t predicts token t + 2
            token = self.reference[t] if t < len(self.reference) else 0
            logits[0, j, (token + 1) % self.vocab_size if self.wrong[t] else token] = 1.0
        return logits, logits[..., :1], None  # hidden and cache are never read


def oracle_bench(verifier, tokenizer, prompts, k: int, max_new_tokens: int, hit_rate: float) -> None:
    accepted, drafted, base_s, spec_s, lossless = [], [], 0.0, 0.0, True
    for i, item in enumerate(prompts):
        ids = render_prompt(tokenizer, [{"role": "user", "content": item["turns"][0]}])
        if i == 0:  # untimed warm-up
            greedy_generate(verifier, ids, 2)
        base = greedy_generate(verifier, ids, max_new_tokens)
        spec = speculative_decode(verifier, OracleDrafter(ids + base.tokens, verifier, hit_rate, seed=i), ids,
                                  steps=k, max_new_tokens=max_new_tokens)
        accepted += spec.accepted_per_step
        drafted += spec.drafted_per_step
        base_s, spec_s = base_s + base.seconds, spec_s + spec.seconds
        lossless &= spec.tokens == base.tokens
    stats = acceptance_stats(accepted, drafted, k)
    per_pos = ", ".join("-" if a is None else f"{a:.3f}" for a in stats["per_position_acceptance"])
    print(f"oracle drafter (hit rate {hit_rate}): tau {stats['acceptance_length']:.3f} | per-position [{per_pos}] | "
          f"speedup {base_s / spec_s:.2f}x (plain {base_s:.1f} s, speculative {spec_s:.1f} s) | lossless {lossless}")


def cycle_costs(verifier, tokenizer, prompts, k: int, draft_vocab_size: int, reps: int = 15,
                write_costs: str | None = None) -> None:
    """Median cost of each piece of one speculative cycle at a real context, interleaved so that load drifts
    hit all alike: the plain one-token forward t1, the verify forward over k + 1 tokens (with the aux states),
    a drafting step and the drafter's update after a verify (2 accepted tokens), for a random drafter of the
    given draft vocabulary. Predicted speedup S(tau) = tau t1 / (t_verify + (k - 1) t_draft + t_update), the
    other per-cycle work (argmax, crop, margins) being measured as negligible. One thread: CPU seconds, which
    other processes on a shared machine do not inflate; more threads: wall seconds. `write_costs` writes the
    table `evaluate --sweep --verify-costs FILE` predicts each configuration's speedup from (costs relative to t1:
    verify by tokens read, draft by nodes fed, update)."""
    from eagle3_hf.decoding.core import crop, new_cache, verifier_forward
    from eagle3_hf.verifier.cpu_linear import prepacked_linears

    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    drafter = random_drafter(verifier, draft_vocab_size).to(verifier.device)
    aux_indices = list(drafter.config.aux_hidden_state_indices)
    ids = torch.tensor([render_prompt(tokenizer, [{"role": "user", "content": prompts[0]["turns"][0]}])])
    n = ids.shape[1]
    times: dict[str, list[float]] = {"t1": [], "verify": [], "draft": [], "update": []}
    with torch.inference_mode(), prepacked_linears(verifier, drafter):
        cache = new_cache(verifier)
        _, aux = verifier_forward(verifier, ids, cache, aux_indices, last_only=True)
        _, hidden, d_cache = drafter.draft_step(ids, aux, torch.arange(n)[None], logits_to_keep=1)
        tok = ids[:, -1:]
        for rep in range(reps + 2):
            start = clock()
            verifier_forward(verifier, tok, cache, None, last_only=True)
            t1 = clock()
            verifier_forward(verifier, tok.repeat(1, k + 1), cache, aux_indices)
            verify = clock()
            drafter.draft_step(tok, hidden[:, -1:], torch.tensor([[n]]), d_cache)
            draft = clock()
            drafter.draft_step(tok.repeat(1, 2), aux[:, -2:], torch.tensor([[n, n + 1]]), d_cache, logits_to_keep=1)
            update = clock()
            crop(cache, n)
            if rep >= 2:  # two warm-ups
                for key, (a, b) in zip(times, ((start, t1), (t1, verify), (verify, draft), (draft, update))):
                    times[key].append(b - a)
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    cycle = med["verify"] + (k - 1) * med["draft"] + med["update"]
    print(f"per-cycle costs at context {n}, k={k}, draft vocabulary {draft_vocab_size} ({clock.__name__}): "
          + ", ".join(f"{key} {1e3 * value:.1f} ms" for key, value in med.items())
          + f" | verify/t1 {med['verify'] / med['t1']:.2f}, cycle/t1 {cycle / med['t1']:.2f}")
    predicted = ", ".join(f"tau {tau}: {tau * med['t1'] / cycle:.2f}x" for tau in (1.2, 1.5, 2.0, 2.5, 3.0))
    print(f"predicted speedup: {predicted} | break-even tau {cycle / med['t1']:.2f}")
    tree = tree_costs(verifier, drafter, ids, clock, reps)
    if write_costs:
        verify = {k + 1: med["verify"] / med["t1"], **{n: c for n, c in tree["verify"].items()}}
        table = {"device": _device_name(verifier), "clock": clock.__name__, "context": n, "t1_seconds": med["t1"],
                 "verify": verify, "draft": {1: med["draft"] / med["t1"], **tree["draft"]},
                 "update": med["update"] / med["t1"]}
        Path(write_costs).write_text(json.dumps(table, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {write_costs}")


def _device_name(verifier) -> str:
    """The GPU's name, or the CPU's with its widest vector extension (what the verify cost depends on)."""
    if verifier.device.type == "cuda":
        return torch.cuda.get_device_name(verifier.device)
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return f"cpu ({'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'})"


def tree_costs(verifier, drafter, ids, clock, reps: int, sizes=(4, 8, 12, 16), widths=(2, 4, 8)) -> dict:
    """The tree's pieces at the same context (tree.py, SGLang's --speculative-eagle-topk > 1): the verify
    forward over N tree tokens with the tree mask and the aux states, and one drafting step over K nodes with the
    drafter's tree mask; each relative to the one-token forward t1, interleaved like the chain's pieces.
    Predicted speedup of (S, K, N) at tau: tau t1 / (verify_N + (S - 1) draft_K + update)."""
    from eagle3_hf.decoding.core import crop, make_rollbackable, new_cache, verifier_forward
    from eagle3_hf.decoding.tree import cost_tree, tree_attention_mask
    from eagle3_hf.verifier.cpu_linear import prepacked_linears

    aux_indices = list(drafter.config.aux_hidden_state_indices)
    n, dtype = ids.shape[1], next(verifier.parameters()).dtype
    times: dict[str, list[float]] = {"t1": [], **{f"verify{s}": [] for s in sizes}, **{f"draft{k}": [] for k in widths}}
    with torch.inference_mode(), prepacked_linears(verifier, drafter):
        cache = new_cache(verifier)
        _, aux = verifier_forward(verifier, ids, cache, aux_indices, last_only=True)
        make_rollbackable(cache)
        _, hidden, d_cache = drafter.draft_step(ids, aux, torch.arange(n)[None], logits_to_keep=1)
        tok = ids[:, -1:]
        trees = {s: cost_tree(s) for s in sizes}
        masks = {s: tree_attention_mask(verifier, t, n, dtype, verifier.device) for s, t in trees.items()}
        for rep in range(reps + 2):
            start = clock()
            verifier_forward(verifier, tok, cache, None, last_only=True)
            lap = {"t1": clock() - start}
            crop(cache, n)
            for s in sizes:
                start = clock()
                verifier_forward(verifier, tok.repeat(1, s), cache, aux_indices, attention_mask=masks[s],
                                 position_ids=(n + torch.tensor(trees[s].depths))[None])
                lap[f"verify{s}"] = clock() - start
                crop(cache, n)
            for k in widths:
                allowed = torch.cat([torch.ones(k, n, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], dim=1)
                start = clock()
                drafter.draft_step(tok.repeat(1, k), hidden[:, -1:].expand(1, k, -1), torch.full((1, k), n), d_cache,
                                   attention_mask=allowed)
                lap[f"draft{k}"] = clock() - start
            if rep >= 2:
                for key, value in lap.items():
                    times[key].append(value)
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    print("tree verify/t1: " + ", ".join(f"N={s} {med[f'verify{s}'] / med['t1']:.2f}" for s in sizes)
          + " | tree draft step/t1: " + ", ".join(f"K={k} {med[f'draft{k}'] / med['t1']:.2f}" for k in widths))
    return {"verify": {s: med[f"verify{s}"] / med["t1"] for s in sizes},
            "draft": {k: med[f"draft{k}"] / med["t1"] for k in widths}}


@torch.inference_mode()
def first_draft_hits(verifier, drafter, tokenizer, prompts, max_new_tokens: int, ks=(1, 2, 4, 8)) -> None:
    """How often the verifier's next token is among the drafter's top-k at the first draft position (what a
    tree's depth 1 with top-K can accept), over each prompt's plain greedy answer, teacher-forced: the drafter
    reads the verifier's features of every answer token, as after a verify. Top-1 is the chain's first draft."""
    from eagle3_hf.decoding.core import new_cache, verifier_forward

    aux_indices = list(drafter.config.aux_hidden_state_indices)
    hits, total = {k: 0 for k in ks}, 0
    for prompt in prompts:
        ids = render_prompt(tokenizer, [{"role": "user", "content": prompt["turns"][0]}])
        seq = torch.tensor([ids + greedy_generate(verifier, ids, max_new_tokens).tokens], device=verifier.device)
        _, aux = verifier_forward(verifier, seq, new_cache(verifier), aux_indices)  # [1, L, 3H]
        length = seq.shape[1]
        logits, _, _ = drafter.draft_step(seq[:, 1:], aux[:, :-1], torch.arange(length - 1, device=seq.device)[None])
        first = len(ids) - 1  # drafter position t predicts token t + 2: answer tokens after the first one
        top = drafter.draft_to_target(logits[0, first: length - 2].topk(max(ks), -1).indices)  # [M, K]
        targets = seq[0, first + 2:, None]
        for k in ks:
            hits[k] += int((top[:, :k] == targets).any(-1).sum())
        total += targets.shape[0]
    print(f"first-position top-k hit rate over {total} answer tokens of {len(prompts)} prompts: "
          + ", ".join(f"top-{k} {hits[k] / max(total, 1):.3f}" for k in ks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default=None, help="drafter directory or repo id (default: random drafter)")
    parser.add_argument("--verifier", default=DEFAULT_VERIFIER)
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--oracle", type=float, default=None, metavar="HIT_RATE",
                        help="measure an oracle drafter instead (greedy only)")
    parser.add_argument("--cycle-costs", action="store_true",
                        help="time the pieces of one draft+verify cycle and predict the speedup at a given tau")
    parser.add_argument("--draft-vocab-size", type=int, default=4096, help="random drafter's, for --cycle-costs")
    parser.add_argument("--write-costs", default=None, metavar="FILE",
                        help="with --cycle-costs: write the cost table `evaluate --sweep --verify-costs` reads")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--first-hits", action="store_true",
                        help="the drafter's top-1/2/4/8 hit rate at the first draft position (needs --drafter)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; 1 (default) is steadier and faster on a shared CPU, 0 = torch's")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    verifier = load_verifier(args.verifier).to(device)
    tokenizer = load_tokenizer(args.verifier)
    prompts, prompts_name = load_prompts("mt-bench", args.num_prompts)
    print(f"verifier {args.verifier} | device {device}, {torch.get_num_threads()} threads | {len(prompts)} MT-bench "
          f"prompts x {args.max_new_tokens} new tokens, k={args.k}")
    if args.cycle_costs:
        return cycle_costs(verifier, tokenizer, prompts, args.k, args.draft_vocab_size, write_costs=args.write_costs)
    if args.first_hits:
        drafter = Eagle3DraftModel.from_pretrained(args.drafter, verifier=verifier, device=device)
        return first_draft_hits(verifier, drafter, tokenizer, prompts, args.max_new_tokens)
    if args.oracle is not None:
        return oracle_bench(verifier, tokenizer, prompts, args.k, args.max_new_tokens, args.oracle)
    if args.drafter:
        drafter = Eagle3DraftModel.from_pretrained(args.drafter, verifier=verifier, device=device)
        name = args.drafter
    else:
        drafter, name = random_drafter(verifier).to(device), "random (untrained: expect tau ~ 1)"
    start = time.perf_counter()
    summary = evaluate_drafter(verifier, drafter, tokenizer, prompts, k=args.k, max_new_tokens=args.max_new_tokens,
                               temperature=args.temperature, prompts_name=prompts_name)
    wall = time.perf_counter() - start
    rows = summary.pop("per_prompt")
    print(f"drafter {name} | T={args.temperature} | wall {wall:.1f} s")
    for r in rows:
        print(f"  {r['id']:>14}: tau {r['tau']:.2f}  new {r['new_tokens']:3d}  forwards {r['verifier_forwards']:3d}  "
              f"speedup {r['baseline_seconds'] / r['speculative_seconds']:.2f}x  {r['lossless']}")
    print(format_summary(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
