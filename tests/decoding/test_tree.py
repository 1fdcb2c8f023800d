"""Tree drafting (SGLang's --speculative-eagle-topk > 1): topk 1 is today's chain bit for bit, greedy trees are
lossless on every verifier family and the embedded default, tree sampling is exact in distribution, a drafter
whose second choice is right gains from the tree, the tree's construction follows SGLang's rules, and the sweep
writes the configuration it recommends."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_hf.decoding import greedy_generate, speculative_decode
from eagle3_hf.decoding.tree import (
    DraftTree,
    accept_greedy,
    accept_sampled,
    config_problem,
    draft_tree,
    num_candidates,
    tree_speculative_generate,
)

from tests.helpers.assertions import assert_matches_greedy, chi_square_p_value
from tests.helpers.drafters import random_drafter
from tests.helpers.families import family_model
from tests.helpers.verifiers import lively_verifier


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RankOracle:
    """A real drafter (its cache, tree mask and hidden states run) whose logits are rewritten: at drafter
    position t the reference token t + 2 gets rank ranks[t] (0 = its top choice; None = not proposed), the
    other ranks go to decoys. Identity vocabulary mapping, so draft ids are verifier ids."""

    def __init__(self, inner, reference: list[int], ranks: list[int | None]):
        self.inner, self.reference, self.ranks = inner, reference, ranks
        self.config, self.d2t = inner.config, inner.d2t

    def draft_to_target(self, ids):
        return self.inner.draft_to_target(ids)

    def draft_step(self, input_ids, hidden_states, position_ids, past_key_values=None, logits_to_keep=0,
                   attention_mask=None):
        _, hidden, cache = self.inner.draft_step(input_ids, hidden_states, position_ids, past_key_values,
                                                 attention_mask=attention_mask)
        vocab = self.config.draft_vocab_size
        logits = torch.full((1, input_ids.shape[1], vocab), -1e4)
        for j, t in enumerate(position_ids[0].tolist()):
            ref = self.reference[t + 2] if t + 2 < len(self.reference) else 0
            rank = self.ranks[t] if t < len(self.ranks) else None
            decoys = [(ref + 1 + i) % vocab for i in range(8)]
            order = decoys[:rank] + [ref] + decoys[rank:] if rank is not None else decoys
            for r, token in enumerate(order):
                logits[0, j, token] = -float(r)
        return (logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits), hidden, cache


def oracle(verifier, prompt, max_new_tokens, ranks, aux=None):
    reference = prompt + greedy_generate(verifier, prompt, max_new_tokens + 8, eos_token_id=[]).tokens
    vocab = int(verifier.config.get_text_config().vocab_size)
    inner = random_drafter(verifier, draft_vocab_size=vocab, aux=aux) if aux else random_drafter(verifier, vocab)
    return RankOracle(inner, reference, ranks)


def assert_tree_lossless(verifier, drafter, prompt, max_new_tokens, **tree):
    """Token-identical to greedy, and the same distribution at every position: the cache kept the right rows."""
    out = speculative_decode(verifier, drafter, prompt, max_new_tokens=max_new_tokens, eos_token_id=[], **tree)
    assert out.tree_size_per_step is not None  # the tree ran, not the chain
    return assert_matches_greedy(verifier, prompt, max_new_tokens, out, eos_token_id=[])


# ---------------------------------------------------------------- topk 1 is the chain


def test_topk_one_is_todays_chain_bit_for_bit():
    verifier = lively_verifier()
    prompt = list(range(1000, 1012))
    ranks = torch.randint(0, 3, (80,), generator=torch.Generator().manual_seed(2)).tolist()
    for drafter in (random_drafter(verifier), oracle(verifier, prompt, 30, ranks)):
        chain = speculative_decode(verifier, drafter, prompt, steps=3, topk=1, max_new_tokens=30)
        assert chain.tree_size_per_step is None  # topk 1 is dispatched to the chain
        tree = tree_speculative_generate(verifier, drafter, prompt, steps=3, topk=1, num_draft_tokens=4,
                                         max_new_tokens=30)
        for key in ("tokens", "accepted_per_step", "drafted_per_step", "draft_tokens", "acceptance_length"):
            assert getattr(tree, key) == getattr(chain, key), key
        assert tree.tree_size_per_step == [d + 1 for d in chain.drafted_per_step]
        # the tree mask takes another attention kernel path than the causal default: logits agree to rounding
        torch.testing.assert_close(torch.tensor(tree.margins), torch.tensor(chain.margins), atol=1e-4, rtol=1e-4)
    assert set(chain.accepted_per_step) >= {0, 1, 2}  # the oracle run rejected and accepted


# ---------------------------------------------------------------- lossless (greedy)


def test_tree_greedy_lossless_tiny_llama_every_acceptance_length():
    verifier = lively_verifier()
    prompt = list(range(1000, 1012))
    ranks = torch.randint(0, 4, (80,), generator=torch.Generator().manual_seed(0)).tolist()  # rank 2, 3: misses at K=2
    out = assert_tree_lossless(verifier, oracle(verifier, prompt, 40, ranks), prompt, 40, steps=3, topk=2,
                               num_draft_tokens=6)
    assert set(out.accepted_per_step) == {0, 1, 2, 3}
    assert any(len(t) == 5 for t in out.draft_tokens)
    assert_tree_lossless(verifier, random_drafter(verifier), prompt, 16, steps=5, topk=8, num_draft_tokens=16)


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "deepseek_v3"])
def test_tree_greedy_lossless_every_family(family):
    """Accepted paths of every length through wide trees: the verifier's cache is gathered to the path each
    step; Gemma 3's 8-token sliding window is crossed with per-layer-type masks."""
    verifier = family_model(family)
    prompt = torch.randint(3, 1000, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ranks = torch.randint(0, 5, (80,), generator=torch.Generator().manual_seed(3)).tolist()
    drafter = oracle(verifier, prompt, 24, ranks, aux=[1, 2, 4])
    out = assert_tree_lossless(verifier, drafter, prompt, 24, steps=3, topk=4, num_draft_tokens=10)
    assert max(out.accepted_per_step) >= 2 and min(out.accepted_per_step) == 0


def test_tree_greedy_lossless_on_default_verifier(default_verifier_dir, tokenizer):
    from eagle3_hf.demo_data.prompts import mtbench_questions
    from eagle3_hf.evaluation.evaluate import render_prompt
    from eagle3_hf.verifier.loading import load_verifier

    verifier = load_verifier(str(default_verifier_dir))
    prompt = render_prompt(tokenizer, [{"role": "user", "content": mtbench_questions()[0]["turns"][0]}])
    ranks = torch.randint(0, 4, (len(prompt) + 40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = assert_tree_lossless(verifier, oracle(verifier, prompt, 20, ranks), prompt, 20, steps=3, topk=2,
                               num_draft_tokens=6)
    assert max(out.accepted_per_step) >= 2 and min(out.accepted_per_step) == 0


# ---------------------------------------------------------------- the tree helps a drafter whose second choice is right


def test_second_choice_oracle_tau_one_as_chain_and_at_least_two_as_tree():
    verifier = lively_verifier()
    prompt = list(range(1000, 1012))
    drafter = oracle(verifier, prompt, 30, [1] * 80)
    chain = speculative_decode(verifier, drafter, prompt, steps=3, topk=1, max_new_tokens=30)
    assert chain.acceptance_length == 1.0
    tree = speculative_decode(verifier, drafter, prompt, steps=3, topk=2, num_draft_tokens=8, max_new_tokens=30)
    assert tree.acceptance_length >= 2.0
    assert tree.tokens == chain.tokens


# ---------------------------------------------------------------- SGLang's construction rules


def test_tree_construction_follows_sglang():
    """The tree equals SGLang's selection recomputed by brute force with causal drafter runs along each path:
    step 0 keeps the root's top-K; each later step expands only the K kept nodes (K children each, scored by
    the product of probabilities) and keeps the K best; the N - 1 best candidates of all steps form the tree.
    So the drafter's batched tree step (tree mask on its cache) gives each node its own path's distribution."""
    verifier = lively_verifier()
    drafter = random_drafter(verifier, scale=3.0)  # draft id = verifier id (ids below 500)
    prompt = torch.tensor([list(range(1000, 1012))])
    steps, topk = 3, 3
    for size in (9, 1 + num_candidates(steps, topk)):  # a pick among the candidates, and all of them
        _check_against_brute_force(drafter, prompt, verifier, steps, topk, size)
    assert num_candidates(1, 4) == 4 and num_candidates(0, 4) == 0


def _check_against_brute_force(drafter, prompt, verifier, steps, topk, size):
    with torch.no_grad():
        out = verifier(prompt, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in drafter.config.aux_hidden_state_indices], -1)
        logits, hidden, cache = drafter.draft_step(prompt[:, 1:], aux[:, :-1], torch.arange(11)[None])
        root = int(prompt[0, -1])
        tree = draft_tree(drafter, logits[0, -1], hidden[:, -1:], cache, root, 11, steps, topk, size)

        def causal(path):  # the draft distribution after `path`, one causal step per token
            lg, h, kv = logits[0, -1], hidden[:, -1:], cache
            for depth, token in enumerate(path):
                step = drafter.draft_step(torch.tensor([[token]]), h, torch.tensor([[11 + depth]]), kv)
                lg, h, kv = step[0][0, -1], step[1], step[2]
            return torch.softmax(lg.float(), -1)

        top = causal([]).topk(topk)
        kept = [(float(v), [int(t)]) for v, t in zip(top.values, top.indices)]
        candidates = list(kept)
        for _ in range(1, steps):
            expanded = []
            for score, path in kept:
                top = causal(path).topk(topk)
                expanded += [(score * float(v), path + [int(t)]) for v, t in zip(top.values, top.indices)]
            candidates += expanded
            kept = sorted(expanded, key=lambda c: -c[0])[:topk]
        best = sorted(candidates, key=lambda c: -c[0])[: size - 1]
    assert len(candidates) == num_candidates(steps, topk)  # SGLang's score list, counted here by the brute force

    def path(i):
        out = []
        while i > 0:
            out.append(tree.tokens[i])
            i = tree.parents[i]
        return tuple(out[::-1])

    assert len(tree) == size and tree.tokens[0] == root and tree.parents[0] == -1
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in range(1, size))
    assert {path(i) for i in range(1, size)} == {tuple(p) for _, p in best}
    assert max(tree.depths) == (steps if size > 1 + topk + topk * topk else max(len(p) for _, p in best))


def test_config_rules():
    assert config_problem(3, 1, 4) is None and config_problem(3, 4, 16) is None
    assert "steps + 1" in config_problem(3, 1, 8)
    assert config_problem(2, 2, 7) is None and "2..7" in config_problem(2, 2, 8)  # 2 + 4 candidates + the root
    assert config_problem(0, 2, 4) is not None and config_problem(3, 4, 1) is not None


# ---------------------------------------------------------------- sampling is exact in distribution


def _small_tree() -> DraftTree:
    # root -> a (0), b (1); a -> c (2), d (3); b -> e (4)
    return DraftTree([9, 0, 1, 2, 3, 4], [-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2])


def test_tree_sampling_core_is_exact():
    """First token ~ p[root]; after a, the second ~ p[a]; after b, ~ p[b]. A variant that resamples from p
    without removing the rejected children is caught by the same test."""
    g = torch.Generator().manual_seed(0)
    vocab, tree = 6, _small_tree()
    p = torch.softmax(2 * torch.randn(len(tree), vocab, generator=g, dtype=torch.float64), -1)

    def run(n, fn):
        first, after_a, after_b = torch.zeros(vocab), torch.zeros(vocab), torch.zeros(vocab)
        for _ in range(n):
            path, token = fn(tree, p, g)
            out = [tree.tokens[i] for i in path] + [token]
            first[out[0]] += 1
            if len(out) > 1:
                (after_a if out[0] == 0 else after_b)[out[1]] += 1
        return chi_square_p_value(first, p[0]), chi_square_p_value(after_a, p[1]), chi_square_p_value(after_b, p[2])

    assert min(run(6000, accept_sampled)) > 1e-3

    def biased(tree, p, generator):  # rejection of every child, then a draw from p itself
        children, node, path = tree.children(), 0, []
        while True:
            nxt = next((c for c in children[node] if float(torch.rand((), dtype=torch.float64, generator=generator))
                        < float(p[node, tree.tokens[c]])), None)
            if nxt is None:
                return path, int(torch.multinomial(p[node], 1, generator=generator))
            path.append(nxt)
            node = nxt

    assert run(6000, biased)[0] < 1e-6


def test_greedy_acceptance_walks_the_matching_children():
    tree = _small_tree()
    assert accept_greedy(tree, [1, 5, 4, 0, 0, 0]) == ([2, 5], 0)  # b, then e, then the verifier's own 0
    assert accept_greedy(tree, [0, 3, 0, 0, 7, 0]) == ([1, 4], 7)
    assert accept_greedy(tree, [5, 0, 0, 0, 0, 0]) == ([], 5)


@pytest.mark.slow
def test_tree_sampling_matches_the_verifier_distribution():
    """The first three generated tokens over many seeds follow the verifier's sampling distribution, computed
    exactly, with a two-wide tree whose drafts are often accepted."""
    vocab, temperature = 6, 0.8
    verifier = lively_verifier(vocab_size=vocab, hidden_size=32, num_layers=4, seed=4)
    drafter = random_drafter(verifier, draft_vocab_size=4, kept=torch.tensor([0, 2, 3, 5]), aux=[1, 2, 3],
                             scale=20.0, seed=1)
    prompt = [1, 4, 0]
    with torch.no_grad():
        grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)
        seqs = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
        logp = torch.log_softmax(verifier(seqs).logits.double() / temperature, -1)
    n = len(prompt)
    exact = (logp[:, n - 1].gather(1, grid[:, :1]) + logp[:, n].gather(1, grid[:, 1:2])
             + logp[:, n + 1].gather(1, grid[:, 2:3])).exp().squeeze(1)
    counts, accepted = torch.zeros(vocab**3), 0
    for seed in range(600):
        out = speculative_decode(verifier, drafter, prompt, steps=2, topk=2, num_draft_tokens=5, max_new_tokens=4,
                                 temperature=temperature, generator=torch.Generator().manual_seed(seed),
                                 eos_token_id=[])
        a, b, c = out.tokens[:3]
        counts[a * vocab * vocab + b * vocab + c] += 1
        accepted += sum(out.accepted_per_step)
    assert accepted > 300
    assert chi_square_p_value(counts, exact) > 1e-3


# ---------------------------------------------------------------- the sweep


# What evaluate_drafter measures for each (S, K, N) of sweep_grid([2, 3], [1, 2], [4, 7]): per prompt, plain and
# speculative seconds at one ratio (so each speed interval is that point), and τ. The deeper chain is the faster
# one, and a tree beats it measurably: (2, 2, 7), though (3, 2, 7) has the highest τ.
SPEEDUP_TAU = {(2, 1, 3): (1.10, 1.6), (2, 2, 4): (1.40, 2.0), (2, 2, 7): (1.50, 2.8), (3, 1, 4): (1.25, 1.9),
               (3, 2, 4): (1.05, 2.2), (3, 2, 7): (1.20, 3.0)}


def _measured(monkeypatch, stop_at: int | None = None) -> list[tuple[int, int, int]]:
    """evaluate_drafter replaced by SPEEDUP_TAU for three prompts; KeyboardInterrupt at call `stop_at`."""
    from eagle3_hf.evaluation import evaluate

    calls = []

    def measured(verifier, drafter, tokenizer, prompts, k=3, topk=1, num_draft_tokens=None, **_):
        calls.append((k, topk, num_draft_tokens))
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # a sweep stopped by hand
        speedup, tau = SPEEDUP_TAU[(k, topk, num_draft_tokens)]
        per_prompt = [{"baseline_seconds": plain, "speculative_seconds": plain / speedup} for plain in (1.0, 2.0, 3.0)]
        return {"acceptance_length": tau, "per_position_acceptance": [0.5] * k, "per_prompt": per_prompt,
                "tokens_per_second": {}, "lossless": True, "mismatches": 0, "numerical_ties": 0}

    monkeypatch.setattr(evaluate, "evaluate_drafter", measured)
    return calls


def test_sweep_recommends_from_its_measurements(tmp_path, monkeypatch):
    from eagle3_hf.constants import SWEEP_FILE
    from eagle3_hf.evaluation.sweep import run_sweep, sweep_grid
    from eagle3_hf.publish.model_card import build_model_card

    from tests.helpers.verifiers import ToyTokenizer, plus_one_verifier

    verifier = plus_one_verifier()
    drafter = random_drafter(verifier, draft_vocab_size=32, aux=[1, 2, 3])
    grid = sweep_grid([2, 3], [1, 2], [4, 7])  # K = 1 only at N = S + 1; (2, 2, 8) is past 1 + 2 + 2 x 2
    assert [(c["steps"], c["topk"], c["num_draft_tokens"]) for c in grid] == list(SPEEDUP_TAU)
    calls = _measured(monkeypatch)
    run_sweep(verifier, drafter, ToyTokenizer(), ["a", "b", "c"], grid, max_new_tokens=12, output=tmp_path,
              progress=False, repeats=2)
    assert calls == list(SPEEDUP_TAU) * 2  # every configuration, every round
    data = json.loads((tmp_path / SWEEP_FILE).read_text())
    for row in data["configs"]:  # both rounds' prompts pooled into one speed and its interval
        speedup = SPEEDUP_TAU[(row["steps"], row["topk"], row["num_draft_tokens"])][0]
        assert row["timed_pairs"] == 6 and row["lossless"] is True
        assert [row["speedup_low"], row["speedup"], row["speedup_high"]] == pytest.approx([speedup] * 3)
    rec = data["recommendation"]
    assert (rec["steps"], rec["topk"], rec["num_draft_tokens"], rec["basis"]) == (2, 2, 7, "measured")
    assert data["sglang_flags"] == ("--speculative-algorithm EAGLE3 --speculative-num-steps 2 "
                                    "--speculative-eagle-topk 2 --speculative-num-draft-tokens 7 "
                                    "--attention-backend flashinfer")
    assert data["vllm_num_speculative_tokens"] == 3  # vLLM drafts chains: the faster chain, S = 3
    (tmp_path / "config.json").write_text("{}")  # the card of a drafter directory holding the sweep
    card = str(build_model_card(tmp_path, "org/drafter"))
    assert f"```\n{data['sglang_flags']}\n```" in card and rec["reason"] in card
    assert "vLLM drafts chains: `num_speculative_tokens` 3" in card


def test_an_interrupted_sweep_keeps_what_it_measured(tmp_path, monkeypatch):
    from eagle3_hf.constants import SWEEP_FILE
    from eagle3_hf.evaluation.sweep import run_sweep, sweep_grid

    from tests.helpers.verifiers import ToyTokenizer, plus_one_verifier

    verifier = plus_one_verifier()
    _measured(monkeypatch, stop_at=4)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(verifier, random_drafter(verifier, draft_vocab_size=32, aux=[1, 2, 3]), ToyTokenizer(), ["a"],
                  sweep_grid([2, 3], [1, 2], [4, 7]), max_new_tokens=12, output=tmp_path, progress=False)
    data = json.loads((tmp_path / SWEEP_FILE).read_text())
    assert [(c["steps"], c["topk"], c["num_draft_tokens"]) for c in data["configs"]] == list(SPEEDUP_TAU)[:3]
    rec = data["recommendation"]  # recommended from the three it measured
    assert (rec["num_draft_tokens"], data["vllm_num_speculative_tokens"]) == (7, 2)


def test_evaluate_cli_tree_and_sweep(tmp_path, tiny_verifier_dir, capsys):
    from eagle3_hf.cli import main
    from eagle3_hf.constants import SWEEP_FILE
    from eagle3_hf.verifier.loading import load_verifier

    verifier = load_verifier(str(tiny_verifier_dir))
    drafter_dir = tmp_path / "drafter"
    random_drafter(verifier, draft_vocab_size=300).save_pretrained(drafter_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Hi!"}\n{"id": "q2", "prompt": "Name a color."}\n')
    common = ["evaluate", "--drafter", str(drafter_dir), "--verifier", str(tiny_verifier_dir), "--prompts",
              str(prompts), "--max-new-tokens", "6", "--no-progress", "--device", "cpu"]
    assert main(common + ["--steps", "2", "--topk", "2", "--num-draft-tokens", "5", "--output",
                          str(tmp_path / "t")]) == 0
    summary = json.loads((tmp_path / "t" / "eagle3_evaluation.json").read_text())
    assert (summary["k"], summary["topk"], summary["num_draft_tokens"], summary["lossless"]) == (2, 2, 5, True)
    assert "steps=2, topk=2, N=5" in capsys.readouterr().out
    assert main(common + ["--topk", "2", "--output", str(tmp_path / "x")]) != 0
    assert "--num-draft-tokens is required" in capsys.readouterr().err
    assert main(common + ["--steps", "2", "--topk", "2", "--num-draft-tokens", "9", "--output",
                          str(tmp_path / "x")]) != 0
    assert "must lie in 2..7" in capsys.readouterr().err
    assert main(common + ["--sweep", "--sweep-steps", "2", "--sweep-topk", "1", "2", "--sweep-num-draft-tokens", "4",
                          "--output", str(tmp_path / "s"), "--write-to-drafter"]) == 0
    data = json.loads((drafter_dir / SWEEP_FILE).read_text())
    assert [(c["steps"], c["topk"], c["num_draft_tokens"]) for c in data["configs"]] == [(2, 1, 3), (2, 2, 4)]
    assert data["sglang_flags"] in capsys.readouterr().out
