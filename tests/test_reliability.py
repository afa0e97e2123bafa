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
from torchacco.errors import UserError
from torchacco.faults import Faults
from torchacco.optim import ShardedAdamW
from torchacco.parallel.sharded_job import COMMIT, COMMIT_AND_PREDICT, ESTIMATE, reduce_update_gather
from torchacco.parallel.strategy import Counts


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _one_rank_flat(group, numel: int):
    """What the job uses of FlatParams, for one rank without model parallelism."""
    return SimpleNamespace(
        group=group,
        world=1,
        shard_numel=numel,
        shard=lambda full: full,
        sq_norm=lambda g: torch.linalg.vector_norm(g).double() ** 2,
        model_parallel_sum=lambda sq_norm, loss_sum: (sq_norm, loss_sum),
    )


@pytest.mark.parametrize("kind", [COMMIT, ESTIMATE, COMMIT_AND_PREDICT])
def test_a_nonfinite_gradient_leaves_theta_and_the_optimizer_state_untouched(one_rank_group, kind):
    torch.manual_seed(0)
    opt = ShardedAdamW(torch.randn(40), [(0, 40)], Optimizer(lr=1e-2))
    opt.step(torch.randn(40), 1e-2)  # non-trivial moments
    before = [t.clone() for t in (opt.state.master, opt.state.exp_avg, opt.state.exp_avg_sq)]
    flat = _one_rank_flat(one_rank_group, 40)
    grads = torch.randn(40)
    grads[7] = float("nan")
    out = torch.full((40,), 123.0)
    result = reduce_update_gather(flat, opt, grads, Counts(64.0, 5.0, 2, 64.0), lambda consumed: 1e-2, kind, out, 1.0)

    assert result.skipped and result.committed == (kind != ESTIMATE) and result.nonfinite_ranks == []
    after = (opt.state.master, opt.state.exp_avg, opt.state.exp_avg_sq)
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and opt.state.step == 1
    assert torch.equal(out, opt.state.master)  # the compute parameters go back to θ


def test_a_nonfinite_local_loss_names_its_rank(one_rank_group):
    opt = ShardedAdamW(torch.zeros(8), [], Optimizer())
    flat = _one_rank_flat(one_rank_group, 8)
    result = reduce_update_gather(
        flat, opt, torch.zeros(8), Counts(8.0, float("inf"), 1, 8.0), lambda c: 1e-3, COMMIT, torch.zeros(8), 1.0
    )
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
    proc = _run(
        tiny_corpus,
        cache_dir,
        tmp_path / "out",
        "nan@rank0:step3:period1",
        "--parallelism.data_parallel",
        "acco",
        "--training.global_batch_size",
        "16",
        "--training.on_nonfinite",
        "skip",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "out")
    assert [r["step"] for r in records] == list(range(1, 7))
    skipped = [r["step"] for r in records if r.get("skipped")]
    assert skipped == [3] and records[2]["loss"] is None and records[-1]["skipped_steps"] == 1
    assert all(r["loss"] is not None and r["loss"] < 7 for r in records if r["step"] != 3)
    assert "SKIPPED" in proc.stdout


def test_skip_policy_aborts_after_k_skips_in_a_row(tiny_corpus, cache_dir, tmp_path):
    proc = _run(
        tiny_corpus,
        cache_dir,
        tmp_path / "out",
        "nan@rank0:step2,nan@rank1:step3",
        "--parallelism.data_parallel",
        "ddp",
        "--training.on_nonfinite",
        "skip",
        "--training.max_skips_in_a_row",
        "2",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1 and "2 updates in a row had a non-finite loss or gradient (steps 2-3" in errors[0], errors
    assert [r.get("skipped") for r in read_metrics(tmp_path / "out")] == [None, True, True]


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]


def test_a_folder_holding_another_run_is_refused_unless_told(tmp_path):
    from torchacco import run_folder
    from torchacco.config import Config

    out = tmp_path / "out"
    first = Config()
    run_folder.prepare(first, out)
    (out / "checkpoint" / "step-00000002").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')

    longer = Config()
    longer.training.steps, longer.eval.every = 500, 7  # the same run, resumed for longer: allowed
    run_folder.prepare(longer, out)
    assert (out / "checkpoint" / "step-00000002").is_dir()

    other = Config()
    other.optimizer.lr, other.model.flavor = 5e-3, "tiny"
    with pytest.raises(
        UserError,
        match=r"holds a different run \(differs in model.flavor, optimizer.lr\).*"
        r"--job.overwrite true",
    ):
        run_folder.prepare(other, out)
    other.job.overwrite = True  # deletes that run's outputs: nothing of it is resumed
    run_folder.prepare(other, out)
    assert (
        sorted(p.name for p in out.iterdir()) == ["config.toml"] and "lr = 0.005" in (out / "config.toml").read_text()
    )

    stranger = tmp_path / "notes"
    stranger.mkdir()
    (stranger / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="holds no torchacco run"):
        run_folder.prepare(Config(), stranger)
    assert (stranger / "thesis.tex").read_text() == "precious"

    # A run that starts from the old run's export: overwriting would delete its own input.
    (out / "hf").mkdir()
    (out / "hf" / "config.json").write_text("{}")
    tuned = Config()
    tuned.model.init_from, tuned.job.overwrite, tuned.optimizer.lr = str(out / "hf"), True, 1e-4
    with pytest.raises(UserError, match=r"would delete \[model\] init_from = .*copy it out"):
        run_folder.prepare(tuned, out)
    assert (out / "hf" / "config.json").is_file()

    # Non-ASCII text and the like survive the round trip: the run recognises its own folder.
    named = Config()
    named.job.description = 'Schöne Grüße 🙂 "quoted"\n'
    named.data.dataset = str(tmp_path / "données")
    run_folder.prepare(named, tmp_path / "named")
    run_folder.prepare(named, tmp_path / "named")

    (out / "config.toml").write_bytes(b"\xff\xfe garbage")  # unreadable: never deleted, even when told to
    for overwrite in (False, True):
        told = Config()
        told.job.overwrite = overwrite
        with pytest.raises(UserError, match="config.toml cannot be read .*will not delete it"):
            run_folder.prepare(told, out)
    assert (out / "hf" / "config.json").is_file()


@pytest.fixture
def small_disk(tmp_path):
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode:
        pytest.skip(
            f"cannot mount a 10 MB tmpfs to fill (needs root with mount rights): {made.stderr.decode().strip()}"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)])


def test_a_full_disk_is_a_clear_error_before_training_or_at_the_checkpoint(tiny_corpus, cache_dir, small_disk):
    # The debug model (0.5M params) needs ~8 MB per checkpoint by the pre-check's estimate.
    tiny = tiny_args(
        tiny_corpus,
        cache_dir,
        small_disk / "wide",
        "--checkpoint.enable",
        "true",
        "--eval.every",
        "0",
        "--model.flavor",
        "tiny",
        "--training.steps",
        "2",
    )
    proc = run_train(tiny, nproc=1)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "GiB free but a checkpoint of this" in _errors(proc)[0] and "metrics.jsonl" not in str(
        list((small_disk / "wide").iterdir())
    )

    # The pre-check passes (10 MB free) but the second checkpoint does not fit beside the first.
    proc = run_train(
        tiny_args(
            tiny_corpus,
            cache_dir,
            small_disk / "run",
            "--checkpoint.enable",
            "true",
            "--checkpoint.every",
            "2",
            "--checkpoint.keep",
            "1",
            "--eval.every",
            "0",
            "--parallelism.data_parallel",
            "zero1",
        )
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "could not write checkpoint" in errors[0] and " MiB free on its disk" in errors[0]
    assert "step-00000002 is intact" in errors[0]
