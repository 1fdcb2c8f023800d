"""Every results page can be rerun by a skeptic: it names its command, the commit its numbers were measured at (or
recorded in) and the machine, in the three lines docs/results/README.md describes, and every commit it names is
one git knows."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FIELDS = ("command", "commit", "machine")
SHA = re.compile(r"(?<![\w.])[0-9a-f]{7,40}(?![\w.])")
FENCE = re.compile(r"^```", re.M)


def header(text: str) -> dict[str, str]:
    """The page's `- command:`, `- commit:`, `- machine:` items, each with its indented continuation lines."""
    items: dict[str, str] = {}
    for match in re.finditer(r"^- (command|commit|machine): (.+(?:\n  .+)*)", text, re.M):
        items.setdefault(match.group(1), " ".join(match.group(2).split()))
    return items


def known_commit(sha: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0


def problems(name: str, text: str) -> list[str]:
    """Why a page fails the format: a missing item, a commit item with no commit git knows, a command item that
    neither quotes a command nor points at a command block."""
    items, found = header(text), []
    found += [f"{name}: no `- {field}:` line" for field in FIELDS if field not in items]
    if "commit" in items:
        shas = SHA.findall(items["commit"])
        if not shas:
            found.append(f"{name}: the commit line names no commit")
        found += [f"{name}: git knows no commit {sha}" for sha in shas if not known_commit(sha)]
    if "command" in items and "`" not in items["command"]:
        found.append(f"{name}: the command line quotes no command")
    if "command" in items and "block" in items["command"] and not FENCE.search(text):
        found.append(f"{name}: the command line points at blocks the page does not have")
    return found


def pages() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p.name != "README.md")


def test_every_results_page_names_its_command_commit_and_machine():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
    if shallow != "false":
        pytest.skip("a shallow or missing git history cannot resolve the pages' commits")
    assert pages()
    assert [p for page in pages() for p in problems(page.name, page.read_text(encoding="utf-8"))] == []


def test_a_page_without_them_fails():
    good = ("# A page\n\n- command: the `bash` block below\n- commit: recorded in {sha} (the run did not record\n"
            "  its own)\n- machine: 2 CPU cores\n\n```bash\npython -m experiments.x\n```\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert problems("p.md", good.format(sha=head[:7])) == []
    assert problems("p.md", "# A page\n\nMeasured on some machine.\n") == [
        "p.md: no `- command:` line", "p.md: no `- commit:` line", "p.md: no `- machine:` line"]
    assert problems("p.md", good.format(sha="0123abc")) == ["p.md: git knows no commit 0123abc"]
    assert problems("p.md", good.format(sha="the current one")) == ["p.md: the commit line names no commit"]
    no_block = good.format(sha=head[:7]).split("```")[0]
    assert problems("p.md", no_block) == ["p.md: the command line points at blocks the page does not have"]
