"""Block speculative decoding with a DFlash drafter: token-identical to plain greedy, τ counted as the chain counts
it, and the drafter's context at every cycle is the verifier's features of exactly the accepted tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3_hf.decoding import acceptance_stats, greedy_generate, speculative_decode
from eagle3_hf.model.configuration_dflash import DFlashConfig
from eagle3_hf.model.modeling_dflash import DFlashContext, DFlashDraftModel
from eagle3_hf.verifier.capture import aux_from, capture_layer_outputs

from tests.helpers.verifiers import lively_verifier

PROMPT = [1, 504, 2389, 17, 905, 33, 4012, 7]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def verifier():
    return lively_verifier()


def random_dflash(verifier, block_size: int = 5, seed: int = 0) -> DFlashDraftModel:
    config = DFlashConfig.from_verifier(verifier.config, mask_token_id=verifier.config.vocab_size - 1,
                                        num_hidden_layers=2, block_size=block_size)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(config).eval()
    drafter.load_verifier_embeddings(verifier)
    return drafter


class OracleBlockDrafter:
    """Drafts the verifier's own greedy continuation except at fixed random positions: accepted runs of every
    length 0..k, so every crop and every context extension is exercised, and the expected τ is known."""

    drafter_kind = "dflash"

    def __init__(self, reference: list[int], prompt_length: int, block_size: int, hit_rate: float = 0.6):
        self.reference, self.prompt_length = reference, prompt_length
        self.config = SimpleNamespace(block_size=block_size, max_drafts=block_size - 1,
                                      aux_hidden_state_indices=[1, 2, 3])
        self.wrong = (torch.rand(prompt_length + len(reference) + 64, generator=torch.Generator().manual_seed(0))
                      > hit_rate).tolist()

    def extend_context(self, context, aux, positions):
        context = context if context is not None else SimpleNamespace(length=0)
        assert int(positions[0, 0]) == context.length and positions.shape[1] == aux.shape[1]
        context.length += aux.shape[1]
        return context

    def draft_block(self, anchor_id, context, num_drafts):
        vocab = 49152
        logits = torch.full((num_drafts, vocab), -1e4)
        for j in range(1, num_drafts + 1):  # block position j predicts the token at position context.length + j
            at = context.length + j
            index = at - self.prompt_length
            token = self.reference[index] if index < len(self.reference) else 0
            logits[j - 1, (token + 1) % vocab if self.wrong[at] else token] = 0.0
        return logits

    def expected(self, k: int, max_new_tokens: int) -> tuple[list[int], list[int]]:
        """(accepted, drafted) per verify forward, simulated from the wrong positions alone."""
        n, produced, accepted_per_step, drafted = self.prompt_length, 1, [], []
        while produced < max_new_tokens:
            depth = min(k, max_new_tokens - produced - 1)
            accepted = 0
            while accepted < depth and not self.wrong[n + 1 + accepted]:
                accepted += 1
            accepted_per_step.append(accepted)
            drafted.append(depth)
            produced += accepted + 1
            n += accepted + 1
        return accepted_per_step, drafted


def test_oracle_blocks_are_lossless_and_tau_is_counted_exactly(verifier):
    reference = greedy_generate(verifier, PROMPT, 40, eos_token_id=[]).tokens
    drafter = OracleBlockDrafter(reference, len(PROMPT), block_size=5)
    out = speculative_decode(verifier, drafter, PROMPT, steps=4, max_new_tokens=40, eos_token_id=[])
    assert out.tokens == reference
    expected, drafted = drafter.expected(4, 40)
    assert out.accepted_per_step == expected and len(set(expected)) >= 4  # runs of several lengths
    assert out.drafted_per_step == drafted and drafted[0] == 4
    assert out.acceptance_length == pytest.approx((sum(expected) + len(expected)) / len(expected))
    assert acceptance_stats(out.accepted_per_step, out.drafted_per_step, 4)["acceptance_length"] == \
        out.acceptance_length


def test_random_drafter_is_token_identical_to_greedy_and_its_context_is_the_accepted_tokens(verifier):
    """A real DFlash drafter (random): the output equals plain greedy; at every block the drafter's context keys
    equal those computed afresh from one verifier forward over the tokens accepted so far."""
    drafter = random_dflash(verifier)
    seen: list[tuple[int, torch.Tensor]] = []
    real = drafter.draft_block

    def spy(anchor_id: int, context: DFlashContext, num_drafts: int | None = None) -> torch.Tensor:
        seen.append((context.length, context.keys[-1].clone()))
        return real(anchor_id, context, num_drafts)

    drafter.draft_block = spy  # type: ignore[method-assign]
    reference = greedy_generate(verifier, PROMPT, 30, eos_token_id=[]).tokens
    out = speculative_decode(verifier, drafter, PROMPT, steps=3, max_new_tokens=30, eos_token_id=[])
    assert out.tokens == reference
    assert len(seen) == len(out.accepted_per_step) and max(out.accepted_per_step) <= 3

    sequence = torch.tensor([PROMPT + out.tokens])
    aux_indices = drafter.config.aux_hidden_state_indices
    with torch.no_grad(), capture_layer_outputs(verifier, aux_indices) as captured:
        verifier(input_ids=sequence)
    aux = aux_from(captured, aux_indices)
    fresh = drafter.extend_context(None, aux, torch.arange(sequence.shape[1])[None])
    for length, keys in seen:
        torch.testing.assert_close(keys, fresh.keys[-1][:, :, :length], atol=1e-4, rtol=1e-4)
    # lengths: the prompt, then each cycle's accepted drafts + the anchor
    assert [length for length, _ in seen] == [len(PROMPT) + sum(a + 1 for a in out.accepted_per_step[:i])
                                              for i in range(len(seen))]


def test_drafts_per_block_are_bounded_by_the_block(verifier):
    drafter = random_dflash(verifier, block_size=4)
    with pytest.raises(ValueError, match="drafts 1..3"):
        speculative_decode(verifier, drafter, PROMPT, steps=4, max_new_tokens=8)
    with pytest.raises(ValueError, match="not a tree"):
        speculative_decode(verifier, drafter, PROMPT, steps=3, topk=2, max_new_tokens=8)


def test_evaluate_cli_serves_a_dflash_drafter_by_its_architectures(tmp_path, tiny_verifier_dir):
    """`eagle3-hf evaluate --drafter DIR` on a saved DFlash drafter: picked by config.json, the verifier's
    embedding and lm_head filled in, lossless, τ within 1 + k."""
    import json

    from eagle3_hf.cli import main
    from eagle3_hf.verifier.loading import load_verifier

    verifier = load_verifier(str(tiny_verifier_dir))
    drafter_dir = tmp_path / "drafter"
    random_dflash(verifier, block_size=4).save_pretrained(drafter_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "Name a color."}\n')
    out = tmp_path / "eval"
    code = main(["evaluate", "--drafter", str(drafter_dir), "--verifier", str(tiny_verifier_dir), "--prompts",
                 str(prompts), "--k", "3", "--max-new-tokens", "8", "--output", str(out), "--no-progress",
                 "--device", "cpu"])
    assert code == 0
    summary = json.loads((out / "eagle3_evaluation.json").read_text())
    assert summary["lossless"] is True and summary["k"] == 3 and 1.0 <= summary["acceptance_length"] <= 4.0
    assert len(summary["per_position_acceptance"]) == 3
