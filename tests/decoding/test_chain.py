"""Speculative decoding: lossless against plain greedy, tau for trained and random drafters, exactness of
speculative sampling, the `evaluate` metric, and `eagle3-hf evaluate`."""

from __future__ import annotations

import csv
import json
import math
from types import SimpleNamespace

import pytest
import torch

from eagle3_hf import Eagle3DraftModel
from eagle3_hf.decoding import acceptance_stats, compare_to_greedy, greedy_generate, speculative_decode
from eagle3_hf.decoding.chain import verify_sampled
from eagle3_hf.decoding.core import sample
from eagle3_hf.decoding.stats import acceptance_metric_path
from eagle3_hf.evaluation.evaluate import evaluate_drafter, load_prompts

from tests.helpers.assertions import assert_matches_greedy, chi_square_p_value
from tests.helpers.drafters import random_drafter
from tests.helpers.verifiers import ToyTokenizer, lively_verifier, plus_one_verifier


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models decode token by token: one thread is faster than two fighting over a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------- models built for the tests


class OracleDrafter:
    """Proposes the verifier's own greedy continuation, except at a fixed random subset of positions where it
    proposes another token: accepted chains of every length 0..k, so every cache crop gets exercised."""

    def __init__(self, reference: list[int], vocab_size: int, hit_rate: float = 0.7, seed: int = 0):
        self.reference, self.vocab_size = reference, vocab_size
        self.config = SimpleNamespace(aux_hidden_state_indices=[1, 2, 3], draft_vocab_size=vocab_size,
                                      vocab_size=vocab_size)
        self.wrong = torch.rand(len(reference) + 64, generator=torch.Generator().manual_seed(seed)) > hit_rate

    def draft_to_target(self, ids):
        return ids

    def draft_step(self, input_ids, hidden_states, position_ids, past_key_values=None):
        q = input_ids.shape[1]
        logits = torch.full((1, q, self.vocab_size), -1e4)
        for j, t in enumerate((position_ids[0] + 2).tolist()):  # position t predicts token t + 2
            token = self.reference[t] if t < len(self.reference) else 0
            logits[0, j, (token + 1) % self.vocab_size if self.wrong[t] else token] = 0.0
        return logits, torch.zeros(1, q, 8), (past_key_values or 0) + q


def train_drafter(verifier, steps: int = 80, ttt_steps: int = 3, seed: int = 0) -> Eagle3DraftModel:
    """A few Adam steps of the TTT objective on the verifier's own greedy continuations of random prompts."""
    vocab = verifier.config.vocab_size
    drafter = random_drafter(verifier, draft_vocab_size=vocab, seed=seed)
    drafter.train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    aux_idx = drafter.config.aux_hidden_state_indices
    for _ in range(steps):
        ids = torch.randint(0, vocab, (8, 16), generator=g)
        ids[:, 4:] = (ids[:, 3:4] + torch.arange(1, 13)) % vocab  # random prompt, then the greedy answer
        with torch.no_grad():
            out = verifier(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in aux_idx], dim=-1)
        greedy = out.logits.argmax(-1)  # [B, L]: the verifier's token for position t + 1
        result = drafter(ids, aux, ttt_steps=ttt_steps)
        loss = 0.0
        for i, (logits, valid) in enumerate(zip(result.logits, result.step_valid)):
            target = torch.roll(greedy, -(1 + i), dims=1)  # step i at t predicts token t + 2 + i
            loss = loss + 0.8**i * torch.nn.functional.cross_entropy(logits[valid], target[valid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


# ---------------------------------------------------------------- lossless (greedy)


def assert_lossless(verifier, drafter, prompt, k, max_new_tokens):
    spec = speculative_decode(verifier, drafter, prompt, steps=k, max_new_tokens=max_new_tokens)
    return assert_matches_greedy(verifier, prompt, max_new_tokens, spec)


def test_lossless_on_tiny_verifier_with_every_acceptance_length():
    verifier = lively_verifier()
    prompt = list(range(1000, 1012))
    reference = greedy_generate(verifier, prompt, 40).tokens
    assert len(set(reference)) > 20  # the verifier's output really depends on its context
    oracle = OracleDrafter(prompt + reference, verifier.config.vocab_size, hit_rate=0.7)
    spec = assert_lossless(verifier, oracle, prompt, k=3, max_new_tokens=40)
    assert set(spec.accepted_per_step) == {0, 1, 2, 3}
    assert spec.num_verifier_forwards < 30
    assert_lossless(verifier, random_drafter(verifier), prompt, k=4, max_new_tokens=12)


def test_lossless_on_default_verifier(default_verifier_dir, tokenizer):
    from eagle3_hf.demo_data.prompts import mtbench_questions
    from eagle3_hf.evaluation.evaluate import render_prompt
    from eagle3_hf.verifier.loading import load_verifier

    verifier = load_verifier(str(default_verifier_dir))
    question = mtbench_questions()[0]["turns"][0]
    prompt = render_prompt(tokenizer, [{"role": "user", "content": question}])
    reference = greedy_generate(verifier, prompt, 20).tokens
    oracle = OracleDrafter(prompt + reference, verifier.config.vocab_size, hit_rate=0.6, seed=1)
    spec = assert_lossless(verifier, oracle, prompt, k=3, max_new_tokens=20)
    assert max(spec.accepted_per_step) >= 2 and min(spec.accepted_per_step) < 3


def test_mismatch_and_tie_are_told_apart():
    assert compare_to_greedy([5, 6, 7], [1.0, 1.0, 1.0], [5, 6, 7], [1.0, 1.0, 1.0]) == ("match", None)
    assert compare_to_greedy([5, 9, 7], [1.0, 1.0, 1.0], [5, 6, 8], [1.0, 0.5, 1.0]) == ("mismatch", 1)
    assert compare_to_greedy([5, 9, 7], [1.0, 1.0, 1.0], [5, 6, 8], [1.0, 5e-5, 1.0]) == ("tie", 1)
    assert compare_to_greedy([5, 6], [1.0, 1.0], [5, 6, 7], [1.0, 1.0, 1.0]) == ("mismatch", 2)


def test_drafts_equal_the_training_unroll():
    """Every draft of every round equals the argmax of the training-time unroll (Eagle3DraftModel.forward) at
    that round's anchor, run over [accepted sequence, drafts]: the decoding caches hold the verifier's features
    of accepted tokens, paired and positioned (RoPE t + i) exactly as in training."""
    verifier = lively_verifier()
    drafter = random_drafter(verifier, scale=4.0)
    with torch.no_grad():  # sharp attention, so a draft's RoPE position and cache contents change its argmax
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(drafter.midlayer.self_attn, name).weight.mul_(10.0 if name[0] in "qk" else 3.0)
    prompt = list(range(2000, 2010))
    spec = speculative_decode(verifier, drafter, prompt, steps=3, max_new_tokens=16)
    sequence = prompt + spec.tokens
    newest = len(prompt)  # index of the newest token at the start of a round; the anchor sits before it
    seen = set()
    for accepted, drafts in zip(spec.accepted_per_step, spec.draft_tokens):
        if drafts:  # the last round near max_new_tokens may draft nothing
            ids = torch.tensor([sequence[: newest + 1] + drafts[:-1]])
            with torch.no_grad():
                hidden = verifier(ids, output_hidden_states=True).hidden_states
                aux = torch.cat([hidden[i] for i in drafter.config.aux_hidden_state_indices], dim=-1)
                unroll = drafter(ids, aux, ttt_steps=len(drafts)).logits  # step i at t predicts t + 2 + i
            expected = [int(drafter.draft_to_target(step[0, newest - 1].argmax())) for step in unroll]
            assert drafts == expected
            seen.update(drafts)
        newest += accepted + 1
    assert len(seen) > 6  # the drafts depend on their inputs, so a misalignment would show


# ---------------------------------------------------------------- acceptance length


def test_tau_near_k_plus_one_for_trained_drafter_and_near_one_for_random():
    verifier = plus_one_verifier()
    k, max_new = 3, 1 + 4 * 6  # six full rounds after the prefill token
    prompts = [torch.randint(0, 32, (5,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    trained = train_drafter(verifier)
    random = random_drafter(verifier, draft_vocab_size=32, seed=3)
    for drafter, low, high in ((trained, k + 1 - 0.3, k + 1), (random, 1.0, 1.3)):
        accepted = []
        for prompt in prompts:
            spec = assert_lossless(verifier, drafter, prompt, k=k, max_new_tokens=max_new)
            accepted += spec.accepted_per_step
        tau = acceptance_stats(accepted, [k] * len(accepted), k)["acceptance_length"]
        assert low <= tau <= high, tau


# ---------------------------------------------------------------- speculative sampling is exact


def test_accept_reject_core_is_exact():
    """verify_sampled with drafts from q: first token ~ p[0]; after an accepted draft, second ~ p[1]. A
    variant resampling from p instead of norm(max(0, p - q)) is rejected by the same test."""
    g = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(2 * torch.randn(3, vocab, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2 * torch.randn(2, vocab, generator=g, dtype=torch.float64), -1)
    q[:, 5] = 0  # outside the draft vocabulary
    q = q / q.sum(-1, keepdim=True)

    def run(n, fn):
        first, second = torch.zeros(vocab), torch.zeros(vocab)
        for _ in range(n):
            drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
            accepted, token = fn(p, q, drafts, g)
            out = drafts[:accepted] + [token]
            first[out[0]] += 1
            if len(out) > 1:
                second[out[1]] += 1
        return chi_square_p_value(first, p[0]), chi_square_p_value(second, p[1])

    assert min(run(6000, verify_sampled)) > 1e-3

    def biased(p, q, drafts, generator):  # the classic bug: on rejection, resample from p
        for i, x in enumerate(drafts):
            if float(torch.rand((), dtype=torch.float64, generator=generator)) < min(1.0, float(p[i, x] / q[i, x])):
                continue
            return i, sample(p[i], generator)
        return len(drafts), sample(p[len(drafts)], generator)

    assert run(6000, biased)[0] < 1e-6


@pytest.mark.slow
def test_speculative_sampling_matches_the_verifier_distribution():
    """The first three generated tokens over many seeds follow the verifier's own sampling distribution,
    computed exactly; the drafter's vocabulary leaves two tokens out (q = 0 there) and q differs from p."""
    vocab, temperature = 6, 0.8
    verifier = lively_verifier(vocab_size=vocab, hidden_size=32, num_layers=4, seed=4)  # p spread, not peaked
    drafter = random_drafter(verifier, draft_vocab_size=4, kept=torch.tensor([0, 2, 3, 5]), aux=[1, 2, 3],
                             scale=20.0, seed=1)
    prompt = [1, 4, 0]
    with torch.no_grad():
        grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)  # [V^3, 3]
        seqs = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], dim=1)
        logp = torch.log_softmax(verifier(seqs).logits.double() / temperature, -1)  # [V^3, P+3, V]
    n = len(prompt)
    exact = (logp[:, n - 1].gather(1, grid[:, :1]) + logp[:, n].gather(1, grid[:, 1:2])
             + logp[:, n + 1].gather(1, grid[:, 2:3])).exp().squeeze(1)  # [V^3]
    counts = torch.zeros(vocab**3)
    accepted = 0
    for seed in range(600):  # max_new_tokens 4: the first round after the prefill drafts a chain of two
        out = speculative_decode(verifier, drafter, prompt, steps=2, max_new_tokens=4, temperature=temperature,
                                 generator=torch.Generator().manual_seed(seed), eos_token_id=[])
        a, b, c = out.tokens[:3]
        counts[a * vocab * vocab + b * vocab + c] += 1
        accepted += sum(out.accepted_per_step)
    assert accepted > 150  # drafts are often accepted, so the accept path is tested, not only resampling
    assert chi_square_p_value(counts, exact) > 1e-3


# ---------------------------------------------------------------- the metric module and the CLI


def test_acceptance_metric_loads_offline_and_matches(monkeypatch):
    import evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    metric = evaluate.load(acceptance_metric_path())
    hand = metric.compute(accepted=[3, 1, 0, 2], drafted=[3, 3, 3, 2])
    assert hand["acceptance_length"] == 2.5 and hand["accepted_histogram"] == [1, 1, 1, 1]
    assert hand["per_position_acceptance"] == [0.75, 0.5, pytest.approx(1 / 3)]

    verifier = plus_one_verifier()
    drafter = train_drafter(verifier, steps=25)  # half-trained: acceptance lengths of every size
    prompts = [{"id": "a", "turns": ["Hello there", "And then?"]}, "What is 2 + 2?"]
    summary = evaluate_drafter(verifier, drafter, ToyTokenizer(), prompts, k=3, max_new_tokens=30, turns=2,
                               progress=False)
    assert summary["num_samples"] == 3 and sum(1 for n in summary["accepted_histogram"] if n) >= 3
    accepted = [a for r in summary["per_prompt"] for a in r["accepted_per_step"]]
    drafted = [d for r in summary["per_prompt"] for d in r["drafted_per_step"]]
    result = metric.compute(accepted=accepted, drafted=drafted, k=3)
    assert result["acceptance_length"] == pytest.approx(summary["acceptance_length"])
    assert result["per_position_acceptance"] == pytest.approx(summary["per_position_acceptance"])
    assert result["accepted_histogram"] == summary["accepted_histogram"]
    assert summary["lossless"] is True and summary["mismatches"] == 0


def test_evaluation_renders_prompts_in_the_drafters_thinking_mode():
    """A drafter trained with thinking off is measured on prompts rendered with thinking off, as its serve lines serve
    it: the recorded chat-template kwargs reach every prompt's rendering."""

    class ModeTokenizer(ToyTokenizer):
        seen: list[dict] = []

        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
            self.seen.append(kwargs)
            return super().apply_chat_template(messages, add_generation_prompt, tokenize)

    verifier = plus_one_verifier()
    drafter = random_drafter(verifier, draft_vocab_size=32)
    drafter.config.verifier_chat_template_kwargs = {"thinking": False}
    tok = ModeTokenizer()
    evaluate_drafter(verifier, drafter, tok, ["What is 2 + 2?"], k=2, max_new_tokens=4, progress=False)
    assert tok.seen and all(kw == {"thinking": False} for kw in tok.seen)


def test_load_prompts(tmp_path):
    questions, name = load_prompts("mt-bench")
    assert name == "mt-bench" and len(questions) == 80 and len(questions[0]["turns"]) == 2
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "turns": ["x", "y"]}\n{"messages": [{"role": "user", "content": "z"}]}\n'
                    '{"prompt": "w"}\n\n{"text": "v"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:5"):
        load_prompts(str(path))
    rows, _ = load_prompts(str(path), limit=3)
    assert [r["turns"] for r in rows] == [["x", "y"], ["z"], ["w"]]


def test_evaluate_cli_writes_csv_and_summary(tmp_path, tiny_verifier_dir, monkeypatch):
    from eagle3_hf.cli import main
    from eagle3_hf.verifier.loading import load_verifier

    verifier = load_verifier(str(tiny_verifier_dir))
    drafter_dir = tmp_path / "drafter"
    random_drafter(verifier, draft_vocab_size=300).save_pretrained(drafter_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "turns": ["Hi!", "And then?"]}\n{"id": "q2", "prompt": "Name a color."}\n')
    out = tmp_path / "eval"
    code = main(["evaluate", "--drafter", str(drafter_dir), "--verifier", str(tiny_verifier_dir), "--prompts",
                 str(prompts), "--turns", "2", "--k", "2", "--max-new-tokens", "6", "--output", str(out),
                 "--write-to-drafter", "--no-progress", "--device", "cpu"])
    assert code == 0
    with open(out / "acceptance.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["id"], r["turn"]) for r in rows] == [("q1", "1"), ("q1", "2"), ("q2", "1")]
    assert set(rows[0]) >= {"new_tokens", "verifier_forwards", "tau", "accept_pos1", "accept_pos2", "lossless"}
    assert all(r["lossless"] in ("match", "tie") for r in rows)
    summary = json.loads((out / "eagle3_evaluation.json").read_text())
    assert summary["engine"] == "transformers" and summary["k"] == 2 and summary["temperature"] == 0.0
    assert summary["lossless"] is True and summary["num_prompts"] == 2 and summary["num_samples"] == 3
    assert 1.0 <= summary["acceptance_length"] <= 3.0 and len(summary["per_position_acceptance"]) == 2
    assert summary["speedup"] > 0 and not math.isnan(summary["speedup"])
    assert json.loads((drafter_dir / "eagle3_evaluation.json").read_text()) == summary

    # a decoder that changes one token is caught: non-zero exit, lossless false in the summary
    import eagle3_hf.evaluation.evaluate as evaluate_module

    real = evaluate_module.speculative_decode

    def corrupted(*args, **kwargs):
        out = real(*args, **kwargs)
        out.tokens[1] = (out.tokens[1] + 1) % 49152
        return out

    monkeypatch.setattr(evaluate_module, "speculative_decode", corrupted)
    code = main(["evaluate", "--drafter", str(drafter_dir), "--verifier", str(tiny_verifier_dir), "--prompts",
                 str(prompts), "--k", "2", "--max-new-tokens", "4", "--output", str(tmp_path / "bad"), "--no-progress"])
    bad = json.loads((tmp_path / "bad" / "eagle3_evaluation.json").read_text())
    assert code == 1 and bad["lossless"] is False and bad["mismatches"] == 2
