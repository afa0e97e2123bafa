"""torchacco/ imports as layers: the module-level imports (those under `if TYPE_CHECKING:` aside) form no
cycle, and building a config imports no torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the package it imports at module level (a `from pkg import mod` counts as
    pkg.mod where that is a module of the package)."""
    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        graph[name] = set()
        for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    parts = name.split(".")[: -node.level + (path.name == "__init__.py") or None]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _module_level(body):
    """The import statements run when the module is imported: at its top level and inside plain blocks
    (try, if), not inside functions or classes, nor under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            checking = isinstance(node.test, ast.Name | ast.Attribute) and "TYPE_CHECKING" in ast.unparse(node.test)
            if not checking:
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph (its modules, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_torchacco_has_no_import_cycle():
    found = cycle(import_graph(ROOT / "torchacco"))
    assert found is None, "an import cycle in torchacco/: " + " -> ".join(found)


def test_the_checker_finds_a_cycle_and_ignores_function_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
        "def f():\n    from pkg.a import x\n"
    )
    assert import_graph(pkg) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": set()}
    assert cycle(import_graph(pkg)) is None
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "b.py").write_text("try:\n    from .c import y\nexcept ImportError:\n    pass\n")
    assert cycle(import_graph(pkg)) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def python_prints(code: str) -> str:
    """What a fresh interpreter running `code` in the repository prints (it must exit 0)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_building_a_config_imports_no_torch():
    """The config is a leaf above the strategies: reading a TOML file and the CLI needs no torch (so none of
    torch.distributed, FSDP or DTensor), whichever strategy and options it names."""
    code = (
        "import sys; from torchacco.config import load_config; "
        "cfg = load_config(['--parallelism.data_parallel', 'acco', '--acco.estimate_comm', 'bf16', "
        "'--hsdp.shard_degree', '2']); cfg.to_toml(); "
        "assert cfg.strategy_options['acco'].estimate_comm == 'bf16'; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert python_prints(code) == "[]"


def test_a_run_without_pipeline_parallelism_imports_no_dynamo():
    """torch.distributed.pipelining imports torch._dynamo, seconds of every process's start on a CPU host: the
    launcher and the trainer import it only for a pipelined run (parallel/pipeline.py), so a run without one
    starts that much sooner."""
    code = (
        "import sys, torchacco.launch, torchacco.trainer; "
        "heavy = ('torch._dynamo', 'torch.distributed.pipelining'); "
        "print(sorted({m for m in sys.modules if m.startswith(heavy)}))"
    )
    assert python_prints(code) == "[]"
