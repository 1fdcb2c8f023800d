"""Shared fixtures: the real SmolLM2 tokenizer and a tiny verifier saved with it, its fingerprint, the same verifier
with a slow remote-code tokenizer of that vocabulary (Kimi-K2.5's kind), the synthetic verifier with its offline
features, a verifier vLLM serves, and the loopback Hub. Their code lives in tests/helpers/."""

from __future__ import annotations

import os

import pytest
import torch

pytest.register_assert_rewrite("tests.helpers")  # the shared assertions report like a test's own
pytest_plugins = ["tests.helpers.cpu_seconds"]  # per-test CPU seconds with EAGLE3_HF_TEST_CPU_LOG=FILE

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tiny models: one thread avoids oversubscription when the suite shares the machine (measured 5-100x)
torch.set_num_threads(1)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: a venv without it runs serially
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup` (`make test`) by tests/helpers/xdist_groups.py's groups: xdist's scope scheduler, its
    scopes those groups, taken in the workers' order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    from tests.helpers.xdist_groups import group

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    config.option.loadscopereorder = False  # FIRST's order (below), not the largest test count first
    return Groups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the scheduler takes the groups in this order
        from tests.helpers.xdist_groups import FIRST, group

        rank = {name: i for i, name in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(group(item.nodeid), len(FIRST)))


@pytest.fixture(scope="session", autouse=True)
def warm_vllm():
    """One warm vLLM process per worker that the vLLM runners fork from (tests/helpers/vllm.py)."""
    from tests.helpers.vllm import start_warm_vllm, stop_warm_vllm

    started = start_warm_vllm()
    yield
    stop_warm_vllm(started)


@pytest.fixture(scope="session", autouse=True)
def warm_commands():
    """One warm process per worker that our own commands' processes fork from (tests/helpers/warm_commands.py)."""
    from tests.helpers.warm_commands import start_warm_commands, stop_warm_commands

    started = start_warm_commands()
    yield
    stop_warm_commands(started)


@pytest.fixture(scope="session")
def default_verifier_dir():
    """The embedded default verifier, converted from its GGUF once and cached (about 35 s the first time)."""
    from eagle3_hf.verifier.loading import default_verifier_dir

    return default_verifier_dir()


@pytest.fixture(scope="session")
def tokenizer(default_verifier_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_verifier_dir)


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory, tokenizer):
    """A saved tiny verifier + the SmolLM2 tokenizer, loadable by path like any Hub model."""
    from tests.helpers.verifiers import make_tiny_verifier

    path = tmp_path_factory.mktemp("tiny_verifier")
    make_tiny_verifier().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def slow_remote_tokenizer_dir(tmp_path_factory, tiny_verifier_dir):
    """`tiny_verifier_dir` with its tokenizer replaced by a slow one shipped as remote code (auto_map, a
    PythonBackend without offsets, no tokenizer.json: tests/helpers/slow_tokenizer.py), of the same vocabulary:
    loads only with --trust-remote-code, and must give the fast tokenizer's ids and loss masks."""
    import shutil

    from tests.helpers.slow_tokenizer import install_slow_tokenizer

    path = tmp_path_factory.mktemp("slow_remote_tokenizer") / "verifier"
    shutil.copytree(tiny_verifier_dir, path)
    return install_slow_tokenizer(tiny_verifier_dir, path)


@pytest.fixture(scope="session")
def slow_tokenizer(slow_remote_tokenizer_dir):
    """The slow remote-code tokenizer of `slow_remote_tokenizer_dir`, loaded (trusted)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(slow_remote_tokenizer_dir, trust_remote_code=True)


@pytest.fixture(scope="module")
def serveable_model():
    """A tiny verifier vLLM's CPU build serves (tests/helpers/serveable.py), per module."""
    from tests.helpers.serveable import serveable_verifier

    return serveable_verifier()


@pytest.fixture(scope="module")
def serveable_dir(tmp_path_factory, serveable_model, tokenizer):
    """`serveable_model` saved with the SmolLM2 tokenizer: what the vLLM-side stubs and servers load by path."""
    path = tmp_path_factory.mktemp("serveable")
    serveable_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A loopback Hub-API server (tests/helpers/hub_server.py) per test module, stopped by pid afterwards."""
    from tests.helpers.hub_server import TEST_ORGS, TEST_TOKENS, HubServer

    server = HubServer(tmp_path_factory.mktemp("hub"), orgs=TEST_ORGS, tokens=TEST_TOKENS).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fingerprint(tokenizer):
    """The SmolLM2 tokenizer's fingerprint, as prepared datasets and features record it."""
    from eagle3_hf.data.fingerprint import tokenizer_fingerprint

    return tokenizer_fingerprint(tokenizer)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """The learnable synthetic verifier and 48 samples of offline features for it (tests/helpers/data.py), per
    module: {"root", "verifier", "verifier_dir", "features"}."""
    from tests.helpers.data import synthetic_data

    return synthetic_data(tmp_path_factory.mktemp("synthetic"), num_samples=48)
