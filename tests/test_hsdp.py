"""HSDP: FSDP2 sharded over a node's ranks, replicated across nodes. On 4 gloo ranks as 2 nodes of 2: the
mathematics of DDP, half of the parameters stored per rank, a bit-for-bit resume, and one line for a shard
degree that does not divide the data-parallel ranks."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, run_train, six_step_args

from torchacco.config import Config
from torchacco.errors import UserError
from torchacco.parallel.hsdp import HSDP

NODE = ["--hsdp.shard_degree", "2"]  # 2 nodes of 2 ranks


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # 4 ranks on 2 cores: the slow pass
def test_hsdp_trains_as_ddp_and_resumes_bit_for_bit(tiny_corpus, cache_dir, tmp_path):
    runs = {}
    for kind in ("ddp", "hsdp"):
        argv = six_step_args(tiny_corpus, cache_dir, tmp_path / kind, kind, 4, "--checkpoint.every", "2", *NODE)
        proc = run_train([*argv, "--profiling.enable", "false"], nproc=4)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[kind] = read_metrics(tmp_path / kind)
    assert [r["loss"] for r in runs["hsdp"]] == pytest.approx([r["loss"] for r in runs["ddp"]], rel=1e-4)
    assert runs["hsdp"][-1]["val_loss"] == pytest.approx(runs["ddp"][-1]["val_loss"], rel=1e-4)

    step2 = tmp_path / "hsdp" / "checkpoint" / "step-00000002"
    argv = six_step_args(tiny_corpus, cache_dir, tmp_path / "resumed", "hsdp", 4, *NODE, "--checkpoint.load_path")
    proc = run_train([*argv, str(step2), "--profiling.enable", "false"], nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in runs["hsdp"][2:]], key


@pytest.mark.integration
@pytest.mark.slow
def test_each_rank_stores_its_shard_of_a_node():
    worker = ROOT / "tests" / "workers" / "memory_per_rank.py"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*argv, "--model.flavor", "debug", "--parallelism.data_parallel", "hsdp", *NODE],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shares = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert len(shares) == 4 and all("(0.500 of full)" in line for line in shares), proc.stdout


@pytest.mark.parametrize(
    "degree, message",
    [(3, r"shard_degree = 3 must divide the 4 data-parallel ranks.*shard_degree 2"), (-2, r"must be 0 .* positive")],
)
def test_a_shard_degree_that_cannot_shard_the_ranks_is_one_line(degree, message):
    cfg = Config()
    cfg.parallelism.data_parallel = "hsdp"
    cfg.strategy_options["hsdp"].shard_degree = degree
    with pytest.raises(UserError, match=message):
        HSDP.check_config(4, "", options=cfg.strategy_options["hsdp"])
