"""vLLM's OpenAI server serving a verifier with an EAGLE-3 drafter, as a user serves one (`--speculative-config`
method eagle3), on vLLM's CPU build; and the validation accuracies a drafter records at training, measured the way
the trainer measures them, for drafters trained by a test's own loop (tests/helpers/served_pair.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch

from eagle3_hf.constants import TRAINING_FILE
from eagle3_hf.engines.server_process import ServerProcess
from eagle3_hf.engines.vllm.vllm_args import server_flags
from eagle3_hf.engines.vllm.vllm_env import VllmError, vllm_environment, vllm_python, vllm_venv
from eagle3_hf.engines.vllm.vllm_openai import API_SERVER, server_models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SpeculativeServer(ServerProcess):
    """`python -m vllm.entrypoints.openai.api_server --model VERIFIER --speculative-config {eagle3, DRAFTER, k}` on
    the CPU (fp32, eager), in its own process group; ready when /v1/models answers."""

    def __init__(self, verifier: Path, drafter: Path, log: Path, k: int = 3, timeout: float = 600.0):
        super().__init__(timeout)
        self.verifier, self.drafter, self.k, self.port = verifier, drafter, k, free_port()
        self._log_path = log
        self.url = f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        speculative = {"method": "eagle3", "model": str(self.drafter), "num_speculative_tokens": self.k}
        argv = [str(vllm_python()), "-m", API_SERVER, "--model", str(self.verifier), "--dtype", "float32",
                "--max-model-len", "1024", "--seed", "0", *server_flags({}, cpu=True), "--host", "127.0.0.1",
                "--port", str(self.port), "--speculative-config", json.dumps(speculative)]
        env = vllm_environment(vllm_venv(), threads=1, offline=True)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server runs its engine core in its own process
        self._launch(argv, env, warm=True)

    def _ready(self) -> bool:
        try:
            return bool(server_models(self.url, timeout=2.0))
        except (OSError, ValueError):
            return False

    def _exit_error(self, status: int) -> VllmError:
        return VllmError(f"vLLM serving {self.drafter} exited: {self._last_line(self._log_text(), status)}")

    def _timeout_error(self) -> VllmError:
        return VllmError(f"vLLM serving {self.drafter} did not answer within {self.timeout:.0f} s")


@torch.no_grad()
def chat_samples(verifier, tokenizer, prompts: list[str], answer_tokens: int = 48) -> list[tuple[torch.Tensor, int]]:
    """(token ids, prompt length) per prompt: the prompt rendered with the chat template as a server renders it, then
    the verifier's greedy answer: the regenerated samples a drafter trains on, shaped like what a server is asked."""
    from eagle3_hf.evaluation.evaluate import render_prompt

    samples = []
    for prompt in prompts:
        ids = torch.tensor(render_prompt(tokenizer, [{"role": "user", "content": prompt}]))
        answer = verifier.generate(ids[None], max_new_tokens=answer_tokens, min_new_tokens=answer_tokens,
                                   do_sample=False)
        samples.append((answer[0], len(ids)))
    return samples


def train_on_samples(verifier, samples: list[tuple[torch.Tensor, int]], draft_vocab_size: int = 4096,
                     steps: int = 120, ttt_steps: int = 3, seed: int = 0):
    """Adam steps of the TTT objective on the answers of `samples` (loss where the verifier's greedy token is in the
    draft vocabulary, the first `draft_vocab_size` ids), one sample per step."""
    from tests.helpers.drafters import random_drafter

    drafter = random_drafter(verifier, draft_vocab_size=draft_vocab_size, seed=seed).train()
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    aux = drafter.config.aux_hidden_state_indices
    for step in range(steps):
        ids, prompt_len = samples[step % len(samples)]
        with torch.no_grad():
            out = verifier(ids[None], output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in aux], dim=-1)
        greedy = out.logits.argmax(-1)
        answer = torch.arange(len(ids))[None] >= prompt_len - 1
        result = drafter(ids[None], features, ttt_steps=ttt_steps)
        loss = torch.zeros(())
        for i, (logits, valid) in enumerate(zip(result.logits, result.step_valid)):
            target = torch.roll(greedy, -(1 + i), 1)
            keep = valid & torch.roll(answer, -(1 + i), 1) & (target < draft_vocab_size)
            if keep.any():
                loss = loss + 0.8**i * torch.nn.functional.cross_entropy(logits[keep], target[keep])
        if not loss.requires_grad:  # an answer wholly outside the draft vocabulary: nothing to learn
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@torch.no_grad()
def record_validation(drafter, verifier, out: Path, samples: list[tuple[torch.Tensor, int]], steps: int = 3) -> dict:
    """The trainer's validation metrics (train/metrics.py, the same StepStats) of `drafter` on held-out `samples`
    (loss on the answers), written into `out`/eagle3_training.json as training_summary writes them."""
    from eagle3_hf.train.metrics import drafter_step_accuracies

    aux = drafter.config.aux_hidden_state_indices
    rows = []
    for ids, prompt_len in samples:
        states = verifier(ids[None], output_hidden_states=True)
        rows.append({"input_ids": ids, "aux_hidden_states": torch.cat([states.hidden_states[i][0] for i in aux], -1),
                     "last_hidden_state": states.hidden_states[-1][0], "verifier_greedy": states.logits[0].argmax(-1),
                     "loss_mask": torch.arange(len(ids)) >= prompt_len})

    class Rows:
        lengths = [len(r["input_ids"]) for r in rows]

        def __getitem__(self, i: int) -> dict:
            return rows[i]

        def __len__(self) -> int:
            return len(rows)

    metrics = drafter_step_accuracies(drafter, Rows(), max_seq_len=max(Rows.lengths), batch_size=4, ttt_steps=steps)
    summary = {"metrics": {"step_accuracy": [metrics[f"acc_{i}"] for i in range(steps)],
                           "step_conditional_accuracy": [metrics[f"cond_acc_{i}"] for i in range(steps)],
                           "simulated_acceptance_length": metrics["simulated_acceptance_length"]}}
    (Path(out) / TRAINING_FILE).write_text(json.dumps(summary, indent=2))
    return summary


def layered_chain_verifier(vocab_size: int = 49152, hidden: int = 128, layers: int = 6,
                           gains: tuple[float, ...] = (0, -2, 0, -2, -2, -2), seed: int = 0):
    """A tiny Llama (vLLM's CPU build serves it: head_dim 64) whose greedy next token is token + 1 (lm_head = the
    embedding rolled by one) and whose layers tell apart. Layer l attends to its own position only (q = k = 2 x the
    normed input: the self score dwarfs the others), passes it on unchanged (v = identity) and adds gains[l] times
    it (o = gains[l] x identity; MLPs silenced): the residual stream h becomes h (1 + gains[l] / rms(h)), so a gain
    of -2 flips its sign (the embedding's rms is about 1) and 0 leaves it. The default flips after layers 1, 3, 4
    and 5: the states entering layers 2, 4, 5 (a drafter's default aux ids for 6 layers) are -e, e, -e (e the token's
    embedding), those entering 1, 3, 4 are e, -e, e, exactly their negation, and the final state is e again, so the
    greedy token stays token + 1. A drafter trained on the first and served the second (its ids one layer early, as
    vLLM reads SGLang-form ids) reads its features negated: what capturing the wrong layers does to a real model,
    whose layers differ as much. chain_verifier's damped layers all hold about e: a shifted capture there serves the
    same acceptance (measured in vLLM: 35 / 11 / 0 of 82 drafts accepted either way)."""
    from tests.helpers.served_pair import next_token_llama

    model = next_token_llama(vocab_size, hidden, layers, seed)
    eye = torch.eye(hidden)
    with torch.no_grad():
        for layer, gain in zip(model.model.layers, gains):
            attn = layer.self_attn
            attn.q_proj.weight.copy_(2 * eye)
            attn.k_proj.weight.copy_(2 * eye)
            attn.v_proj.weight.copy_(eye)
            attn.o_proj.weight.copy_(gain * eye)
            layer.mlp.down_proj.weight.zero_()
    return model
