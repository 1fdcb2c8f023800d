"""Write docs/cli.md, the CLI reference: `eagle3-hf --help` and every command's `--help`, as the parsers print them,
and the table of feature routes, from the table itself (eagle3_hf/features/table.py's SOURCES).

    python scripts/cli_reference.py            # rewrite docs/cli.md
    python scripts/cli_reference.py --check    # exit 1 when docs/cli.md is not what the parsers print now

argparse wraps help to the terminal's width, so the width is fixed here (COLUMNS); `train`'s defaults that depend
on the machine (CPU or GPU: use_cpu, data-loader workers) are left at transformers' own values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

COLUMNS = "100"
os.environ["COLUMNS"] = COLUMNS  # before argparse formats anything
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
REFERENCE = ROOT / "docs" / "cli.md"

from eagle3_hf.cli import COMMANDS, build_parser, command_parser  # noqa: E402
from eagle3_hf.features.table import SOURCES  # noqa: E402
from eagle3_hf.train.arguments import build_parser as train_parser  # noqa: E402

HEADER = """# Command-line reference

Every `eagle3-hf` command's `--help`, as its parser prints it. Written by `python scripts/cli_reference.py`;
tests/test_cli_reference.py fails when this page is not current. `train` takes transformers' `TrainingArguments`
as well (`--config FILE.yaml` gives defaults for any of them; examples/recipes/ holds the shipped recipes).
"""


def command_help(name: str) -> str:
    if name == "train":
        return train_parser(prog="eagle3-hf train").format_help()
    return command_parser(name).format_help()


ROUTES = """## Feature routes

Every way to get the verifier's hidden states, one row of `SOURCES` (eagle3_hf/features/table.py) each: the
commands that select it, whether a command writes it to shards (offline) and whether training computes it while it
trains (online). Adding one: docs/development.md, "Adding a feature source".
"""


def route_table() -> list[str]:
    """The feature routes as a Markdown table, one line per row of SOURCES."""
    lines = ["| kind | selected by | offline | online | what computes the states |", "|---|---|---|---|---|"]
    for row in SOURCES.values():
        lines.append(f"| {row.kind} | `{row.selected_by.replace('; ', '`; `')}` | {'yes' if row.offline else 'no'} "
                     f"| {'yes' if row.online else 'no'} | {row.summary} |")
    return lines


def reference() -> str:
    parts = [HEADER, "## eagle3-hf", "", "```text", build_parser().format_help().rstrip(), "```", ""]
    for name, (_module, summary) in COMMANDS.items():
        parts += [f"## eagle3-hf {name}", "", summary, "", "```text", command_help(name).rstrip(), "```", ""]
    parts += [ROUTES, *route_table(), ""]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = reference()
    if args.check:
        if REFERENCE.read_text(encoding="utf-8") != text:
            print(f"{REFERENCE.relative_to(ROOT)} is not current: run python scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text, encoding="utf-8")
    print(f"wrote {REFERENCE.relative_to(ROOT)} ({len(COMMANDS)} commands)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
