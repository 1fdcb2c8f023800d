"""Every results page can be rerun by a skeptic: it names its command, the commit its numbers were measured at (or
recorded in) and the machine, in the three lines docs/results/README.md describes; every commit it names is one git
knows, and one that touched the page (under any of its names), a file the commit line names (where the numbers
were recorded before the page existed), or the code its command runs: the files the command and the page's `bash`
blocks name (`python -m bench.x` is bench/x.py), the package every command runs (eagle3_hf/), and for `make` the
Makefile and examples/. A commit that touched none of these (a typo that happens to name another commit, a docs-only
commit named as the code measured) is refused."""

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
BLOCKS = re.compile(r"^```(?:bash|sh)\n(.*?)^```", re.M | re.S)
PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sh|yaml|json)|[\w-]+\.(?:py|sh))(?![\w/])")
MODULE = re.compile(r"(?:python\S*|^|\s)-m\s+([\w.]+)")
FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:md|py|sh|yaml))(?![\w/])")
PACKAGE = "eagle3_hf/"
# commits of the history that changed one file each: docs/cli.md; bench/first_launch.py; the tree-drafting page
# under its name before it moved into docs/results/
DOCS_ONLY, BENCH_ONLY, PAGE_ONLY = "d93c091", "4f462fd", "c0b7503"


def header(text: str) -> dict[str, str]:
    """The page's `- command:`, `- commit:`, `- machine:` items, each with its indented continuation lines."""
    items: dict[str, str] = {}
    for match in re.finditer(r"^- (command|commit|machine): (.+(?:\n  .+)*)", text, re.M):
        items.setdefault(match.group(1), " ".join(match.group(2).split()))
    return items


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def known_commit(sha: str) -> bool:
    return git("cat-file", "-e", f"{sha}^{{commit}}").returncode == 0


def touched(sha: str) -> set[str]:
    """The files a commit changed (a merge: against its first parent; the first commit: all its files)."""
    parent = git("rev-parse", "--verify", "--quiet", f"{sha}^")
    if parent.returncode:
        return set(git("ls-tree", "-r", "--name-only", sha).stdout.split())
    return set(git("diff", "--name-only", "--no-renames", f"{sha}^", sha).stdout.split())


def page_commits(path: Path) -> set[str]:
    """Every commit that touched the page, following its renames (a page moved into docs/results/ keeps its history)."""
    return set(git("log", "--follow", "--format=%H", "--", str(path.relative_to(ROOT))).stdout.split())


def command_code(text: str, items: dict[str, str]) -> tuple[set[str], set[str]]:
    """(files, folders) of the code the page's command runs: the paths and `-m` modules its command line and its
    `bash` blocks name, the package, and for `make` the Makefile and examples/."""
    said = items.get("command", "") + "\n" + "\n".join(BLOCKS.findall(text))
    files = set(PATH.findall(said)) | {m.replace(".", "/") + ".py" for m in MODULE.findall(said)}
    folders = {PACKAGE}
    if re.search(r"\bmake\b", said):
        files.add("Makefile")
        folders.add("examples/")
    return files, folders


def unrelated(sha: str, path: Path | None, text: str, items: dict[str, str]) -> bool:
    """Whether commit `sha` touched none of: the page, a file its commit line names, the code its command runs."""
    if path is not None and any(full.startswith(sha) for full in page_commits(path)):
        return False
    files, folders = command_code(text, items)
    files |= set(FILE.findall(items.get("commit", "")))
    changed = touched(sha)
    return not any(f in files or any(f.endswith("/" + n) for n in files) or f.startswith(tuple(folders))
                   for f in changed)


def problems(name: str, text: str, path: Path | None = None) -> list[str]:
    """Why a page fails the format: a missing item, a commit item with no commit git knows or naming one that
    touched neither the page (at `path`) nor the code its command runs, a command item that neither quotes a
    command nor points at a command block."""
    items, found = header(text), []
    found += [f"{name}: no `- {field}:` line" for field in FIELDS if field not in items]
    if "commit" in items:
        shas = SHA.findall(items["commit"])
        if not shas:
            found.append(f"{name}: the commit line names no commit")
        for sha in shas:
            if not known_commit(sha):
                found.append(f"{name}: git knows no commit {sha}")
            elif unrelated(sha, path, text, items):
                found.append(f"{name}: commit {sha} touched neither the page nor the code its command runs")
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
    assert [p for page in pages() for p in problems(page.name, page.read_text(encoding="utf-8"), page)] == []


def test_a_page_without_them_fails():
    good = ("# A page\n\n- command: the `bash` block below\n- commit: recorded in {sha} (the run did not record\n"
            "  its own)\n- machine: 2 CPU cores\n\n```bash\npython -m experiments.x\n```\n")
    head = git("log", "-1", "--format=%h", "--", PACKAGE).stdout.strip()  # the last commit that changed the package
    assert problems("p.md", good.format(sha=head[:7])) == []
    assert problems("p.md", "# A page\n\nMeasured on some machine.\n") == [
        "p.md: no `- command:` line", "p.md: no `- commit:` line", "p.md: no `- machine:` line"]
    assert problems("p.md", good.format(sha="0123abc")) == ["p.md: git knows no commit 0123abc"]
    assert problems("p.md", good.format(sha="the current one")) == ["p.md: the commit line names no commit"]
    no_block = good.format(sha=head[:7]).split("```")[0]
    assert problems("p.md", no_block) == ["p.md: the command line points at blocks the page does not have"]


def test_a_commit_that_touched_neither_the_page_nor_its_code_fails():
    if git("cat-file", "-e", f"{DOCS_ONLY}^{{commit}}").returncode:
        pytest.skip("a shallow or missing git history cannot resolve the pages' commits")
    page = ("# A page\n\n- command: `python -m bench.first_launch --gb 3`\n- commit: {sha}\n- machine: 2 CPU cores\n")
    assert problems("p.md", page.format(sha=BENCH_ONLY)) == []  # it changed bench/first_launch.py
    assert problems("p.md", page.format(sha=DOCS_ONLY)) == [
        f"p.md: commit {DOCS_ONLY} touched neither the page nor the code its command runs"]
    # numbers recorded in another file before the page existed: the commit line names it
    assert problems("p.md", page.format(sha=f"recorded in docs/cli.md by {DOCS_ONLY}")) == []
    # a commit that touched only the page, under the name it had before it moved into docs/results/
    assert problems("p.md", page.format(sha=PAGE_ONLY)) != []
    assert problems("p.md", page.format(sha=PAGE_ONLY), RESULTS / "tree_drafting.md") == []
