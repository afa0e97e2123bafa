"""Checkpoints: exact resume, resharding across world sizes, atomic saves, clear errors."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FSDP_ASYNC, ROOT, read_metrics, run_train, six_step_args, tiny_args
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchacco.checkpoint import step_dirs
from torchacco.parallel.strategy import Counts

args = six_step_args
REPLICAS_2 = ("--parallelism.replicas", "2")
STREAMING = [*REPLICAS_2, *"--diloco.sync_every 4 --diloco.fragments 2 --diloco.overlap_steps 1".split()]
STREAMING += "--diloco.mixing 0.5 --diloco.outer_dtype bf16".split()


@pytest.fixture(scope="module")
def zero1_run(tiny_corpus, cache_dir, tmp_path_factory) -> Path:
    """A finished 3-step zero1 run with checkpoints at steps 2 and 3 (every 1, keep 2), shared by
    the tests below that read it; a test that writes into it works on its own copy."""
    run = tmp_path_factory.mktemp("zero1") / "run"
    proc = run_train(args(tiny_corpus, cache_dir, run, "zero1", 3, "--checkpoint.every", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


SLOW = pytest.mark.slow


@pytest.mark.integration
@pytest.mark.parametrize(
    "kind, extra",
    [
        # these three lose a worker and wait for torchrun's restart: the faults pass (docs/testing.md)
        pytest.param("ddp", [], marks=pytest.mark.faults),
        pytest.param("zero1", [], marks=pytest.mark.faults),
        pytest.param("acco", [], marks=pytest.mark.faults),
        # the rest but Streaming DiLoCo over ACCO (which covers the most state) in the slow pass, for the default's time
        pytest.param("fsdp", FSDP_ASYNC, marks=SLOW),
        pytest.param("dpu", ["--acco.dpu_warmup_steps", "4"], marks=SLOW),  # resumed inside the synchronous warm-up
        pytest.param("wp", [], marks=SLOW),  # the compute parameters are a prediction, not θ
        # the last commit's norm clips the next estimate: state too (a low max_norm keeps clipping active)
        pytest.param("acco", ["--acco.estimate_clip", "commit", "--training.max_norm", "0.05"], marks=SLOW),
        # Streaming DiLoCo over ACCO: fragment 1's all-reduce is in flight at the step-3 checkpoint
        ("acco", STREAMING),
        pytest.param(
            "zero1",
            [*REPLICAS_2, *"--diloco.sync_every 2 --diloco.outer_dtype int8 --diloco.offload 1".split()],
            marks=SLOW,
        ),  # fmt: skip
        # eager: θ̂ of the fragment in flight is state too
        pytest.param("ddp", [*STREAMING[:-4], "--diloco.eager", "true"], marks=SLOW),
        # top-k: the residuals are state, and the one of the fragment in flight has taken its transfer's share
        pytest.param(
            "zero1",
            [*STREAMING[:-4], *"--diloco.topk 0.05 --diloco.outer_dtype int2 --diloco.offload 1".split()],
            marks=SLOW,
        ),  # fmt: skip
        # QSR: the next outer step's update, grown from the learning rate, is state too
        pytest.param("ddp", [*REPLICAS_2, *"--diloco.sync_every 2 --diloco.sync_every_max 8".split()], marks=SLOW),
        # the outer momentum's decay: the peak learning rate is state too
        pytest.param(
            "ddp", [*REPLICAS_2, *"--diloco.sync_every 2 --diloco.outer_momentum_decay true".split()], marks=SLOW
        ),  # fmt: skip
        # the slow moment: torch-optimizer state on DTensors (FSDP), and sharded state inside DiLoCo (ZeRO-1)
        pytest.param("fsdp", ["--optimizer.slow_beta", "0.99"], marks=SLOW),
        pytest.param("zero1", [*REPLICAS_2, *"--diloco.sync_every 2 --optimizer.slow_beta 0.99".split()], marks=SLOW),
    ],
    ids=[
        "ddp",
        "zero1",
        "acco",
        "fsdp-async",
        "dpu-warmup",
        "wp",
        "acco-estimate-clipped-by-commit",
        "diloco-acco-streaming",
        "diloco-zero1-int8",
        "diloco-ddp-eager",
        "diloco-zero1-topk-int2",
        "diloco-ddp-qsr",
        "diloco-ddp-momentum-decay",
        "fsdp-slow-momentum",
        "diloco-zero1-slow-momentum",
    ],
)
@pytest.mark.exact
def test_resume_gives_the_same_losses_bit_for_bit(tiny_corpus, cache_dir, tmp_path, six_step_run, kind, extra):
    full = six_step_run(kind, *extra)
    expected = read_metrics(full)
    if kind in ("ddp", "zero1", "acco") and not extra:
        # These resume after a lost worker (torchrun restarts them, and they resume from their own
        # folder); the other variants resume from the full run's step-3 checkpoint, in a new folder.
        return _killed_worker_recovers(tiny_corpus, cache_dir, tmp_path, kind, expected, full)
    step3 = full / "checkpoint" / "step-00000003"
    resumed = run_train(
        args(tiny_corpus, cache_dir, tmp_path / "resumed", kind, 6, *extra, "--checkpoint.load_path", str(step3))
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout

    records = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in records] == [4, 5, 6]
    for key in ("loss", "lr", "tokens", "grad_norm"):
        assert [r[key] for r in records] == [r[key] for r in expected[3:]], key
    assert records[-1]["val_loss"] == expected[-1]["val_loss"]


@pytest.mark.exact
def test_counts_restored_as_python_floats_keep_every_float64_bit():
    """An overlapped schedule's checkpoint holds the counts behind its accumulator; restored, they
    are Python floats. A float64 loss sum (two float32 micro-batch losses added) must reach the
    job unrounded, or the first resumed update reports another loss (SIMD-dependent by chance)."""
    loss_sum = 2812.8292236328125  # float64, not a float32 value
    assert torch.tensor(loss_sum, dtype=torch.float32).item() != loss_sum
    restored = Counts(512.0, loss_sum, 2, 512.0)
    assert restored.as_tensor("cpu")[1].item() == loss_sum
    assert Counts(2.0**24 + 1, 0.0).as_tensor("cpu")[0].item() == 2.0**24 + 1  # token counts past float32's


def _killed_worker_recovers(corpus, cache, tmp_path, kind, expected, full):
    """Rank 1 is SIGKILLed as it starts step 5; torchrun restarts both workers, which resume from
    the step-3 checkpoint by themselves and end exactly where the uninterrupted run did. zero1
    loses a worker twice: rank 1 at step 2 (before any checkpoint), then, on the restarted
    attempt, rank 0 at step 5 (a fault fires at any step, whichever attempt reaches it first)."""
    faults = {"zero1": {2: 1, 5: 0}}.get(kind, {5: 1})  # step -> the rank killed there
    proc = run_train(
        args(corpus, cache, tmp_path / "killed", kind, 6, "--checkpoint.every", "3"),
        env={
            "MAX_RESTARTS": str(len(faults)),
            "TORCHACCO_FAULT": ",".join(f"kill@rank{rank}:step{step}" for step, rank in faults.items()),
        },
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    for step, rank in faults.items():
        assert f"rank {rank} stopped responding in compute (step {step})" in proc.stderr, proc.stderr[-3000:]
    recovered = read_metrics(tmp_path / "killed")
    assert [r["step"] for r in recovered] == list(range(1, 7))
    for key in ("loss", "lr", "tokens", "grad_norm"):
        assert [r[key] for r in recovered] == [r[key] for r in expected], key
    assert recovered[-1]["val_loss"] == expected[-1]["val_loss"]
    final = [
        _tensors(_logical_state(step_dirs(run / "checkpoint")[-1][1], tmp_path / f"{run.name}.pt")["dp"])
        for run in (full, tmp_path / "killed")
    ]
    assert final[0].keys() == final[1].keys() and final[0]
    for name, tensor in final[0].items():
        assert torch.equal(tensor, final[1][name]), name


def _logical_state(checkpoint: Path, out: Path) -> dict:
    """The checkpoint's tensors as full (unsharded) tensors, read without any process group."""
    dcp_to_torch_save(checkpoint, out)
    return torch.load(out, weights_only=False)


def reshard(run_dir: Path, checkpoint: Path, out: Path, nproc: int) -> Path:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            str(ROOT / "tests" / "workers" / "reshard_worker.py"),
            str(run_dir),
            str(checkpoint),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return step_dirs(out)[-1][1]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["zero1", "fsdp"])
@pytest.mark.slow
def test_checkpoint_reshards_from_2_ranks_to_1_and_back(tiny_corpus, cache_dir, tmp_path, kind, request):
    if kind == "zero1":
        run = request.getfixturevalue("zero1_run")
    else:
        run = tmp_path / "run"
        assert run_train(args(tiny_corpus, cache_dir, run, kind, 3)).returncode == 0
    two = step_dirs(run / "checkpoint")[-1][1]
    one = reshard(run, two, tmp_path / "one", nproc=1)  # 2 ranks -> 1
    back = reshard(run, one, tmp_path / "back", nproc=2)  # 1 rank -> 2

    states = [
        _tensors(_logical_state(c, tmp_path / f"{name}.pt")["dp"]) for c, name in ((two, "a"), (one, "b"), (back, "c"))
    ]
    assert states[0].keys() == states[1].keys() == states[2].keys()
    assert any("exp_avg_sq" in k for k in states[0]) and len(states[0]) >= 3  # weights and optimizer moments
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]) and torch.equal(tensor, states[2][name]), name


@pytest.mark.integration
def test_resume_on_a_different_number_of_ranks_continues_training(tiny_corpus, cache_dir, tmp_path, zero1_run):
    run = shutil.copytree(zero1_run, tmp_path / "run")
    proc = run_train(args(tiny_corpus, cache_dir, run, "zero1", 5, "--training.global_batch_size", "8"), nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data-parallel ranks changed (2 -> 1)" in proc.stdout
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]


def _tensors(tree, prefix="") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[prefix + key] = value
    return out


@pytest.mark.integration
def test_keeps_the_last_k_and_ignores_unfinished_saves(tiny_corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint" / "step-00000099.tmp").mkdir(parents=True)  # a save that crashed
    proc = run_train(
        args(
            tiny_corpus,
            cache_dir,
            out,
            "zero1",
            5,
            "--checkpoint.every",
            "1",
            "--checkpoint.keep",
            "2",
            "--job.overwrite",
            "true",
        )
    )  # the folder holds no config.toml
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in (out / "checkpoint").iterdir())
    assert names == ["step-00000004", "step-00000005"]  # the crashed .tmp was not resumed from, and is gone
    assert "resumed" not in proc.stdout


@pytest.mark.integration
@pytest.mark.parametrize(
    "other", [["--model.flavor", "tiny"], ["--optimizer.slow_beta", "0.99"]], ids=["model", "slow"]
)
def test_resuming_another_models_checkpoint_is_one_clear_error(tiny_corpus, cache_dir, tmp_path, zero1_run, other):
    # (Into the same folder, the dump-folder check refuses first: test_reliability.py.)
    checkpoint = str(zero1_run / "checkpoint" / "step-00000002")
    proc = run_train(
        args(tiny_corpus, cache_dir, tmp_path / "other", "zero1", 4, *other, "--checkpoint.load_path", checkpoint)
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1 and "does not match this run's model, optimizer" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.integration
@pytest.mark.slow  # several whole runs
def test_acco_checkpoint_resumes_only_on_the_same_world_size(tiny_corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    assert run_train(args(tiny_corpus, cache_dir, out, "acco", 2)).returncode == 0
    proc = run_train(
        args(
            tiny_corpus,
            cache_dir,
            tmp_path / "one",
            "acco",
            4,
            "--training.global_batch_size",
            "8",
            "--checkpoint.load_path",
            str(step_dirs(out / "checkpoint")[-1][1]),
        ),
        nproc=1,
    )
    assert proc.returncode != 0
    assert "resume it on 2 ranks" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.integration
@pytest.mark.slow  # several whole runs
def test_corrupted_checkpoint_is_a_clear_error_naming_an_earlier_one(tiny_corpus, cache_dir, tmp_path, zero1_run):
    out = shutil.copytree(zero1_run, tmp_path / "run")
    first, latest = [p for _, p in step_dirs(out / "checkpoint")]
    for shard in latest.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])  # a torn write
    proc = run_train(args(tiny_corpus, cache_dir, out, "zero1", 4))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1 and "may be corrupted" in errors[0] and f"--checkpoint.load_path {first}" in errors[0]
    proc = run_train(args(tiny_corpus, cache_dir, out, "zero1", 4, "--checkpoint.load_path", str(first)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "at step 2" in proc.stdout


def test_an_asynchronous_save_stages_a_host_copy_that_training_cannot_change():
    from torchacco.checkpoint import HostStaging

    class Counter:  # a Stateful, as the data loader is
        position = 7

        def state_dict(self):
            return {"position": self.position}

        def load_state_dict(self, state):
            pass

    weights = torch.arange(6.0)
    state = {"model": {"w": weights, "steps": [torch.tensor(3)]}, "loader": Counter()}
    staging = HostStaging()
    staged = staging.stage(state)
    weights += 100  # training goes on while the save is written
    assert torch.equal(staged["model"]["w"], torch.arange(6.0)) and staged["loader"] == {"position": 7}
    assert staged["model"]["steps"][0].item() == 3
    state["loader"].position = 8
    again = staging.stage(state)
    assert again["model"]["w"] is staged["model"]["w"]  # the host buffers are reused
    assert torch.equal(again["model"]["w"], torch.arange(6.0) + 100) and again["loader"] == {"position": 8}


def test_an_asynchronous_save_writes_its_one_host_copy(tmp_path, monkeypatch):
    """DCP writes the very tensors `HostStaging` copied: the host holds one copy of the state (DCP's default stager
    would copy it again), of the bytes `staging_bytes` says."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    from torchacco.checkpoint import Checkpointer, staging_bytes, tensor_leaves

    written, write_data = [], FileSystemWriter.write_data

    def spy(self, plan, planner):
        written.extend(t.untyped_storage().data_ptr() for _, t in tensor_leaves(planner.state_dict))
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", spy)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        checkpointer = Checkpointer(tmp_path, 0, keep=2, async_save=True)
        state = {"model": {"w": torch.randn(1000), "b": torch.randn(10)}}
        checkpointer.save(1, state)
        checkpointer.wait()
        staged = [t for _, t in tensor_leaves(checkpointer.staging.staged)]
        assert written and set(written) <= {t.untyped_storage().data_ptr() for t in staged}
        assert sum(t.nbytes for t in staged) == staging_bytes(state) == 1010 * 4
        loaded = {"model": {"w": torch.zeros(1000), "b": torch.zeros(10)}}
        checkpointer.load(tmp_path / "step-00000001", loaded)
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        checkpointer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ddp", "acco"])
def test_the_free_space_check_expects_the_bytes_a_checkpoint_writes(tiny_corpus, cache_dir, tmp_path, kind):
    """From the strategy's own state: ACCO's checkpoint is twice DDP's, which a bytes-per-parameter rule misses. An
    asynchronous save's host copy: each rank's own state (DDP's: all of it, which DCP writes once)."""
    out = tmp_path / kind
    args = tiny_args(tiny_corpus, cache_dir, out, "--checkpoint.enable", "true", "--training.steps", "1")
    proc = run_train([*args, "--parallelism.data_parallel", kind, "--training.global_batch_size", "16",
                      "--checkpoint.async_save", "true"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    said = float(re.search(r"a checkpoint takes about ([\d,.]+) MiB", log)[1].replace(",", ""))
    written = sum(f.stat().st_size for f in (out / "checkpoint").rglob("*") if f.is_file()) / 2**20
    assert abs(said - written) <= 0.1 * written, (said, written)  # (the rest: DCP's metadata, RNG states)
    host, node = re.search(
        r"holds about ([\d.]+) MiB of host memory per rank, ([\d.]+) MiB on a node of 2", log
    ).groups()
    assert float(node) == pytest.approx(2 * float(host), abs=0.1)
    assert float(host) == pytest.approx(said, rel=0.1) if kind == "ddp" else float(host) < said
