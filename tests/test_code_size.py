"""The engine stays small enough to read: torchacco/ and benchmarks/ have a line budget, as docs/ has (test_docs)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Physical lines of Python: a change that would grow past its budget cuts repetition elsewhere first, or raises the
# budget in the same commit with the reason.
BUDGET = {"torchacco": 10_726, "benchmarks": 4_657}


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


# A class reads in one sitting: at most this many methods and instance attributes (its `self.<name>` assignment
# targets and annotated fields), more grouped into a small named object.
MAX_CLASS_MEMBERS = 20
# config.py's sections mirror the user's TOML sections key for key: their size is the config's, not the code's.
CLASS_SIZE_EXEMPT = {"torchacco/config.py"}


def _class_sizes():
    for path in sorted((ROOT / "torchacco").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in CLASS_SIZE_EXEMPT:
            continue
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef):
                continue
            methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            stores = (n for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store))
            selfs = {n.attr for n in stores if isinstance(n.value, ast.Name) and n.value.id == "self"}
            yield f"{path.relative_to(ROOT).as_posix()}:{cls.name}", len(methods), len(fields | selfs)


def test_classes_stay_within_twenty_methods_and_attributes():
    big = [f"{name}: {m} methods, {a} attributes" for name, m, a in _class_sizes() if max(m, a) > MAX_CLASS_MEMBERS]
    assert not big, (
        f"more than {MAX_CLASS_MEMBERS} methods or attributes: {', '.join(big)}; group what belongs together"
    )
