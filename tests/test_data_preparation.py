"""Data preparation outside the collective watchdog: ranks wait for it on the launcher's store,
with no deadline, and a command prepares the cache ahead of a job."""

import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, run_train, tiny_args

from torchacco.faults import Faults, data_delay

pytestmark = pytest.mark.integration


@pytest.mark.faults  # slow_data
def test_a_preparation_longer_than_the_collective_timeout_still_trains(tiny_corpus, tmp_path):
    # A fresh cache: rank 0 tokenizes for 12 s more than it needs, under a 4 s collective timeout.
    args = tiny_args(tiny_corpus, tmp_path / "cache", tmp_path / "out", "--training.collective_timeout_s", "4")
    proc = run_train(
        [*args, "--training.steps", "2", "--eval.every", "0"], env={"TORCHACCO_FAULT": "slow_data@rank0:12s"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2]


def test_prepare_data_fills_the_cache_that_a_run_then_reads(tiny_corpus, tmp_path):
    args = tiny_args(tiny_corpus, tmp_path / "cache", tmp_path / "out")
    proc = subprocess.run([sys.executable, "-m", "torchacco", "prepare-data", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "data ready" in proc.stdout
    assert list((tmp_path / "cache").rglob("meta.json"))  # the token cache
    missing = ["--data.dataset", str(tmp_path / "no")]
    bad = subprocess.run([sys.executable, "-m", "torchacco", "prepare-data", *args, *missing],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.strip().count("\n") == 0 and "torchacco: error:" in bad.stderr


def test_slow_data_faults_parse_and_add_up():
    spec = "slow_data@rank0:2.5s,kill@rank1:step3,slow_data@rank0:1s"
    assert data_delay(0, spec) == 3.5 and data_delay(1, spec) == 0
    assert len(Faults(spec, 1).faults) == 1  # the kill; the delays are data_delay's
