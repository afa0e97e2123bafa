"""Launching on a cluster: the Slurm script's dry mode, run_train.sh installing only where asked or where nothing is
installed, per-rank log files with rank-prefixed console lines, any rank's error printed, and the warning for a
large corpus cached under $HOME."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_train, tiny_args

from torchacco import launch
from torchacco.config import load_config
from torchacco.data import home_cache_warning
from torchacco.errors import ERRORS_DIR, UserError, run_cli

SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"


def test_the_slurm_script_in_dry_mode_prints_each_nodes_launch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho gpu07\necho gpu08\n")  # `show hostnames`, as Slurm's
    (bin_dir / "scontrol").chmod(0o755)
    slurm = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]",
             "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": str(ROOT)}  # fmt: skip
    env = {**os.environ, **slurm, "DRY": "1", "PYTHON": sys.executable, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    for name in ("NPROC", "NGPU", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"):
        env.pop(name, None)
    args = ["--config", "train_configs/default.toml", "--training.steps", "10"]
    proc = subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    for node, line in enumerate(lines):
        assert line.startswith(f"node {node}: OMP_NUM_THREADS=8 {sys.executable} -m torchacco.launch ")
        assert f"--nnodes 2 --node_rank {node} --rdzv_backend c10d --rdzv_endpoint gpu07:29500 --rdzv_id 4242" in line
        assert line.endswith("--nproc_per_node 8 --max-restarts 0 -m torchacco.train " + " ".join(args))
    directives = re.findall(r"^#SBATCH (\S+)", SBATCH.read_text(), re.M)
    assert {"--exclusive", "--ntasks-per-node=1", "--requeue"} <= set(directives)
    assert any(d.startswith("--cpus-per-task=") for d in directives) and "--signal=USR1@180" in directives


def _bare_checkout(tmp_path: Path, python_exit: int) -> tuple[Path, dict]:
    """run_train.sh alone in a folder, with a `python3` that fails every check (no packages, no network)."""
    shutil.copy(ROOT / "run_train.sh", tmp_path / "run_train.sh")
    (tmp_path / "install.sh").write_text("#!/bin/sh\necho INSTALLED\nexit 9\n")
    (tmp_path / "install.sh").chmod(0o755)
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\nexit {python_exit}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    env.pop("INSTALL", None)
    return tmp_path / "run_train.sh", env


def test_run_train_installs_only_where_nothing_is_installed_or_when_asked(tmp_path):
    script, env = _bare_checkout(tmp_path, python_exit=1)

    def run(**extra):
        return subprocess.run([str(script)], capture_output=True, text=True, env={**env, **extra}, timeout=60)

    offline = run()  # no environment, and the index unreachable: one line, install.sh not run
    assert offline.returncode == 1 and "INSTALLED" not in offline.stdout
    assert offline.stderr.splitlines() == [
        "torchacco: error: no environment with torchacco's packages, and no network here to install one "
        "(pip cannot reach its package index); run ./install.sh on a node with network"
    ]
    several = run(NNODES="2")  # the nodes of a job would install into one .venv at once
    assert several.returncode == 1 and several.stderr.startswith("torchacco: error: no environment here; run INSTALL=1")
    (tmp_path / ".venv").mkdir()
    broken = run()
    assert broken.returncode == 1 and f"{tmp_path}/.venv lacks torchacco's packages" in broken.stderr
    asked = run(INSTALL="1")
    assert asked.returncode == 9 and asked.stdout == "INSTALLED\n"


def test_a_rank_that_alone_fails_has_its_error_printed_by_the_launcher(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ERRORS_DIR, str(tmp_path))

    def fail(message):
        def run():
            raise UserError(message)

        return run

    for rank, message in [(0, "the same mistake"), (1, "the same mistake"), (2, "no file x"), (3, "no file x")]:
        monkeypatch.setenv("RANK", str(rank))
        assert run_cli(fail(message), print_errors=rank == 0) == 1
    # rank 0 printed its line; the others printed nothing
    assert capsys.readouterr().err.splitlines() == ["torchacco: error: the same mistake"]
    assert launch.unprinted_errors(tmp_path) == ["torchacco: error: no file x (ranks 2, 3)"]


@pytest.mark.integration
def test_each_rank_logs_to_a_file_and_the_console_lines_name_the_rank(tiny_corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(tiny_corpus, cache_dir, out, "--training.steps", "1", "--eval.every", "0",
                     "--training.global_batch_size", "8", "--metrics.tensorboard", "false")  # fmt: skip
    proc = run_train(args, nproc=2, env={"RANK_LOGS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank_0.err", "rank_0.out", "rank_1.err", "rank_1.out"]
    logged = (out / "logs" / "rank_0.out").read_text().splitlines()
    assert logged[0].startswith("torchacco: gpt_neo/debug") and logged[1].startswith("step      1 |")
    assert [f"[rank0]: {line}" for line in logged] == [x for x in proc.stdout.splitlines() if x.startswith("[rank0]")]


def test_a_large_corpus_cached_under_home_is_warned_about(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHACCO_CACHE", raising=False)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("x" * 3000)
    monkeypatch.setattr("torchacco.data.LARGE_CORPUS_BYTES", 2000)
    data = load_config(["--data.dataset", str(corpus)]).data
    warning = home_cache_warning(data)
    assert warning and f"under your home folder ({tmp_path / 'home'}/.cache/torchacco)" in warning
    elsewhere = load_config(["--data.dataset", str(corpus), "--data.cache_dir", str(tmp_path / "scratch")]).data
    assert home_cache_warning(elsewhere) is None
    monkeypatch.setattr("torchacco.data.LARGE_CORPUS_BYTES", 4000)
    assert home_cache_warning(data) is None
    assert "\n" not in warning  # one line
