"""The engine stays small enough to read: torchacco/ and benchmarks/ have a line budget, as docs/ has (test_docs)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Physical lines of Python: a change that would grow past its budget cuts repetition elsewhere first, or raises the
# budget in the same commit with the reason.
BUDGET = {"torchacco": 10_830, "benchmarks": 4_650}


@pytest.mark.parametrize("folder", sorted(BUDGET))
def test_the_code_stays_within_its_line_budget(folder):
    n = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / folder).rglob("*.py"))
    assert n <= BUDGET[folder], f"{folder}/ has {n} lines of Python (at most {BUDGET[folder]}): cut repetition first"
