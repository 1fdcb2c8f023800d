"""`make venv` installs the set CI tested: constraints.txt pins every package, within pyproject's ranges, and
the Makefile rebuilds the venv when the pins change; `make test-fast` never installs vLLM, `make test` does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pins(path: Path) -> dict[str, Version]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[canonicalize_name(name)] = Version(version)
    return found


def make_variable(name: str) -> str:
    match = re.search(rf"^{name} \??:?= *(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, name
    return match.group(1).strip()


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]


def test_every_dependency_is_pinned_within_its_range():
    pinned = pins(ROOT / "constraints.txt")
    torch = Version(make_variable("TORCH_SPEC").split("==")[1])
    outside = []
    for req in project_requirements():
        name = canonicalize_name(req.name)
        version = torch if name == "torch" else pinned.get(name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req} -> {version}")
    assert outside == [], "constraints.txt (or TORCH_SPEC) lacks or breaks these ranges: `make constraints`"


def test_torch_and_the_asset_wheels_are_pinned_elsewhere_only():
    pinned = pins(ROOT / "constraints.txt")
    assets = [canonicalize_name(w.split("==")[0]) for w in make_variable("ASSET_WHEELS").split()]
    assert [n for n in ["torch", "eagle3-hf", *assets] if n in pinned] == []


@pytest.mark.skipif(not (Path(sys.prefix) / ".installed").is_file(), reason="not a venv made by `make venv`")
def test_the_venv_holds_exactly_the_pinned_versions():
    installed = {canonicalize_name(d.metadata["Name"]): Version(d.version) for d in metadata.distributions()}
    differ = {n: (str(v), str(installed[n])) for n, v in pins(ROOT / "constraints.txt").items()
              if n in installed and installed[n] != v}
    assert differ == {}, "this venv is not the tested set: `make venv` (or, after a tested upgrade, `make constraints`)"


def dry_make(tmp_path, *args: str) -> str:
    """What make would run for these arguments, against a venv whose stamp is newer than everything."""
    venv = tmp_path / "venv"
    venv.mkdir(exist_ok=True)
    (venv / ".installed").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("EAGLE3_HF_SKIP_VLLM", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", *args], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout


def test_changed_constraints_rebuild_the_venv(tmp_path):
    assert "pip install" not in dry_make(tmp_path, "venv")
    rebuild = dry_make(tmp_path, "-W", "constraints.txt", "venv").splitlines()
    project = [line for line in rebuild if 'pip install -q -e ".[dev]"' in line]
    assert len(project) == 1 and "-c constraints.txt" in project[0]


def test_test_fast_never_installs_vllm_and_test_does(tmp_path):
    fast = dry_make(tmp_path, "test-fast")
    assert "install_vllm.sh" not in fast and '-m "not slow"' in fast
    assert "install_vllm.sh" in dry_make(tmp_path, "test")
