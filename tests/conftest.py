"""Shared fixtures: the real SmolLM2 tokenizer and tiny random Llama verifiers built around it."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tiny models: one thread avoids oversubscription when the suite shares the machine (measured 5-100x)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def default_verifier_dir():
    """The embedded default verifier, converted from its GGUF once and cached (about 35 s the first time)."""
    from eagle3_hf.verifier.loading import default_verifier_dir

    return default_verifier_dir()


@pytest.fixture(scope="session")
def tokenizer(default_verifier_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_verifier_dir)


def make_tiny_verifier(vocab_size: int = 49152, hidden_size: int = 64, num_layers: int = 6, seed: int = 0):
    """A random Llama with the SmolLM2 vocabulary: real tokenizer, tiny compute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory, tokenizer):
    """A saved tiny verifier + the SmolLM2 tokenizer, loadable by path like any Hub model."""
    path = tmp_path_factory.mktemp("tiny_verifier")
    make_tiny_verifier().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A loopback Hub-API server (tests/hub_server.py) per test module, stopped by pid afterwards."""
    from hub_server import TEST_ORGS, TEST_TOKENS, HubServer

    server = HubServer(tmp_path_factory.mktemp("hub"), orgs=TEST_ORGS, tokens=TEST_TOKENS).start()
    yield server
    server.stop()
