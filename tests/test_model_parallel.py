"""Tensor and pipeline parallelism: the same losses as one process, less memory per rank,
checkpoints and exports that work, and one clear line for every unsupported setting.

Runs are tiny (3 steps, seq 32) and fp32; the flat strategies (zero1, acco) run in
deterministic mode, so a model-parallel run must follow the 1-process run's losses to fp32
round-off (the sums run in another order)."""

import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics, run_train, tiny_args
from torchacco.validate import main as validate

STEPS = 3


def _args(corpus, cache, out, kind, *extra):
    return tiny_args(corpus, cache, out, "--parallelism.data_parallel", kind, "--training.global_batch_size", "16",
                     "--training.seq_len", "32", "--training.steps", str(STEPS), "--eval.every", str(STEPS),
                     "--eval.batches", "1", "--checkpoint.export_hf", "true", *extra)


LLAMA = ("--model.name", "llama3", "--model.flavor", "debug")


@pytest.fixture(scope="module")
def runs(tiny_corpus, cache_dir, tmp_path_factory):
    """name -> (metrics, stdout, output folder), run on first use."""
    done = {}

    def get(name, nproc, kind, *extra):
        if name not in done:
            out = tmp_path_factory.mktemp(name)
            proc = run_train(_args(tiny_corpus, cache_dir, out, kind, *extra), nproc=nproc)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[name] = (read_metrics(out), proc.stdout, out)
        return done[name]

    return get


def _same_losses(run, reference):
    losses, expected = [r["loss"] for r in run[0]], [r["loss"] for r in reference[0]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert run[0][-1]["val_loss"] == pytest.approx(reference[0][-1]["val_loss"], rel=1e-5)


def _same_export(run, reference):
    ours, theirs = load_file(run[2] / "hf" / "model.safetensors"), load_file(reference[2] / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


def _params_on_rank0(run) -> float:
    return float(re.search(r"\(([\d.]+)M params on rank 0\)", run[1]).group(1))


def _full_params(run) -> float:
    return float(re.search(r" ([\d.]+)M params \|", run[1]).group(1))


@pytest.mark.parametrize("kind", ["zero1", "acco"])
def test_tensor_parallel_2_and_2x2_with_data_parallel_match_one_process(runs, kind):
    """GPT-Neo (tied head, local attention): tp = 2 on 2 ranks and tp = 2 × dp = 2 on 4."""
    reference = runs(f"neo-{kind}", 1, kind)
    tp2 = runs(f"neo-{kind}-tp2", 2, kind, "--parallelism.tensor_parallel_degree", "2")
    tp2dp2 = runs(f"neo-{kind}-tp2dp2", 4, kind, "--parallelism.tensor_parallel_degree", "2")
    for run in (tp2, tp2dp2):
        _same_losses(run, reference)
        _same_export(run, reference)
    assert f"{kind} × 2 × tp 2 × pp 1" in tp2dp2[1]
    # Every weight matrix, the embeddings and the biases of split layers are halved; only
    # the norms and the row-split layers' biases stay whole.
    assert _params_on_rank0(tp2) < 0.51 * _full_params(tp2)


def test_fsdp_with_tensor_parallel_matches_zero1_on_one_process(runs):
    _same_losses(runs("neo-fsdp-tp2", 2, "fsdp", "--parallelism.tensor_parallel_degree", "2"), runs("neo-zero1", 1, "zero1"))


@pytest.mark.parametrize("kind, schedule", [("zero1", "1f1b"), ("acco", "gpipe")])
def test_pipeline_parallel_2_stages_matches_one_process(runs, kind, schedule):
    reference = runs(f"llama-{kind}", 1, kind, *LLAMA)
    pp2 = runs(f"llama-{kind}-pp2", 2, kind, *LLAMA, "--parallelism.pipeline_parallel_degree", "2",
               "--parallelism.pipeline_schedule", schedule)
    _same_losses(pp2, reference)
    _same_export(pp2, reference)
    # Stage 0 holds the embedding and 3 of the 6 blocks; the head and the others are on stage 1.
    assert _params_on_rank0(pp2) < 0.6 * _full_params(pp2)


def test_acco_over_tensor_and_interleaved_pipeline_parallel_matches_one_process(runs):
    reference = runs("llama-acco", 1, "acco", *LLAMA)
    tp2pp2 = runs("llama-acco-tp2pp2", 4, "acco", *LLAMA, "--parallelism.tensor_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_schedule", "interleaved_1f1b")
    _same_losses(tp2pp2, reference)
    _same_export(tp2pp2, reference)
    assert _params_on_rank0(tp2pp2) < 0.3 * _full_params(tp2pp2)


def test_acco_with_tensor_parallel_resumes_bit_for_bit(tiny_corpus, cache_dir, tmp_path):
    def train(steps):
        proc = run_train(_args(tiny_corpus, cache_dir, tmp_path / "run", "acco", "--training.steps", str(steps),
                               "--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "true",
                               "--training.max_tokens", str(4 * 16 * 32), "--checkpoint.export_hf", "false"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    train(2)
    resumed = train(4)
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    full_dir = tmp_path / "full"
    proc = run_train(_args(tiny_corpus, cache_dir, full_dir, "acco", "--training.steps", "4",
                           "--parallelism.tensor_parallel_degree", "2", "--training.max_tokens", str(4 * 16 * 32),
                           "--checkpoint.export_hf", "false"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in read_metrics(tmp_path / "run")] == [r["loss"] for r in read_metrics(full_dir)]


@pytest.mark.parametrize("world, extra, words", [
    pytest.param(4, ["--parallelism.tensor_parallel_degree", "3"], ["4 ranks", "not divisible", "3 × 1"],
                 id="degrees-do-not-divide-world"),
    pytest.param(2, ["--parallelism.tensor_parallel_degree", "0"], ["tensor_parallel_degree must be at least 1"],
                 id="zero-degree"),
    pytest.param(8, ["--parallelism.tensor_parallel_degree", "8"], ["n_heads = 4", "not divisible", "= 8"],
                 id="heads-not-divisible"),
    pytest.param(2, ["--parallelism.tensor_parallel_degree", "2", "--model.vocab_size", "401"],
                 ["vocab_size = 401", "not divisible", "vocab_size to a multiple of 2", "402"], id="vocab-not-divisible"),
    pytest.param(3, [*LLAMA, "--parallelism.tensor_parallel_degree", "3"], ["n_kv_heads = 2", "not divisible"],
                 id="kv-heads-not-divisible"),
    pytest.param(8, [*LLAMA, "--parallelism.pipeline_parallel_degree", "8"], ["6 layers", "fewer than the 8"],
                 id="fewer-layers-than-stages"),
    pytest.param(2, ["--parallelism.pipeline_parallel_degree", "2"], ["pipeline parallelism", "tied", "not supported"],
                 id="pipeline-with-tied-head"),
    pytest.param(2, [*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_microbatches",
                     "3"], ["local_batch_size = 4", "pipeline_microbatches = 3"], id="microbatches-do-not-divide"),
    pytest.param(2, [*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_microbatches",
                     "1"], ["1f1b needs at least", "gpipe"], id="1f1b-too-few-microbatches"),
    pytest.param(2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel", "ddp"],
                 ["'ddp' with tp=2 is not supported", "zero1"], id="ddp-with-tp"),
    pytest.param(2, [*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel", "fsdp"],
                 ["'fsdp' with pipeline_parallel_degree > 1 is not supported", "zero1"], id="fsdp-with-pp"),
    pytest.param(2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel", "acco",
                     "--acco.mode", "adaptive", "--training.max_tokens", "10000"],
                 ["adaptive", "tp=2", "not supported", "deterministic"], id="adaptive-with-tp"),
    pytest.param(4, ["--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "12"],
                 ["global_batch_size = 12", "4 × 2 = 8"], id="global-batch-counts-dp-ranks-only"),
])
def test_bad_model_parallel_setting_is_one_line_before_launch(world, extra, words, tiny_corpus, cache_dir, tmp_path,
                                                              monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert validate(tiny_args(tiny_corpus, cache_dir, tmp_path, "--parallelism.data_parallel", "zero1", *extra)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchacco: error:"), lines
    for word in words:
        assert word in lines[0], (word, lines[0])
