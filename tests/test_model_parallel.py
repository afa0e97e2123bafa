"""Tensor and pipeline parallelism: the same losses as one process, less memory per rank,
checkpoints and exports that work, and one clear line for every unsupported setting.

Runs are tiny (3 steps, seq 32) and fp32; the flat strategies (zero1, acco) run in
deterministic mode, so a model-parallel run must follow the 1-process run's losses to fp32
round-off (the sums run in another order)."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from conftest import ROOT, read_metrics, tiny_args
from safetensors.torch import load_file

from torchacco.validate import main as validate

STEPS = 3


def _args(corpus, cache, out, kind, *extra):
    # The schedule length comes from max_tokens, so a run stopped early (resume test) has the same lr.
    return tiny_args(
        corpus,
        cache,
        out,
        "--parallelism.data_parallel",
        kind,
        "--training.global_batch_size",
        "16",
        "--training.seq_len",
        "32",
        "--training.steps",
        str(STEPS),
        "--eval.every",
        str(STEPS),
        "--eval.batches",
        "1",
        "--checkpoint.export_hf",
        "true",
        "--training.max_tokens",
        str(STEPS * 16 * 32),
        *extra,
    )


LLAMA = ("--model.name", "llama3", "--model.flavor", "debug")
AC_FULL = ("--training.activation_checkpoint", "full", "--training.loss_chunks", "4")
AC_OP = ("--training.activation_checkpoint", "selective", "--training.loss_chunks", "2")
AC_EVERY_2 = ("--training.activation_checkpoint", "selective", "--training.selective_checkpoint", "2")
# A model from outside torchacco: tests/assets/toy_model copied into a package of the runs' folder.
TOY = ("--model.name", "toy_pkg.toy", "--checkpoint.export_hf", "false")
# A collective timeout of its own, which every group of the run must carry (the collective-order test)
ORDER_TIMEOUT_S = 1234
ORDER_TIMEOUT = ("--training.collective_timeout_s", str(ORDER_TIMEOUT_S))
TP2_CHECKPOINTED = ("--parallelism.tensor_parallel_degree", "2", "--checkpoint.enable", "true")


# name -> (ranks, strategy, extra arguments). Each world size's runs share one launch.
RUNS = {
    "neo-zero1": (1, "zero1", ()),
    "neo-acco": (1, "acco", ()),
    "llama-zero1": (1, "zero1", LLAMA),
    "llama-acco": (1, "acco", LLAMA),
    "neo-dpu": (1, "dpu", ()),
    "llama-wp": (1, "wp", LLAMA),
    "neo-acco-tp2": (2, "acco", TP2_CHECKPOINTED),
    "neo-fsdp-tp2": (2, "fsdp", ("--parallelism.tensor_parallel_degree", "2")),
    "llama-zero1-pp2": (2, "zero1", (*LLAMA, "--parallelism.pipeline_parallel_degree", "2")),  # 1f1b
    "llama-acco-pp2": (
        2,
        "acco",
        (*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_schedule", "gpipe"),
    ),
    "neo-dpu-tp2": (2, "dpu", ("--parallelism.tensor_parallel_degree", "2", "--parallelism.loss_parallel", "false")),
    # activation checkpointing and the chunked loss, under each kind of model parallelism
    "neo-zero1-tp2-ac": (2, "zero1", ("--parallelism.tensor_parallel_degree", "2", *AC_FULL)),
    "llama-acco-pp2-ac": (
        2,
        "acco",
        (*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_schedule", "gpipe", *AC_OP),
    ),
    "llama-fsdp-tp2-ac": (2, "fsdp", (*LLAMA, "--parallelism.tensor_parallel_degree", "2", *AC_EVERY_2)),
    "llama-wp-pp2": (2, "wp", (*LLAMA, "--parallelism.pipeline_parallel_degree", "2")),
    # the resume test: 2 steps, then on to STEPS from the checkpoint (same folder)
    "resumed": (2, "acco", (*TP2_CHECKPOINTED, "--training.steps", "2")),
    "resumed ": (2, "acco", TP2_CHECKPOINTED),
    # resuming with another pipeline schedule: same buffer sizes, other layers on each rank
    "relayout": (
        2,
        "zero1",
        (*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--training.steps", "1", "--checkpoint.enable", "true"),
    ),
    "relayout-other": (
        2,
        "zero1",
        (
            *LLAMA,
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--checkpoint.enable",
            "true",
            "--parallelism.pipeline_schedule",
            "interleaved_1f1b",
            "--checkpoint.load_path",
            "{root}/relayout/checkpoint/step-00000001",
        ),
    ),
    "tp2-for-reshard": (
        2,
        "zero1",
        ("--parallelism.tensor_parallel_degree", "2", "--training.steps", "1", "--checkpoint.enable", "true"),
    ),
    "toy-zero1": (1, "zero1", TOY),
    "toy-zero1-tp2": (2, "zero1", (*TOY, "--parallelism.tensor_parallel_degree", "2")),
    "neo-zero1-tp2dp2": (4, "zero1", ("--parallelism.tensor_parallel_degree", "2")),
    "resharded": (
        4,
        "zero1",
        (
            "--parallelism.tensor_parallel_degree",
            "2",
            "--checkpoint.enable",
            "true",
            "--checkpoint.load_path",
            "{root}/tp2-for-reshard/checkpoint/step-00000001",
        ),
    ),
    "neo-acco-tp2dp2": (4, "acco", ("--parallelism.tensor_parallel_degree", "2", *ORDER_TIMEOUT)),
    "llama-fsdp-pp2dp2": (4, "fsdp", (*LLAMA, "--parallelism.pipeline_parallel_degree", "2")),
    "llama-acco-tp2pp2": (
        4,
        "acco",
        (
            *LLAMA,
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_schedule",
            "interleaved_1f1b",
            *ORDER_TIMEOUT,
        ),
    ),
}


@pytest.fixture(scope="module")
def runs(tiny_corpus, cache_dir, tmp_path_factory):
    """name -> (metrics, stdout, output folder), all trained up front: one launch per world size."""
    root = tmp_path_factory.mktemp("model_parallel")
    shutil.copytree(ROOT / "tests" / "assets" / "toy_model", root / "toy_pkg" / "toy")
    (root / "toy_pkg" / "__init__.py").write_text("")
    for nproc in (1, 2, 4):
        argvs = [
            _args(tiny_corpus, cache_dir, root / name.strip(), kind, *(a.format(root=root) for a in extra))
            for name, (n, kind, extra) in RUNS.items()
            if n == nproc
        ]
        (root / f"runs{nproc}.json").write_text(json.dumps(argvs))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(root)]), "OMP_NUM_THREADS": "1"}
        env["TORCH_FR_BUFFER_SIZE"] = "200000"  # the worker logs every collective (collectives_rank<r>.json)
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                str(nproc),
                str(ROOT / "tests" / "workers" / "model_parallel_worker.py"),
                str(root / f"runs{nproc}.json"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for name in RUNS:
        folder = root / name.strip()
        metrics = read_metrics(folder) if (folder / "metrics.jsonl").exists() else []
        out[name.strip()] = (metrics, (folder / "stdout.txt").read_text(), folder)
    return out


def _same_losses(run, reference):
    losses, expected = [r["loss"] for r in run[0]], [r["loss"] for r in reference[0]]
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-5)
    if " × 1 × tp" in run[1]:  # validation batches are per data-parallel rank: same data only for dp = 1
        assert run[0][-1]["val_loss"] == pytest.approx(reference[0][-1]["val_loss"], rel=1e-5)


def _same_export(run, reference):
    ours, theirs = load_file(run[2] / "hf" / "model.safetensors"), load_file(reference[2] / "hf" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        # Adam turns round-off in near-zero gradients into up to ±lr steps (1e-3) for a few
        # elements; a wrong layout would be off by the weights' own scale (0.02).
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=2e-4, msg=name)


def _params_on_rank0(run) -> float:
    return float(re.search(r"\(([\d.]+)M params on rank 0\)", run[1]).group(1))


def _full_params(run) -> float:
    return float(re.search(r" ([\d.]+)M params \|", run[1]).group(1))


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize("kind", ["zero1", "acco"])
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_tensor_parallel_2_and_2x2_with_data_parallel_match_one_process(runs, kind):
    """GPT-Neo (tied head, local attention): tp = 2 on 2 ranks and tp = 2 × dp = 2 on 4."""
    reference, tp2dp2 = runs[f"neo-{kind}"], runs[f"neo-{kind}-tp2dp2"]
    checked = [tp2dp2]
    if kind == "acco":  # tp alone, on 2 ranks (its checkpoint is the resume test's reference)
        checked.append(runs["neo-acco-tp2"])
    for run in checked:
        _same_losses(run, reference)
        _same_export(run, reference)
        # Every weight matrix, the embeddings and the biases of split layers are halved; only
        # the norms and the row-split layers' biases stay whole.
        assert _params_on_rank0(run) < 0.51 * _full_params(run)
    assert f"{kind} × 2 × tp 2 × pp 1" in tp2dp2[1]


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_dpu_and_wp_with_tensor_or_pipeline_parallel_match_one_process(runs):
    """The other overlapped schedules share ACCO's buffers and job, so they compose alike."""
    _same_losses(runs["neo-dpu-tp2"], runs["neo-dpu"])
    _same_export(runs["neo-dpu-tp2"], runs["neo-dpu"])
    _same_losses(runs["llama-wp-pp2"], runs["llama-wp"])  # 1f1b
    _same_export(runs["llama-wp-pp2"], runs["llama-wp"])


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_fsdp_with_tensor_or_pipeline_parallel_matches_zero1_on_one_process(runs):
    _same_losses(runs["neo-fsdp-tp2"], runs["neo-zero1"])
    _same_losses(runs["llama-fsdp-pp2dp2"], runs["llama-zero1"])  # each stage's root sharded over dp 2
    _same_export(runs["llama-fsdp-pp2dp2"], runs["llama-zero1"])


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.parametrize("kind", ["zero1", "acco"])  # with 1f1b and gpipe
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_pipeline_parallel_2_stages_matches_one_process(runs, kind):
    reference, pp2 = runs[f"llama-{kind}"], runs[f"llama-{kind}-pp2"]
    _same_losses(pp2, reference)
    _same_export(pp2, reference)
    # Stage 0 holds the embedding and 3 of the 6 blocks; the head and the others are on stage 1.
    assert _params_on_rank0(pp2) < 0.6 * _full_params(pp2)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_acco_over_tensor_and_interleaved_pipeline_parallel_matches_one_process(runs):
    reference, tp2pp2 = runs["llama-acco"], runs["llama-acco-tp2pp2"]
    _same_losses(tp2pp2, reference)
    _same_export(tp2pp2, reference)
    assert _params_on_rank0(tp2pp2) < 0.3 * _full_params(tp2pp2)


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_activation_checkpointing_and_the_chunked_loss_under_tp_and_pp_match_one_process(runs):
    _same_losses(runs["neo-zero1-tp2-ac"], runs["neo-zero1"])  # full, 4 loss chunks, vocab-parallel loss
    _same_export(runs["neo-zero1-tp2-ac"], runs["neo-zero1"])
    _same_losses(runs["llama-acco-pp2-ac"], runs["llama-acco"])  # selective by op, 2 chunks, GPipe
    _same_export(runs["llama-acco-pp2-ac"], runs["llama-acco"])
    _same_losses(runs["llama-fsdp-tp2-ac"], runs["llama-zero1"])  # every 2nd block, untied vocab-parallel head


@pytest.mark.integration
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_a_model_from_outside_torchacco_trains_with_its_own_tensor_parallel_plan(runs):
    """Adding a model, its tensor-parallel plan included, needs no edit of torchacco/: the toy model's
    package sits in a temporary folder and is named by its module path."""
    reference, tp2 = runs["toy-zero1"], runs["toy-zero1-tp2"]
    assert "toy_pkg.toy/debug" in tp2[1]
    _same_losses(tp2, reference)
    assert _params_on_rank0(tp2) < 0.55 * _full_params(tp2)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["neo-acco-tp2", "relayout"])  # tp 2 (acco); pp 2 (zero1, 1f1b)
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_offline_export_of_a_model_parallel_checkpoint_equals_the_in_run_export(runs, name, tmp_path):
    """`python -m torchacco export` reads the checkpoint under the trainer's keys, on tp × pp processes."""
    folder = runs[name][2]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torchacco", "export", str(folder), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {tmp_path / 'hf'}" in proc.stdout
    ours, in_run = load_file(tmp_path / "hf" / "model.safetensors"), load_file(folder / "hf" / "model.safetensors")
    assert ours.keys() == in_run.keys()
    for key in ours:
        assert torch.equal(ours[key], in_run[key]), key


@pytest.mark.integration
@pytest.mark.exact
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_acco_with_tensor_parallel_resumes_bit_for_bit(runs):
    (resumed, stdout, _), full = runs["resumed"], runs["neo-acco-tp2"]
    assert "resumed from" in stdout and "at step 2" in stdout
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in full[0]], key
    assert resumed[-1]["val_loss"] == full[0][-1]["val_loss"]
    _same_export(runs["resumed"], full)


@pytest.mark.integration
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_resume_with_another_pipeline_layout_is_one_clear_error(runs):
    stdout = runs["relayout-other"][1]  # (into the same folder, the dump-folder check refuses first)
    assert "torchacco: error: this checkpoint's tensor- and pipeline-parallel layout differs" in stdout
    assert "pipeline_schedule" in stdout and "resumed from" not in stdout


@pytest.mark.integration
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_zero1_checkpoint_under_tensor_parallel_reshards_onto_more_data_parallel_ranks(runs):
    metrics, stdout, _ = runs["resharded"]
    assert "resumed from" in stdout and "data-parallel ranks changed (1 -> 2)" in stdout
    assert [r["step"] for r in metrics] == [2, 3]
    # Started from a 1-step model: below the fresh runs' second-step loss would be a fluke;
    # above the first step's, training broke.
    assert metrics[0]["loss"] < runs["neo-zero1"][0][0]["loss"]


@pytest.mark.parametrize(
    "world, extra, words",
    [
        pytest.param(
            4,
            ["--parallelism.tensor_parallel_degree", "3"],
            ["4 ranks", "not divisible", "3 × 1"],
            id="degrees-do-not-divide-world",
        ),
        pytest.param(
            2,
            ["--parallelism.tensor_parallel_degree", "0"],
            ["tensor_parallel_degree must be at least 1"],
            id="zero-degree",
        ),
        pytest.param(
            8,
            ["--parallelism.tensor_parallel_degree", "8"],
            ["n_heads = 4", "not divisible", "= 8"],
            id="heads-not-divisible",
        ),
        pytest.param(
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--model.vocab_size", "401"],
            ["vocab_size = 401", "not divisible", "vocab_size to a multiple of 2", "402"],
            id="vocab-not-divisible",
        ),
        pytest.param(
            3,
            [*LLAMA, "--parallelism.tensor_parallel_degree", "3"],
            ["n_kv_heads = 2", "not divisible"],
            id="kv-heads-not-divisible",
        ),
        pytest.param(
            8,
            [*LLAMA, "--parallelism.pipeline_parallel_degree", "8"],
            ["6 layers", "fewer than the 8"],
            id="fewer-layers-than-stages",
        ),
        pytest.param(
            2,
            ["--parallelism.pipeline_parallel_degree", "2"],
            ["pipeline parallelism", "tied", "not supported"],
            id="pipeline-with-tied-head",
        ),
        pytest.param(
            2,
            [*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_microbatches", "3"],
            ["local_batch_size = 4", "pipeline_microbatches = 3"],
            id="microbatches-do-not-divide",
        ),
        pytest.param(
            2,
            [*LLAMA, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_microbatches", "1"],
            ["1f1b needs at least", "gpipe"],
            id="1f1b-too-few-microbatches",
        ),
        pytest.param(
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel", "ddp"],
            ["'ddp' with tp=2 is not supported", "zero1"],
            id="ddp-with-tp",
        ),
        pytest.param(
            2,
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel",
                "acco",
                "--acco.mode",
                "adaptive",
                "--training.max_tokens",
                "10000",
            ],
            ["adaptive", "tp=2", "not supported", "deterministic"],
            id="adaptive-with-tp",
        ),
        pytest.param(
            4,
            ["--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "12"],
            ["global_batch_size = 12", "4 × 2 = 8"],
            id="global-batch-counts-dp-ranks-only",
        ),
    ],
)
def test_bad_model_parallel_setting_is_one_line_before_launch(
    world, extra, words, tiny_corpus, cache_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert validate(tiny_args(tiny_corpus, cache_dir, tmp_path, "--parallelism.data_parallel", "zero1", *extra)) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchacco: error:"), lines
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("config, world", [("llama3_8b_acco", 32), ("llama3_70b_fsdp", 64), ("llama3_70b_acco", 128)])
def test_cluster_configs_pass_validation_at_their_world_size(config, world, tiny_corpus, tmp_path, monkeypatch, capsys):
    """TP inside a node (8), ACCO or FSDP across nodes (and 4 pipeline stages for 70B ACCO)."""
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")  # validate checks that the file exists; data paths are the cluster's
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = [
        "--config",
        str(ROOT / "train_configs" / f"{config}.toml"),
        "--data.dataset",
        str(tiny_corpus),
        "--tokenizer.path",
        str(tokenizer),
    ]
    assert validate(argv) == 0, capsys.readouterr().err
    assert validate([*argv, "--training.device", "cpu"]) == 0
    monkeypatch.setenv("WORLD_SIZE", str(world + 4))  # not a multiple of tp × pp
    assert validate(argv) == 1 and "not divisible by [parallelism] tensor_parallel_degree" in capsys.readouterr().err


def test_export_without_a_hugging_face_adapter_is_refused_before_launch(tiny_corpus, cache_dir, tmp_path, monkeypatch,
                                                                         capsys):  # fmt: skip
    shutil.copytree(ROOT / "tests" / "assets" / "toy_model", tmp_path / "toy_pkg2" / "toy")
    (tmp_path / "toy_pkg2" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = tiny_args(tiny_corpus, cache_dir, tmp_path / "run", "--model.name", "toy_pkg2.toy")
    assert validate([*args, "--checkpoint.export_hf", "true"]) == 1
    assert "has no Hugging Face adapter" in capsys.readouterr().err
    assert validate([*args, "--checkpoint.export_hf", "false"]) == 0


@pytest.mark.integration
@pytest.mark.parametrize("name", ["neo-acco-tp2dp2", "llama-acco-tp2pp2"])
@pytest.mark.slow  # the module's runs: 4 ranks on 2 cores
def test_acco_with_model_parallel_drives_each_group_from_one_thread_in_one_order_with_the_runs_timeout(runs, name):
    """NCCL tolerates two host threads on two communicators, never two threads on one, and every
    rank of a group must issue its collectives in the same order. Every collective of a 4-rank run
    (torch's flight recorder, and the ring's messages) is checked: while a communication job is in
    flight, each group is used by one thread only; each group's sequence of operations is the same
    on all its ranks; every group carries [training] collective_timeout_s."""
    logs = [json.loads((runs[name][2] / f"collectives_rank{r}.json").read_text()) for r in range(4)]
    for rank, log in enumerate(logs):
        assert log["jobs"] and all(end is not None for _, end in log["jobs"]), "every job launched was waited for"
        both_busy = 0
        for start, end in log["jobs"]:
            users = defaultdict(set)
            for c in log["collectives"]:
                if start <= c["t"] <= end:
                    users[c["group"]].add(c["thread"])
            shared = {g: threads for g, threads in users.items() if len(threads) > 1}
            assert not shared, f"rank {rank}: groups driven by two threads while a job was in flight: {shared}"
            threads = set().union(*users.values()) if users else set()
            both_busy += len(threads & set(log["comm_threads"])) > 0 and log["main_thread"] in threads
        # The test has teeth only if compute-side (tp/pp) collectives did run beside the job.
        assert both_busy, f"rank {rank}: no job had collectives from both threads"
        for c in log["collectives"]:
            if c["group"] != "0" and "timeout_ms" in c:  # "0": the test worker's own default group
                assert c["timeout_ms"] == ORDER_TIMEOUT_S * 1000, (rank, c)
    sequences = defaultdict(dict)
    for rank, log in enumerate(logs):
        for c in log["collectives"]:
            sequences[c["group"]].setdefault(rank, []).append(c["op"])
    assert len(sequences) >= 6, sorted(sequences)  # default, dp, tp or pp, tp × pp, preemption, ...
    for group, by_rank in sequences.items():
        members = {tuple(log["group_ranks"][group]) for log in logs if group in log["group_ranks"]}
        assert len(members) == 1, f"group {group}: its ranks differ between ranks: {members}"
        members = list(members.pop())
        assert sorted(by_rank) == sorted(members), f"group {group}: used on ranks {sorted(by_rank)} of {members}"
        orders = {tuple(ops) for ops in by_rank.values()}
        assert len(orders) == 1, f"group {group}: ranks issued different sequences"


@pytest.mark.parametrize(
    "overrides, device, env, refused",
    [
        ({"parallelism.data_parallel": "acco", "parallelism.tensor_parallel_degree": 2}, "cuda", "1", True),
        ({"parallelism.data_parallel": "wp", "parallelism.pipeline_parallel_degree": 2}, "cuda", "1", True),
        ({"parallelism.data_parallel": "acco", "parallelism.tensor_parallel_degree": 2}, "cuda", "32", False),
        ({"parallelism.data_parallel": "acco", "parallelism.tensor_parallel_degree": 2}, "cpu", "1", False),
        ({"parallelism.data_parallel": "zero1", "parallelism.tensor_parallel_degree": 2}, "cuda", "1", False),
        ({"parallelism.data_parallel": "acco"}, "cuda", "1", False),
    ],
)
def test_one_hardware_queue_with_an_overlapped_job_beside_model_parallel_traffic_is_refused(
    overrides, device, env, refused
):
    from torchacco.config import Config
    from torchacco.errors import UserError
    from torchacco.parallel.model_parallel import check_hardware_queues

    cfg = Config()
    for key, value in overrides.items():
        section, name = key.split(".")
        setattr(cfg.section(section), name, value)
    if refused:
        with pytest.raises(UserError, match="CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor or pipeline parallelism"):
            check_hardware_queues(cfg.parallelism, cfg.diloco, device, {"CUDA_DEVICE_MAX_CONNECTIONS": env})
    else:
        check_hardware_queues(cfg.parallelism, cfg.diloco, device, {"CUDA_DEVICE_MAX_CONNECTIONS": env})
