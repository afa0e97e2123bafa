"""Non-finite losses and gradients: every rank skips or aborts together; skipped updates leave θ as it was.

Lost workers (automatic restart and exact recovery) are tested with the resume tests in
test_checkpoint.py; stalled ranks in test_cli.py.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import read_metrics, run_train, tiny_args
from torchacco.config import Optimizer
from torchacco.faults import Faults
from torchacco.errors import UserError
from torchacco.optim import ShardedAdamW
from torchacco.parallel.sharded import COMMIT, COMMIT_AND_PREDICT, ESTIMATE, reduce_update_gather


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", [COMMIT, ESTIMATE, COMMIT_AND_PREDICT])
def test_a_nonfinite_gradient_leaves_theta_and_the_optimizer_state_untouched(one_rank_group, kind):
    torch.manual_seed(0)
    opt = ShardedAdamW(torch.randn(40), [(0, 40)], Optimizer(lr=1e-2))
    opt.step(torch.randn(40), 1e-2)  # non-trivial moments
    before = [t.clone() for t in (opt.state.master, opt.state.exp_avg, opt.state.exp_avg_sq)]
    flat = SimpleNamespace(group=one_rank_group, world=1, shard_numel=40)
    grads = torch.randn(40)
    grads[7] = float("nan")
    out = torch.full((40,), 123.0)
    result = reduce_update_gather(flat, opt, grads, (64.0, 5.0, 2, 64.0), lambda consumed: 1e-2, kind, out, 1.0)

    assert result.skipped and result.committed == (kind != ESTIMATE) and result.nonfinite_ranks == []
    after = (opt.state.master, opt.state.exp_avg, opt.state.exp_avg_sq)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and opt.state.step == 1
    assert torch.equal(out, opt.state.master)  # the compute parameters go back to θ


def test_a_nonfinite_local_loss_names_its_rank(one_rank_group):
    opt = ShardedAdamW(torch.zeros(8), [], Optimizer())
    flat = SimpleNamespace(group=one_rank_group, world=1, shard_numel=8)
    result = reduce_update_gather(flat, opt, torch.zeros(8), (8.0, float("inf"), 1, 8.0), lambda c: 1e-3, COMMIT,
                                  torch.zeros(8), 1.0)
    assert result.skipped and result.nonfinite_ranks == [0]


def test_fault_specs_parse_and_fire_on_the_first_attempt_only():
    faults = Faults("nan@rank1:step3:period2, nan@rank0:step9", rank=1, attempt=0)
    assert [faults.before_period(s) for s in (1, 2, 3, 3, 4)] == [False, False, False, True, False]
    assert not any(Faults("nan@rank1:step1", rank=1, attempt=1).before_period(1) for _ in range(2))
    with pytest.raises(UserError, match="cannot parse 'explode@rank1'"):
        Faults("explode@rank1", rank=0, attempt=0)


def _run(corpus, cache, out, fault, *extra):
    return run_train(tiny_args(corpus, cache, out, "--eval.every", "0", *extra), env={"TORCHACCO_FAULT": fault})


def test_abort_policy_stops_at_the_step_naming_the_rank(tiny_corpus, cache_dir, tmp_path):
    proc = _run(tiny_corpus, cache_dir, tmp_path / "out", "nan@rank1:step3", "--parallelism.data_parallel", "zero1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "non-finite loss or gradient at step 3 (from the loss of rank(s) 1" in errors[0]
    assert "on_nonfinite = 'skip'" in errors[0]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]  # the failing step is logged


def test_acco_skips_a_nonfinite_estimate_and_its_commit_then_trains_on(tiny_corpus, cache_dir, tmp_path):
    # NaN in the first period of step 3 only: the estimate is skipped (θ̃ = θ) and so is the
    # commit that sums that period's gradients; training goes on from an unchanged θ.
    proc = _run(tiny_corpus, cache_dir, tmp_path / "out", "nan@rank0:step3:period1", "--parallelism.data_parallel",
                "acco", "--training.global_batch_size", "16", "--training.on_nonfinite", "skip")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == list(range(1, 7))
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped == [3] and records[2]["loss"] is None and records[-1]["skipped_steps"] == 1
    assert all(r["loss"] is not None and r["loss"] < 7 for r in records if r["step"] != 3)
    assert "SKIPPED" in proc.stdout


def test_skip_policy_aborts_after_k_skips_in_a_row(tiny_corpus, cache_dir, tmp_path):
    proc = _run(tiny_corpus, cache_dir, tmp_path / "out", "nan@rank0:step2,nan@rank1:step3",
                "--parallelism.data_parallel", "ddp", "--training.on_nonfinite", "skip",
                "--training.max_skips_in_a_row", "2")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1 and "2 updates in a row had a non-finite loss or gradient (steps 2-3" in errors[0], errors
    assert [r.get("skipped") for r in read_metrics(tmp_path / "out")] == [None, True, True]
