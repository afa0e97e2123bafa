"""The CUDA side: the side-stream runner, every strategy training on a GPU (bf16, compiled or not),
the same numbers as on CPU, ACCO's job on a stream of its own in the profiler's trace, and memory
snapshots. They run where CUDA is present and are skipped, with the reason, elsewhere; each runs
in processes of its own, with the GPUs visible (conftest hides them from the rest of the suite)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAS_CUDA, ROOT, gpu_env, read_metrics, run_train, tiny_args

pytestmark = [
    pytest.mark.integration,  # every test here starts processes (docs/testing.md)
    pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA: these check the GPU paths"),
]


@pytest.mark.parametrize(
    "check",
    [
        "stream_runner_overlaps_and_orders_with_events",
        "acco_first_commit_equals_zero1",
        "top_k_messages_match_the_cpu_bit_for_bit",
        "sparse_mean_on_nccl_is_what_was_sent",
    ],
)
def test_cuda_check(check):
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "workers" / "cuda_checks.py"), check],
        capture_output=True,
        text=True,
        timeout=300,
        env=gpu_env(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))),
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _cuda_run(corpus, cache, out, kind, *extra):
    args = tiny_args(corpus, cache, out, "--parallelism.data_parallel", kind, "--training.device", "cuda", *extra)
    proc = run_train(args, nproc=1, env=gpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "fsdp", "acco", "dpu", "wp"])
def test_every_strategy_trains_on_cuda_in_bf16(tiny_corpus, cache_dir, tmp_path, kind):
    metrics = _cuda_run(tiny_corpus, cache_dir, tmp_path / kind, kind, "--training.global_batch_size", "8")
    assert len(metrics) == 6 and all(r["memory_gib"] > 0 for r in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3


@pytest.mark.parametrize(
    "kind, extra",
    [
        ("zero1", ("--model.compile", "true", "--training.activation_checkpoint", "selective")),
        ("acco", ("--model.compile", "true", "--training.loss_chunks", "4")),
        ("acco", ("--acco.mode", "adaptive", "--training.max_tokens", "3072", "--training.steps", "100")),
    ],
    ids=["zero1-compiled-selective-ac", "acco-compiled-chunked-loss", "acco-adaptive"],
)
def test_compiled_checkpointed_and_adaptive_runs_on_cuda(tiny_corpus, cache_dir, tmp_path, kind, extra):
    metrics = _cuda_run(tiny_corpus, cache_dir, tmp_path / kind, kind, "--training.global_batch_size", "8", *extra)
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3


def test_acco_on_cuda_follows_acco_on_cpu_in_fp32(tiny_corpus, cache_dir, tmp_path):
    """From the same weights (CUDA's random numbers differ from the CPU's, so both start from one
    exported model) and data, fp32 ACCO on the GPU follows the CPU run to round-off."""
    cpu_args = ("--parallelism.data_parallel", "acco", "--training.mixed_precision", "fp32")
    start = tmp_path / "start"
    once = ("--training.steps", "1", "--training.global_batch_size", "8", "--checkpoint.export_hf", "true")
    proc = run_train(tiny_args(tiny_corpus, cache_dir, start, *cpu_args, *once), nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same = ("--training.mixed_precision", "fp32", "--training.global_batch_size", "8", "--model.init_from",
            str(start / "hf"))  # fmt: skip
    gpu = _cuda_run(tiny_corpus, cache_dir, tmp_path / "gpu", "acco", *same)
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "cpu", *cpu_args, *same), nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu = read_metrics(tmp_path / "cpu")
    assert [r["loss"] for r in gpu] == pytest.approx([r["loss"] for r in cpu], rel=1e-3)


def test_acco_job_runs_on_its_own_stream_in_the_trace(tiny_corpus, cache_dir, tmp_path):
    """The profiler's trace of an ACCO update on CUDA: the job's kernels (AdamW's, NCCL's) are on
    another stream than forward/backward's, and the memory snapshot is written."""
    _cuda_run(
        tiny_corpus, cache_dir, tmp_path / "run", "acco", "--training.global_batch_size", "8",
        "--profiling.enable", "true", "--profiling.start_step", "3", "--profiling.active_steps", "2",
        "--profiling.memory_snapshot", "true",
    )  # fmt: skip
    from benchmarks.trace import overlap

    folder = tmp_path / "run" / "profile" / "rank0"
    assert (folder / "memory_step4.pickle").stat().st_size > 0
    found = overlap(folder / "trace_step4.json")
    assert found["job_kernel_ms"] > 0 and found["compute_kernel_ms"] > 0, found
    assert not set(found["job_streams"]) & set(found["compute_streams"]), found
