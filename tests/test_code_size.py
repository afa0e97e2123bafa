"""The engine stays small enough to read: torchacco/ and benchmarks/ have a line budget, as docs/ has (test_docs)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Physical lines of Python: a change that would grow past its budget cuts repetition elsewhere first, or raises the
# budget in the same commit with the reason.
BUDGET = {"torchacco": 10_917, "benchmarks": 4_666}


@pytest.mark.parametrize("folder", sorted(BUDGET))
def test_the_code_stays_within_its_line_budget(folder):
    n = sum(len(p.read_text(encoding="utf-8").splitlines()) for p in (ROOT / folder).rglob("*.py"))
    assert n <= BUDGET[folder], f"{folder}/ has {n} lines of Python (at most {BUDGET[folder]}): cut repetition first"


# Functions read in one screen: at most this many lines, from the def line to the body's last, docstring included.
MAX_FUNCTION_LINES = 60
# The functions still longer, by "file:function": this list only shrinks (a function split leaves it).
LONGER: set[str] = set()


def _long_functions() -> dict[str, int]:
    found = {}
    for folder in BUDGET:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                n = node.end_lineno - node.lineno + 1 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else 0
                if n > MAX_FUNCTION_LINES:
                    found[f"{path.relative_to(ROOT).as_posix()}:{node.name}"] = n
    return found


def test_functions_stay_within_sixty_lines():
    found = _long_functions()
    new = [f"{name}: {n} lines" for name, n in found.items() if name not in LONGER]
    assert not new, f"longer than {MAX_FUNCTION_LINES} lines: {', '.join(new)}; split them into named steps"
    gone = sorted(LONGER - set(found))
    assert not gone, f"{', '.join(gone)} fit in {MAX_FUNCTION_LINES} lines now: remove them from LONGER"
