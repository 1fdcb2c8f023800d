"""docs/development.md's table of where the suite's CPU goes, from the lines tests/helpers/cpu_seconds.py wrote.

    EAGLE3_HF_TEST_CPU_LOG=/tmp/cpu.jsonl make test
    python scripts/cpu_table.py /tmp/cpu.jsonl --write docs/development.md   # or print it without --write

The table: the suite's CPU seconds in all, then the modules and the tests that cost most, each with its share.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

BEGIN, END = "<!-- cpu-table: begin (scripts/cpu_table.py) -->", "<!-- cpu-table: end -->"


def read_records(path: Path) -> list[dict[str, float | str]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            float(record["cpu_own"]), float(record["cpu_children"]), str(record["test"])
        except (ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"{path}:{number}: not a line of tests/helpers/cpu_seconds.py ({err})") from None
        records.append(record)
    if not records:
        raise SystemExit(f"{path}: no tests recorded (was EAGLE3_HF_TEST_CPU_LOG set for the run?)")
    return records


def cpu_table(records: list[dict[str, float | str]], top: int = 15) -> str:
    """Markdown: the total, the `top` modules and the `top` tests by CPU seconds (own + reaped children)."""
    per_test: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for r in records:
        per_test[str(r["test"])] += float(r["cpu_own"]) + float(r["cpu_children"])
        wall[str(r["test"])] += float(r.get("wall", 0.0))
    per_module: dict[str, float] = defaultdict(float)
    for test, seconds in per_test.items():
        per_module[test.split("::")[0]] += seconds
    total = sum(per_test.values())
    lines = [f"{len(per_test)} tests, **{total:,.0f} CPU s** in all (own + their reaped subprocesses).", "",
             "| module | CPU s | share |", "|---|---|---|"]
    for module, seconds in sorted(per_module.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{module}` | {seconds:,.1f} | {seconds / total:.1%} |")
    ends = worker_ends(records)
    if ends:
        lines += ["", "Workers' last tests ended at " + ", ".join(f"{w} {t:,.0f} s" for w, t in ends.items())
                  + " after the first test started (the gap is time one core had nothing left to run)."]
    lines += ["", "| test | CPU s | wall s | share |", "|---|---|---|---|"]
    for test, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| `{test}` | {seconds:,.1f} | {wall[test]:,.1f} | {seconds / total:.1%} |")
    return "\n".join(lines)


def worker_ends(records: list[dict[str, float | str]]) -> dict[str, float]:
    """Seconds from the first test's start to each worker's last test's end (records with `worker` and `ended`)."""
    timed = [r for r in records if "worker" in r and "ended" in r]
    if not timed:
        return {}
    start = min(float(r["ended"]) - float(r.get("wall", 0.0)) for r in timed)
    ends: dict[str, float] = {}
    for r in timed:
        ends[str(r["worker"])] = max(ends.get(str(r["worker"]), 0.0), float(r["ended"]) - start)
    return dict(sorted(ends.items()))


def write_between_markers(doc: Path, table: str) -> None:
    text = doc.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the JSON lines EAGLE3_HF_TEST_CPU_LOG collected")
    parser.add_argument("--write", type=Path, help="write the table between the markers of this Markdown file")
    parser.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    args = parser.parse_args(argv)
    table = cpu_table(read_records(args.log), args.top)
    if args.write:
        write_between_markers(args.write, table)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
