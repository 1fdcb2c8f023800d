"""docs/cli.md is what the parsers print now: a flag added, renamed or re-documented without
`python scripts/cli_reference.py` fails here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cli_reference_is_current():
    # the script fixes COLUMNS itself; a different terminal width here must not change the result
    env = {**os.environ, "COLUMNS": "57", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "cli_reference.py"), "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
