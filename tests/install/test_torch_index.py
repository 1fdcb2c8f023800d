"""scripts/torch_index.py: which pip arguments make the CPU torch pin installable (`make vllm`, `make venv`).

The choice is tested twice: with stand-in probes (every branch, and that a configured index is never
overridden), then with the real pip on local indexes only: a plain machine (an index without the `+cpu`
wheel) gets PyTorch's CPU index added; a machine whose pip already finds the wheel gets nothing; a machine
reaching neither gets one line and exit status 1.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIN = "torch==2.13.0+cpu"


def load_helper():
    spec = importlib.util.spec_from_file_location("torch_index", ROOT / "scripts" / "torch_index.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


torch_index = load_helper()


class Probes:
    """A stand-in for pip: resolvable with the configured indexes, or only with the given extra arguments."""

    def __init__(self, configured: bool, with_cpu_index: bool):
        self.configured, self.with_cpu_index, self.calls = configured, with_cpu_index, []

    def __call__(self, requirement, extra):
        self.calls.append((requirement, list(extra)))
        return self.configured if not extra else self.with_cpu_index


def test_configured_indexes_that_have_the_pin_get_nothing_added():
    probes = Probes(configured=True, with_cpu_index=True)
    assert torch_index.index_args(PIN, probes) == []
    assert probes.calls == [(PIN, [])]  # PyTorch's index is not even asked


def test_a_plain_machine_gets_pytorchs_cpu_index():
    probes = Probes(configured=False, with_cpu_index=True)
    assert torch_index.index_args(PIN, probes) == ["--extra-index-url", torch_index.CPU_INDEX]
    assert probes.calls == [(PIN, []), (PIN, ["--extra-index-url", torch_index.CPU_INDEX])]


def test_neither_gives_one_line_naming_the_pin_and_the_index():
    with pytest.raises(torch_index.TorchNotFound) as err:
        torch_index.index_args(PIN, Probes(configured=False, with_cpu_index=False), "https://mirror.invalid/cpu")
    message = str(err.value)
    assert "\n" not in message and PIN in message and "https://mirror.invalid/cpu" in message


def test_the_pin_is_read_from_the_vllm_constraints():
    assert torch_index.torch_pin("numpy==2.3.5\n# torch==1.0 in a comment\ntorch==2.13.0+cpu\n") == PIN
    shipped = torch_index.torch_pin((ROOT / "scripts" / "vllm_constraints.txt").read_text())
    assert shipped.startswith("torch==") and shipped.endswith("+cpu")
    with pytest.raises(ValueError):
        torch_index.torch_pin("numpy==2.3.5\n")


def fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid wheel: enough for pip to resolve it."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index on disk holding these torch wheels; its file:// URL."""
    (root / "torch").mkdir(parents=True)
    links = "".join(f'<a href="{w.as_uri()}">{w.name}</a>\n' for w in wheels)
    (root / "torch" / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return root.as_uri()


@pytest.fixture
def plain_pip(tmp_path, monkeypatch):
    """pip with no configuration but an index lacking the +cpu wheel (this machine's wheel folders hidden)."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no pip.conf read at all
    pypi_like = simple_index(tmp_path / "pypi", [fake_wheel(tmp_path / "w1", "torch", "2.13.0")])  # no +cpu build
    monkeypatch.setenv("PIP_INDEX_URL", pypi_like)
    monkeypatch.delenv("EAGLE3_HF_TORCH_INDEX", raising=False)
    return tmp_path


def run_main(capsys, *args):
    code = torch_index.main([*args, "--python", sys.executable])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.strip()


def test_real_pip_on_a_plain_machine_adds_the_cpu_index(plain_pip, monkeypatch, capsys):
    cpu = simple_index(plain_pip / "cpu", [fake_wheel(plain_pip / "w2", "torch", "2.13.0+cpu")])
    monkeypatch.setenv("EAGLE3_HF_TORCH_INDEX", cpu)
    assert run_main(capsys, PIN) == (0, ["--extra-index-url", cpu], "")


def test_real_pip_that_already_finds_the_wheel_adds_nothing(plain_pip, monkeypatch, capsys):
    constraints = ROOT / "scripts" / "vllm_constraints.txt"
    version = torch_index.torch_pin(constraints.read_text()).split("==")[1]
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake_wheel(plain_pip / "w2", "torch", version).parent))
    monkeypatch.setenv("EAGLE3_HF_TORCH_INDEX", (plain_pip / "absent").as_uri())
    assert run_main(capsys, "--from-constraints", str(constraints))[:2] == (0, [])


def test_real_pip_reaching_neither_fails_with_one_line(plain_pip, monkeypatch, capsys):
    empty = simple_index(plain_pip / "cpu", [])
    monkeypatch.setenv("EAGLE3_HF_TORCH_INDEX", empty)
    code, out, err = run_main(capsys, PIN)
    assert (code, out) == (1, [])
    assert err.startswith("error: " + PIN) and empty in err and "\n" not in err
