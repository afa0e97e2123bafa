"""Every command of README.md and docs/ runs as written, in order, as a new user would run them: in a copy of the
repository without outputs/, each page after the README's commands.

- `./run_train.sh ...`: the launcher's validation in this process (for NPROC ranks, 2 by default: what the script
  starts on a CPU machine), then its dump folder written as a run leaves it, so a later command that reuses the folder
  for a different run is refused here as it would be there. A `--dry-run` line runs the dry run, which must exit 0.
- `python -m MODULE ...`: parsed by the module's own argument parser, which then stops it (nothing trains);
  `python -m torchacco COMMAND ...` by its command's, through the dispatcher (a command named alone in prose only has
  to exist); `torchacco predict` runs (no side effects, a fraction of a second). Another project's module
  (`python -m ruff`) only has to exist: run here, it could replace this process.
- `./run_tests.sh ...`: not run (it is the suite); each `-m` expression names only markers pyproject.toml declares,
  and each test file it names exists.
- A path under outputs/ that a command reads must be written by an earlier one (a run's dump folder, `--out`).

Checked for a cluster instead of this machine (`validate(here=False)`, for the config's `[job] cluster`): a run that
reads data the user downloads first (not in the repository), or runs on several nodes (NNODES > 1) — it needs their
GPUs. Parsed only: a line with `sudo` (network namespaces need root). Skipped: a template with placeholders (`FILE`,
`...`, `<node 0>`, `$i`). No command trains, so this test takes seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from torchacco import run_folder
from torchacco.__main__ import COMMANDS
from torchacco.__main__ import main as dispatch
from torchacco.config import load_config
from torchacco.config import main as config_main
from torchacco.planning import dry_run
from torchacco.planning.dry_run import parse_cluster
from torchacco.validate import validate

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
START = re.compile(
    r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:sudo\s+)?(?:\./run_t(?:rain|ests)\.sh|(?:\.venv/bin/)?python3?\s+-m)\b"
)
TEMPLATE = re.compile(r"\.\.\.|\b(FILE|DIR|SECTION|NAME|NODESxGPUS)\b|<[^>]*>|\$\w|\bmy_\w+\.toml|/path/to/")
OURS = ("torchacco", "benchmarks", "models", "data", "scripts")  # the modules this repository holds
RUNS = "outputs"  # where runs write: empty on a fresh clone
PYTEST = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"]
MARKERS = {marker.split(":")[0] for marker in PYTEST["markers"]}  # what a `-m` expression may name
INPUTS = ("model.init_from", "data.dataset", "data.validation", "tokenizer.path", "checkpoint.load_path")


def commands(page: Path) -> list[str]:
    """The command lines of a page, in order: lines of its code blocks (with their continuations) and inline code
    spans of its prose that start with ./run_train.sh or python -m."""
    text = page.read_text(encoding="utf-8")
    found = []  # (offset, command)
    for block in re.finditer(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in re.finditer(r"^(?:.*\\\n)*.*$", block.group(1), flags=re.M):
            command = re.sub(r"\\\n\s*", " ", line.group(0)).strip()
            if START.match(command):
                found.append((block.start(1) + line.start(), command))
    prose = re.sub(r"```.*?```", lambda m: " " * len(m.group(0)), text, flags=re.S)
    for span in re.finditer(r"`([^`]+)`", prose):
        command = " ".join(span.group(1).split())
        if START.match(command):
            found.append((span.start(), command))
    return [command for _, command in sorted(found)]


def _split(command: str) -> tuple[dict[str, str], bool, list[str]]:
    """(environment set on the line, with sudo, argv from ./run_train.sh, ./run_tests.sh or the module on): comments,
    optional `[--x y]` parts and shell redirections dropped."""
    words = shlex.split(re.sub(r"\s\[--[^\]]*\]", "", command), comments=True)
    env = {}
    while "=" in words[0] and words[0].split("=")[0].isupper():
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    sudo = words[0] == "sudo"
    words = words[sudo:]
    if words[0] not in ("./run_train.sh", "./run_tests.sh"):
        words = words[2:]  # python -m
    cut = next((i for i, w in enumerate(words) if w in (">", ">>", "|", "&&", ";")), len(words))
    return env, sudo, words[:cut]


@dataclasses.dataclass
class Session:
    """What the commands run so far left: the folders and files they write."""

    written: list[Path] = dataclasses.field(default_factory=list)
    exports: dict[Path, bool] = dataclasses.field(default_factory=dict)  # a run's folder: whether it writes hf/
    notes: list[str] = dataclasses.field(default_factory=list)

    def wrote(self, path: str) -> bool:
        path = Path(path).resolve()
        for folder in self.written:
            exported = self.exports.get(folder, True) or not path.is_relative_to((folder / "hf").resolve())
            if path.is_relative_to(folder.resolve()) and exported:
                return True
        return False

    def run(self, command: str, replay: bool = False) -> None:
        """Check one command; `replay`: an earlier page's command, only for what it leaves."""
        env, sudo, argv = _split(command)
        if TEMPLATE.search(" ".join(argv)):
            self.notes.append(f"template, skipped: {command}")
            return
        if argv[0] == "./run_train.sh":
            self.train(env, argv[1:], replay)
        elif argv[0] == "./run_tests.sh":
            assert replay or check_pytest_arguments(argv[1:]), argv
        elif not replay:
            self.module(argv[0], argv[1:], sudo)

    def train(self, env: dict, argv: list[str], replay: bool) -> None:
        if "--help" in argv or "-h" in argv:
            assert replay or config_main(argv) == 0
            return
        if any(a == "--dry-run" or a.startswith("--dry-run=") for a in argv):
            if not replay:
                assert dry_run.main(argv) == 0, f"the dry run fails: {argv}"
            return
        cfg = load_config(argv)
        local = [getattr(cfg.section(k.split(".")[0]), k.split(".")[1]) for k in INPUTS]
        local = [p for p in local if p and p != "embedded" and not Path(p).exists()]
        for path in local:
            if Path(path).parts[0] == RUNS:
                assert self.wrote(path), f"{argv} reads {path}, which no earlier command writes"
        folder = Path(cfg.job.dump_folder)
        if local:  # a model folder not here yet: the flavor's architecture stands in (as in the dry run)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=""))
        if int(env.get("NNODES", 1)) > 1 or any(Path(p).parts[0] != RUNS for p in local):
            cluster = parse_cluster(cfg.job.cluster or "1x2", "[job] cluster =")
            self.notes.append(f"checked for {cluster.nodes}x{cluster.gpus_per_node} (its data or nodes): {argv}")
            validate(cfg, cluster.world, cluster.gpus_per_node, here=False)
        elif local:  # inputs that an earlier command writes
            validate(cfg, 2, 2, here=False)
        else:
            nproc = int(env.get("NPROC", env.get("NGPU", 2)))
            validate(cfg, nproc, nproc)
        run_folder.check(cfg, folder)  # the validation's, also where the one above skips this machine
        run_folder.prepare(cfg, folder)
        self.written.append(folder)
        self.exports[folder] = cfg.checkpoint.export_hf

    def module(self, name: str, argv: list[str], sudo: bool) -> None:
        assert importlib.util.find_spec(name) is not None, f"python -m {name}: no such module"
        if name.split(".")[0] not in OURS:  # a tool such as ruff may exec itself in place of this process
            self.notes.append(f"another project's tool, not run: python -m {name} {' '.join(argv)}")
            return
        command = [a for a in argv[:1] if name == "torchacco" and a[0] != "-"]  # python -m torchacco COMMAND
        assert not command or command[0] in COMMANDS, f"python -m torchacco {command[0]}: no such command"
        if len(argv) == len(command):
            return  # the tool named in prose: it exists
        for flag in ("--out", "--local-dir", "--write"):
            if flag in argv:
                self.written.append(Path(argv[argv.index(flag) + 1]))
        for path in (a for a in argv if Path(a).parts[:1] == (RUNS,) and a not in map(str, self.written)):
            assert self.wrote(path), f"python -m {name} reads {path}, which no earlier command writes"
        if [name, *command] == ["torchacco", "predict"]:
            assert run_module(name, argv, parse_only=False) == 0
            return
        parsed = run_module(name, argv, parse_only=True)
        train_args = [a for a in getattr(parsed, "train_args", []) if a != "--"]
        if train_args:  # benchmarks cluster ... -- <training arguments>
            load_config(train_args)
        if sudo:
            self.notes.append(f"needs root, parsed only: python -m {name} {' '.join(argv)}")


def check_pytest_arguments(argv: list[str]) -> bool:
    """pytest's arguments as ./run_tests.sh passes them: each `-m` expression's markers declared in pyproject.toml
    (pytest takes any name there: a misspelt one selects nothing, or everything after `not`), each test file named."""
    for i, arg in enumerate(argv):
        expression = argv[i + 1] if arg == "-m" else arg[2:] if arg.startswith("-m") and len(arg) > 2 else None
        if expression is not None:
            names = set(re.findall(r"\w+", expression)) - {"and", "or", "not"}
            assert names and names <= MARKERS, f"-m {expression!r}: {sorted(names - MARKERS)} not declared"
        elif arg.endswith(".py") or "::" in arg:
            assert (ROOT / arg.split("::")[0]).is_file(), f"{arg}: no such test file"
    return True


class Parsed(Exception):
    """The module's arguments parsed: stop before it runs."""


def run_module(name: str, argv: list[str], parse_only: bool):
    """`python -m name argv` in this process; with `parse_only`, stopped once its outermost argument parser is done
    (returns the namespace; a parse error fails)."""
    real_parse, real_known, depth = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, [0]

    def stopping(real):
        def parse(self, args=None, namespace=None):
            depth[0] += 1
            try:
                result = real(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise Parsed(result)
            return result

        return parse

    saved = sys.argv
    sys.argv = [name, *argv]
    patches = {"parse_args": stopping(real_parse), "parse_known_args": stopping(real_known)} if parse_only else {}
    for attr, fn in patches.items():
        setattr(argparse.ArgumentParser, attr, fn)
    try:
        if name == "torchacco":  # the dispatcher's main: its exit (gc.freeze) is for a process's end, not this test's
            sys.exit(dispatch(argv))
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    except Parsed as done:
        return done.args[0][0] if isinstance(done.args[0], tuple) else done.args[0]
    except SystemExit as e:
        assert e.code in (0, None), f"python -m {name} {' '.join(argv)} exits {e.code}"
        return 0
    finally:
        sys.argv = saved
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real_parse, real_known
    assert not parse_only, f"python -m {name} ran without parsing arguments"
    return 0


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """The repository without outputs/ as the working directory (its files linked, not copied)."""
    for entry in ROOT.iterdir():
        if entry.name not in (RUNS, ".git"):
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setenv("TORCHACCO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return tmp_path


def test_the_pages_hold_the_commands_this_test_runs():
    readme = commands(ROOT / "README.md")
    assert len(readme) >= 10, readme
    assert "./run_train.sh --config train_configs/default.toml" in readme[0]
    assert sum(len(commands(page)) for page in PAGES) >= 30


def test_a_run_tests_line_names_declared_markers_and_test_files_that_exist():
    assert "./run_tests.sh -m not integration" in [" ".join(_split(c)[2]) for c in commands(ROOT / "README.md")]
    assert check_pytest_arguments(["-q", "-m", "not faults and not slow", "tests/test_predict.py::test_x", "-k", "a"])
    for argv in (["-m", "not integraton"], ["-mslow2"], ["-m", ""], ["tests/test_nowhere.py"]):
        with pytest.raises(AssertionError):
            check_pytest_arguments(argv)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_of_a_page_runs_as_written_in_order_after_the_readmes(page, fresh_clone):
    session = Session()
    before = [(command, True) for command in commands(ROOT / "README.md")] if page.name != "README.md" else []
    for command, replay in before + [(command, False) for command in commands(page)]:
        try:
            session.run(command, replay)
        except Exception as e:
            pytest.fail(f"{'README.md' if replay else page.name}: {command}\n  fails: {type(e).__name__}: {e}")
    print("\n".join(session.notes))  # what was checked short of running (pytest -rP shows it)
