"""Every document the repository points to is in the repository: a person who clones the project must be
able to follow each citation (design notes kept elsewhere are not)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MD_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
URL = re.compile(r"https?://\S+")
OUTPUT_DIRS = ("demo_out/", "runs/")  # where the pipeline writes its own reports


def repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    return [ROOT / name for name in listed if name and (ROOT / name).is_file()]


def cited_documents(path: Path) -> list[tuple[int, str]]:
    """(line, path) of the Markdown documents a file cites. A lower-case bare name (summary.md, report.md),
    a path under an output directory or after --table is a file the code writes, not a citation."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return []
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = URL.sub("", line)
        for match in MD_PATH.finditer(line):
            name = match.group(1)
            written = ("/" not in name and not name[0].isupper()) or name.startswith(OUTPUT_DIRS) \
                or "--table" in line[: match.start()]
            if not written:
                found.append((number, name))
    return found


def test_no_file_cites_a_document_the_repository_lacks():
    missing = [f"{path.relative_to(ROOT)}:{number}: {name}"
               for path in repository_files() for number, name in cited_documents(path)
               if not ((ROOT / name).is_file() or (path.parent / name).is_file())]
    assert missing == []


def test_citations_are_found_and_written_files_are_not(tmp_path):
    design = "DESIGN" + ".md"  # spelled apart so this file does not cite it
    probe = tmp_path / "probe.py"
    probe.write_text(f'"""See docs/contracts.md and {design} §3 (https://example.org/x.md).\n'
                     'Writes summary.md, demo_out/small/summary.md and --table docs/table.md."""\n')
    assert cited_documents(probe) == [(1, "docs/contracts.md"), (1, design)]
    assert (ROOT / "docs" / "contracts.md").is_file() and not (ROOT / design).is_file()
