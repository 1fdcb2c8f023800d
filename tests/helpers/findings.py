"""Reading `eagle3-hf check`'s findings in the tests: their codes (at one level or all) and one code's message."""

from __future__ import annotations


def codes(findings, level=None):
    return {f.code for f in findings if level is None or f.level == level}


def message(findings, code):
    return next(f.message for f in findings if f.code == code)
