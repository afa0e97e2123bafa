"""Bad input through ./run_train.sh: one clear `torchacco: error:` line, a non-zero exit, no
traceback, no hang. Config mistakes are caught by the launcher before any worker starts (checked
here in-process, the launcher's own function, plus once through the script); data, tokenizer and
dump-folder mistakes inside the 2 workers, where rank 0 alone reports (~10 s)."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import run_train, tiny_args

pytestmark = pytest.mark.integration  # every test here starts processes (docs/testing.md)

ERROR = "torchacco: error:"


def check_one_clear_error(proc, *words: str, launched: bool) -> str:
    """The run failed with exactly one error line naming `words`; returns that line."""
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith(ERROR)]
    assert len(errors) == 1, output[-3000:]
    assert errors[0] in proc.stderr.splitlines()
    for word in words:
        assert word.lower() in errors[0].lower(), (word, errors[0])
    # The torchrun wrapper's summary is not a second error; validate stops before any launch.
    summaries = [line for line in output.splitlines() if "worker(s) failed" in line]
    assert len(summaries) == (1 if launched else 0), output[-3000:]
    assert all(not line.startswith(ERROR) for line in summaries)
    return errors[0]


def run(tiny_corpus, cache_dir, out, *extra: str):
    return run_train(tiny_args(tiny_corpus, cache_dir, out, *extra), nproc=2, timeout=120)


def check_before_launch(argv: list[str], capsys):
    """The check ./run_train.sh's launcher makes before it starts workers, run in this process
    (milliseconds, not a 3 s launch per case); test_the_script_checks_before_any_worker_starts
    covers the script's wiring."""
    from torchacco.launch import check_training_config

    code = check_training_config(
        ["--standalone", "--nnodes", "1", "--nproc_per_node", "2", "-m", "torchacco.train", *argv]
    )
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_the_script_checks_before_any_worker_starts(tiny_corpus, cache_dir, tmp_path):
    proc = run(tiny_corpus, cache_dir, tmp_path / "out", "--training.global_batch_size", "12")
    check_one_clear_error(proc, "global_batch_size = 12", "multiple of 8", launched=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "extra, words",
    [
        pytest.param(
            ["--config", "no/such/config.toml"],
            ["config file not found", "no/such/config.toml", "--config"],
            id="missing-config-file",
        ),
        pytest.param(
            ["--training.stepz", "5"],
            ["unknown key 'stepz'", "[training]; did you mean 'steps'?", "valid keys"],
            id="unknown-key",
        ),
        pytest.param(["--training.lr", "1e-3"], ["unknown key 'lr'", "did you mean [optimizer] lr?"], id="other-key"),
        pytest.param(
            ["--trainng.steps", "5"],
            ["unknown section [trainng]; did you mean 'training'?", "valid sections"],
            id="unknown-section",
        ),
        pytest.param(["--training.steps", "ten"], ["[training] steps", "expected int", "ten"], id="wrong-type"),
        pytest.param(
            ["--training.global_batch_size", "12"],
            ["global_batch_size = 12", "not divisible", "4 × 2 = 8", "multiple of 8"],
            id="global-batch",
        ),
        pytest.param(
            ["--training.seq_len", "4096"],
            ["seq_len = 4096", "512 positions", "--training.seq_len 512"],
            id="seq-len-above-positions",
        ),
        pytest.param(
            ["--data.dataset", "no/such/data"], ["dataset path not found", "no/such/data"], id="missing-dataset"
        ),
        pytest.param(
            ["--model.name", "gpt5"], ["unknown model 'gpt5'", "available", "gpt_neo", "llama3"], id="unknown-model"
        ),
        pytest.param(["--model.flavor", "huge"], ["no flavor 'huge'", "choose one of", "debug"], id="unknown-flavor"),
        pytest.param(["--model.flavor", "Tiny"], ["no flavor 'Tiny'; did you mean 'tiny'?"], id="mistyped-flavor"),
        pytest.param(
            ["--parallelism.data_parallel", "acco", "--training.global_batch_size", "8"],
            ["even number of micro-batches", "global_batch_size", "= 16"],
            id="acco-odd-micro-batches",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "dpu", "--acco.mode", "adaptive"],
            ["mode = 'adaptive'", "set [training] max_tokens"],
            id="adaptive-without-token-budget",
        ),
        pytest.param(
            ["--training.on_nonfinite", "ignore"],
            ["'ignore' is not one of", "abort, skip"],
            id="unknown-nonfinite-policy",
        ),
        pytest.param(
            ["--training.max_skips_in_a_row", "0"], ["max_skips_in_a_row must be positive"], id="zero-skips-in-a-row"
        ),
        pytest.param(
            ["--parallelism.data_parallel", "ddpp"],
            ["'ddpp' is not one of", "ddp, zero1, fsdp", "did you mean 'ddp'?"],
            id="unknown-data-parallel",
        ),
        pytest.param(
            ["--acco.mode", "balance"], ["'balance' is not one of", "did you mean 'balanced'?"], id="mistyped-choice"
        ),
        pytest.param(
            ["--training.collective_timeout_s", "inf"],
            ["collective_timeout_s = inf", "not a finite number"],
            id="infinite-timeout",
        ),
        pytest.param(
            ["--checkpoint.folder", "../elsewhere"],
            ["[checkpoint] folder = '../elsewhere'", "inside the dump folder"],
            id="checkpoint-folder-outside",
        ),
        pytest.param(
            ["--profiling.enable", "true", "--profiling.folder", "/tmp/traces"],
            ["[profiling] folder = '/tmp/traces'", "inside the dump folder"],
            id="profiling-folder-outside",
        ),
        pytest.param(
            ["--profiling.enable", "true", "--profiling.every", "2", "--profiling.active_steps", "2"],
            ["every = 2 must exceed active_steps = 2"],
            id="profiling-every-too-short",
        ),
        pytest.param(
            ["--profiling.enable", "true", "--profiling.memory_snapshot", "true", "--training.device", "cpu"],
            ["memory_snapshot records the CUDA allocator", "set memory_snapshot = false"],
            id="memory-snapshot-without-gpu",
        ),
        pytest.param(
            ["--training.activation_checkpoint", "selective", "--training.selective_checkpoint", "every"],
            ["selective_checkpoint = 'every' is neither 'op' nor a whole number"],
            id="unknown-selective-checkpoint",
        ),
        pytest.param(["--training.loss_chunks", "0"], ["loss_chunks must be positive"], id="zero-loss-chunks"),
        pytest.param(
            ["--training.global_batch_size", "-16"],
            ["global_batch_size must be 0 (no accumulation) or positive, got -16"],
            id="negative-global-batch",
        ),
        pytest.param(["--metrics.log_every", "0"], ["[metrics] log_every must be at least 1"], id="zero-log-every"),
        pytest.param(
            ["--parallelism.bucket_cap_mb", "-1"],
            ["bucket_cap_mb must be 0 (torch's default) or positive, got -1"],
            id="negative-bucket-cap",
        ),
        pytest.param(
            ["--eval.batches", "0"], ["[eval] batches must be at least 1", "every = 0"], id="zero-eval-batches"
        ),
        pytest.param(
            ["--parallelism.data_parallel", "dpu", "--acco.estimate_comm", "bf16"],
            ["estimate_comm = 'bf16' does nothing here", "only acco has an estimate round"],
            id="bf16-estimate-without-estimate",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "wp", "--acco.estimate_share", "0.75"],
            ["estimate_share = 0.75 does nothing here", "only acco has an estimate round", "set it to 0.5"],
            id="estimate-share-without-estimate",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "dpu", "--acco.estimate_clip", "commit"],
            ["estimate_clip = 'commit' does nothing here", "set it to 'own'"],
            id="estimate-clip-without-estimate",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "acco", "--acco.estimate_clip", "commit", "--training.max_norm", "0"],
            ["estimate_clip = 'commit' does nothing without clipping", "max_norm"],
            id="estimate-clip-without-clipping",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "acco", "--acco.estimate_share", "0.875"],
            ["estimate_share = 0.875 needs", "use a multiple of 8 micro-batches per rank"],
            id="estimate-share-without-its-micro-batches",
        ),
        pytest.param(
            ["--parallelism.data_parallel", "acco", "--acco.estimate_share", "1"],
            ["estimate_share = 1 must be between 0 and 1"],
            id="estimate-share-out-of-range",
        ),
        pytest.param(
            ["--preemption.signals", "SIGTERM,SIGKILL"],
            ["[preemption] signals: 'SIGKILL' is not one of", "SIGUSR1"],
            id="uncatchable-preemption-signal",
        ),
        pytest.param(
            ["--preemption.exit_code", "143"],
            ["[preemption] exit_code = 143 must be between 2 and 125"],
            id="exit-code",
        ),
        pytest.param(["--preemption.grace_s", "0"], ["[preemption] grace_s must be positive"], id="zero-grace"),
        pytest.param(
            ["--checkpoint.load_path", "/nonexistent/step-00000010"],
            ["load_path not found", "step-N"],
            id="missing-checkpoint",
        ),
        pytest.param(
            ["--model.init_from", "/nonexistent/hf"],
            ["not a Hugging Face folder", "config.json"],
            id="missing-init-from",
        ),
        pytest.param(
            ["--training.device", "cuda"],
            ["cuda", "not available", "--training.device cpu"],
            id="cuda-without-cuda",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA"),
        ),
    ],
)
def test_bad_option_is_one_line_before_launch(extra, words, tiny_corpus, cache_dir, tmp_path, capsys):
    proc = check_before_launch(tiny_args(tiny_corpus, cache_dir, tmp_path / "out", *extra), capsys)
    check_one_clear_error(proc, *words, launched=False)


@pytest.mark.parametrize(
    "toml, words",
    [
        pytest.param("[training]\nsteps = 5\nseq_len = \n", ["TOML syntax error", "line 3"], id="toml-syntax"),
        pytest.param(
            "[training]\nsteps = 5\nlearning_rate = 0.1\n",
            ["unknown key 'learning_rate'", "valid keys"],
            id="unknown-key",
        ),
        pytest.param('[training]\nsteps = "5"\n', ["[training] steps", "expected int", "str"], id="wrong-type"),
    ],
)
def test_bad_config_file_is_one_line_before_launch(toml, words, tiny_corpus, cache_dir, tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    proc = check_before_launch(["--config", str(config), *tiny_args(tiny_corpus, cache_dir, tmp_path / "out")], capsys)
    check_one_clear_error(proc, str(config), *words, launched=False)


def test_a_dump_folder_holding_another_run_is_refused_before_launch_and_the_same_run_resumes(
    tiny_corpus, cache_dir, tmp_path, capsys
):
    from torchacco import run_folder
    from torchacco.config import load_config

    out = tmp_path / "out"
    run_folder.prepare(load_config(tiny_args(tiny_corpus, cache_dir, out)), out)  # what a first run leaves
    same = check_before_launch(tiny_args(tiny_corpus, cache_dir, out, "--training.steps", "12"), capsys)
    assert same.returncode == 0 and not same.stderr  # more steps: the same run, resumed
    other = check_before_launch(tiny_args(tiny_corpus, cache_dir, out, "--optimizer.lr", "3e-4"), capsys)
    check_one_clear_error(other, "holds a different run", "optimizer.lr", "--job.dump_folder", launched=False)
    told = check_before_launch(tiny_args(tiny_corpus, cache_dir, out, "--optimizer.lr", "3e-4", "--job.overwrite",
                                         "true"), capsys)  # fmt: skip
    assert told.returncode == 0 and (out / "config.toml").is_file()  # validation deletes nothing


def test_help_lists_the_sections_and_a_sections_keys_from_the_declarations():
    """`./run_train.sh --help [SECTION]` (or -h): the script's usage and environment, the sections, and a section's
    keys with their types, defaults and help: the rows of docs/configuration.md. It starts nothing and imports no
    torch."""
    import dataclasses
    import subprocess
    import sys

    from conftest import ROOT

    from torchacco.config import Training, _keys

    def script(*args):
        env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
        return subprocess.run([str(ROOT / "run_train.sh"), *args], capture_output=True, text=True, env=env, timeout=60)

    listing = script("--help")
    assert listing.returncode == 0 and not listing.stderr, listing.stderr
    assert "NNODES" in listing.stdout and "--dry-run" in listing.stdout  # the launcher's part
    for section in ("job", "training", "acco", "hsdp", "diloco", "emulation"):
        assert re.search(rf"^  {section} +\w", listing.stdout, re.M), section
    one = script("--config", "train_configs/default.toml", "-h", "training")
    assert one.returncode == 0 and "[training]" in one.stdout and "diloco" not in one.stdout
    section = one.stdout[one.stdout.index("[training]") :]  # after the script's header
    rows = [line.split(None, 3) for line in section.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == [f.name for f in dataclasses.fields(Training)]
    for (_, kind, default, help_), row in zip(_keys("training", Training), rows, strict=True):
        shown = "|".join(kind) if isinstance(kind, tuple) else kind
        assert row[1:] == [shown, json.dumps(default), help_], row
    wrong = script("--help", "trainig")
    assert wrong.returncode == 1 and wrong.stderr.startswith("torchacco: error: --help trainig: no section")
    assert "did you mean 'training'?" in wrong.stderr and wrong.stderr.count("\n") == 1


def test_tokenizer_larger_than_model_vocab(tiny_corpus, cache_dir, tmp_path):
    proc = run(tiny_corpus, cache_dir, tmp_path / "out", "--model.vocab_size", "300")
    line = check_one_clear_error(
        proc, "the tokenizer has", "model's vocabulary is 300", "[model] vocab_size", launched=True
    )
    assert "set [model] vocab_size = 3" in line  # the tokenizer's size, whatever the BPE reached


def test_empty_dataset_folder(tiny_corpus, cache_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run(tiny_corpus, cache_dir, tmp_path / "out", "--data.dataset", str(empty))
    check_one_clear_error(
        proc, "no .txt, .jsonl, .json or .parquet files under", str(empty), "data.dataset", launched=True
    )


def test_unwritable_dump_folder(tiny_corpus, cache_dir):
    # Only rank 0 writes the dump folder: its failure must stop rank 1 too, not leave it waiting.
    proc = run(tiny_corpus, cache_dir, "/proc/forbidden")
    check_one_clear_error(proc, "cannot write to dump folder /proc/forbidden", "--job.dump_folder", launched=True)


def test_corrupt_tokenizer_file(tiny_corpus, cache_dir, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": ')
    proc = run(tiny_corpus, cache_dir, tmp_path / "out", "--tokenizer.path", str(bad))
    check_one_clear_error(proc, str(bad), "not a valid tokenizer.json", "tokenizer.path", launched=True)


def test_diverging_run_stops_with_one_line_naming_the_step(tiny_corpus, cache_dir, tmp_path):
    proc = run(tiny_corpus, cache_dir, tmp_path / "out", "--optimizer.lr", "1e30")
    check_one_clear_error(proc, "non-finite", "at step", "lower [optimizer] lr", launched=True)


@pytest.mark.faults
def test_a_stalled_rank_fails_the_run_within_the_timeout_with_one_line(tiny_corpus, cache_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    from conftest import ROOT, tiny_args

    out = tmp_path / "out"
    env = {**os.environ, "NPROC": "2", "PYTHON": sys.executable}
    job = subprocess.Popen(
        [
            str(ROOT / "run_train.sh"),
            *tiny_args(
                tiny_corpus,
                cache_dir,
                out,
                "--training.steps",
                "5000",
                "--eval.every",
                "0",
                "--training.collective_timeout_s",
                "5",
            ),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines, first_error = [], threading.Event()

    def read_stderr():
        for line in job.stderr:
            lines.append(line)
            if line.startswith("torchacco: error:"):
                first_error.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while stopped is None and time.monotonic() < deadline and job.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and metrics.read_text().count("\n") >= 3:
                workers = {
                    _rank(p): int(p.name)
                    for p in Path("/proc").iterdir()
                    if p.name.isdigit() and _parent(p) == job.pid and b"torchacco.train" in _cmdline(p)
                }
                if len(workers) == 2:
                    os.kill(workers[1], signal.SIGSTOP)  # rank 1 stalls without dying
                    stopped = time.monotonic()
            time.sleep(0.05)
        assert stopped is not None, "the run ended before a rank could be stalled"
        assert first_error.wait(timeout=60), "".join(lines)[-3000:]  # a hang fails here
        # 5 s of collective timeout, ~2.5 s of diagnosis, and slack for a loaded machine.
        assert time.monotonic() - stopped < 45
        # torchrun would SIGKILL the stopped rank 30 s after its SIGTERM; do it now.
        os.kill(workers[1], signal.SIGKILL)
        job.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        job.kill()
    stderr = "".join(lines)
    assert job.returncode != 0 and "Traceback" not in stderr
    errors = [line.rstrip("\n") for line in lines if line.startswith("torchacco: error:")]
    # The survivor names the stalled rank and the phase it stopped in.
    assert len(errors) == 1 and "rank 0: a collective failed" in errors[0], errors
    assert "rank 1 stopped responding in" in errors[0] and "(step " in errors[0], errors[0]
    assert "collective_timeout_s = 5" in errors[0]


def _parent(proc_dir) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _rank(proc_dir) -> int:
    try:
        env = dict(kv.split(b"=", 1) for kv in (proc_dir / "environ").read_bytes().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"])
    except (OSError, KeyError, ValueError):
        return -1


def _cmdline(proc_dir) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_launcher_setting_that_is_not_a_number_is_one_line(tiny_corpus, cache_dir, tmp_path):
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "out"), env={"MAX_RESTARTS": "three"})
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "torchacco: error: MAX_RESTARTS=three is not a whole number; set it to e.g. MAX_RESTARTS=1"
    ]
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "out"), nproc=0)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        "torchacco: error: NPROC=0 must be at least 1; set it to e.g. NPROC=1"
    ]
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "out"), env={"MASTER_PORT": "99999"})
    assert proc.returncode == 1 and "MASTER_PORT=99999 is not a TCP port" in proc.stderr


@pytest.mark.faults
def test_a_hung_communication_job_is_diagnosed_before_the_collective_timeout(tiny_corpus, cache_dir, tmp_path):
    """NCCL raises nothing for a hung collective: at the collective timeout its watchdog aborts the
    process without a cause. The overlapped schedules wait for their job with a deadline of their own
    (here 80% of 30 s) and end the run with the one-line diagnosis first. The injected fault makes
    rank 1's collectives never start from step 3, and raises nothing, as a hung NCCL kernel."""
    import time

    from conftest import run_train, tiny_args

    extra = ["--parallelism.data_parallel", "acco", "--training.global_batch_size", "16"]
    extra += ["--training.steps", "40", "--eval.every", "0", "--training.collective_timeout_s", "30"]
    started = time.monotonic()
    proc = run_train(
        tiny_args(tiny_corpus, cache_dir, tmp_path / "out", *extra),
        env={"TORCHACCO_FAULT": "stall@rank1:step3"},
        timeout=240,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert errors, proc.stderr[-3000:]
    for line in errors:  # the timed wait's words, not gloo's own timeout ("a collective failed")
        assert "the communication job made no progress for 24 s" in line, line
        assert "with its communication job" in line and "(step 3)" in line, line  # where the other rank is
        assert re.search(r"rank 1 has not entered the (reduce-scatter|all-gather) that rank 0 is in", line), line
    assert elapsed < 120, elapsed


@pytest.mark.faults
def test_a_rank_hung_inside_a_collective_is_diagnosed_and_every_rank_keeps_its_flight_recorder(
    tiny_corpus, cache_dir, tmp_path
):
    """Rank 1 waits inside the communication library (a receive no peer answers) from step 3, and
    rank 0 inside its all-gather: both end with the diagnosis before the collective timeout, each
    having written its flight recorder first."""
    import time

    from conftest import run_train, tiny_args

    extra = ["--parallelism.data_parallel", "acco", "--training.global_batch_size", "16"]
    extra += ["--training.steps", "40", "--eval.every", "0", "--training.collective_timeout_s", "20"]
    started = time.monotonic()
    env = {"TORCHACCO_FAULT": "hang@rank1:step3", "TORCH_FR_BUFFER_SIZE": "2000"}
    proc = run_train(tiny_args(tiny_corpus, cache_dir, tmp_path / "out", *extra), env=env, timeout=240)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 2, proc.stderr[-3000:]
    for line in errors:  # both ranks name rank 1, which never entered the collective rank 0 waits in
        assert "made no progress for 16 s" in line and "(step 3)" in line, line
        assert re.search(r"rank 1 has not entered the (reduce-scatter|all-gather) that rank 0 is in", line), line
    assert elapsed < 100, elapsed  # before gloo's own timeout would have ended both (20 s, after the 16)
    assert "terminate called" not in proc.stderr  # no abort beside the thread left in gloo
    recorded = sorted(p.name for p in (tmp_path / "out" / "flight_recorder").iterdir())
    assert recorded == ["rank_0", "rank_1"] and all((tmp_path / "out" / "flight_recorder" / r).stat().st_size
                                                  for r in recorded)  # fmt: skip
