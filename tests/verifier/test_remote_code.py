"""--trust-remote-code: off by default; a verifier whose tokenizer ships its own code fails in one line naming the
flag, and loads with it; code that imports a package not installed fails in one line naming the package."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from eagle3_hf import cli
from eagle3_hf.verifier import remote_code

TOKENIZER_CODE = '''from transformers import PreTrainedTokenizerFast


class XTokenizerFast(PreTrainedTokenizerFast):
    """A fast tokenizer of the checkpoint's own (what auto_map points at)."""
'''


@pytest.fixture
def custom_tokenizer_dir(tmp_path, tiny_verifier_dir):
    path = tmp_path / "custom"
    shutil.copytree(tiny_verifier_dir, path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="XTokenizerFast", auto_map={"AutoTokenizer": [None, "tokenization_x.XTokenizerFast"]})
    config_file.write_text(json.dumps(config))
    (path / "tokenization_x.py").write_text(TOKENIZER_CODE)
    yield path
    remote_code.set_trusted(False)


def test_untrusted_code_is_one_line_naming_the_flag(custom_tokenizer_dir, tmp_path, capsys):
    src = tmp_path / "convs.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    argv = ["prepare", "--tokenizer", str(custom_tokenizer_dir), "--input", str(src), "--output", str(tmp_path / "p")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {custom_tokenizer_dir}: its tokenizer needs the Python code it ships (auto_map); pass "
                   "--trust-remote-code if you trust it")
    assert not remote_code.trusted()
    assert cli.main(argv + ["--trust-remote-code"]) == 0
    assert (tmp_path / "p").is_dir()


def test_trusted_loads_the_checkpoints_class(custom_tokenizer_dir):
    from eagle3_hf.verifier.loading import load_tokenizer

    remote_code.set_trusted(True)
    assert type(load_tokenizer(str(custom_tokenizer_dir))).__name__ == "XTokenizerFast"


def test_every_verifier_command_takes_the_flag():
    from eagle3_hf.train.arguments import ModelArguments

    for name in cli.OPENS_VERIFIER:
        flag = [a for a in cli.command_parser(name)._actions if "--trust-remote-code" in a.option_strings]
        assert len(flag) == 1 and flag[0].default is False, name  # once, off by default
    assert ModelArguments().trust_remote_code is False


def _tokenizer_importing(path, package: str) -> None:
    (path / "tokenization_x.py").write_text(f"import {package}\n" + TOKENIZER_CODE)


@pytest.mark.parametrize("package", ["eagle3_hf_absent_package", "tiktoken"])
def test_a_package_the_trusted_code_imports_and_this_environment_lacks_is_one_line(custom_tokenizer_dir, tmp_path,
                                                                                  capsys, monkeypatch, package):
    """Kimi-K2.5's tokenizer imports tiktoken: without it, one line names the package and how to install it (for
    tiktoken, also this project's `kimi` extra), never an ImportError traceback."""
    monkeypatch.setitem(sys.modules, package, None)  # not importable, even where it is installed
    _tokenizer_importing(custom_tokenizer_dir, package)
    src = tmp_path / "convs.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    argv = ["prepare", "--tokenizer", str(custom_tokenizer_dir), "--input", str(src), "--output", str(tmp_path / "p"),
            "--trust-remote-code"]
    assert cli.main(argv) == 1
    extra = " (or this project's extra: pip install -e '.[kimi]')" if package == "tiktoken" else ""
    assert capsys.readouterr().err.strip() == (f"error: {custom_tokenizer_dir}: its tokenizer needs {package}, not "
                                               f"installed here: pip install {package}{extra}")
    assert not (tmp_path / "p").exists()
