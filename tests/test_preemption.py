"""Preemption: a stop signal (SLURM's SIGUSR1 before the time limit, a preemption's SIGTERM) ends the
run at one update on every rank, with a checkpoint there and the requeue exit code; the relaunch
(the same command) continues bit for bit. Runs go through ./run_train.sh like a user's job."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, read_metrics, run_train, six_step_args, tiny_args

from torchacco.checkpoint import step_dirs
from torchacco.config import load_config

# every test here starts processes, and waits out signals, grace periods and relaunches (docs/testing.md)
pytestmark = [pytest.mark.integration, pytest.mark.faults]

REQUEUE = 75  # [preemption] exit_code's default


def _launch(argv: list[str], logs: Path, nproc: int = 2) -> subprocess.Popen:
    """./run_train.sh in a session of its own (the launcher leads its process group)."""
    env = {**os.environ, "NPROC": str(nproc), "PYTHON": sys.executable}
    return subprocess.Popen(
        [str(ROOT / "run_train.sh"), *argv],
        env=env,
        cwd=ROOT,
        stdout=open(logs / "stdout.txt", "w"),
        stderr=open(logs / "stderr.txt", "w"),
        start_new_session=True,
    )


def _after_first_step(job: subprocess.Popen, out: Path, timeout_s: float = 240) -> None:
    """Wait until step 1 is logged (every rank is in the loop: its signal handlers are set)."""
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout_s
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert job.poll() is None, "the run ended before its first step was logged"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.02)


def _finish(job: subprocess.Popen, logs: Path, timeout_s: float = 180) -> tuple[int, str, str]:
    try:
        job.wait(timeout=timeout_s)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, (logs / "stdout.txt").read_text(), (logs / "stderr.txt").read_text()


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = dict(kv.split(b"=", 1) for kv in (proc / "environ").read_bytes().split(b"\0") if b"=" in kv)
            found[int(env[b"RANK"])] = int(proc.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return found


@pytest.mark.exact
@pytest.mark.parametrize("kind, sig", [("zero1", signal.SIGUSR1), ("acco", signal.SIGTERM)])
def test_a_signal_to_the_launcher_stops_at_one_update_and_the_relaunch_continues_bit_for_bit(
    tiny_corpus, cache_dir, tmp_path, six_step_run, kind, sig
):
    expected = read_metrics(six_step_run(kind))  # the uninterrupted run, same arguments
    out = tmp_path / "run"
    argv = six_step_args(tiny_corpus, cache_dir, out, kind, 6, "--checkpoint.every", "3", "--checkpoint.keep", "0")
    job = _launch(argv, tmp_path)
    _after_first_step(job, out)
    os.killpg(job.pid, sig)  # as a terminal's ^C reaches a foreground job; torchrun must forward it
    code, _, stderr = _finish(job, tmp_path)

    assert code == REQUEUE and "Traceback" not in stderr, stderr[-3000:]
    stopped = read_metrics(out)[-1]["step"]
    assert stopped < 6, "the signal came too late to test anything"
    assert step_dirs(out / "checkpoint")[-1][0] == stopped  # the checkpoint of the very step it stopped at
    assert f"torchacco: stopped at step {stopped} on {sig.name} and saved " in stderr, stderr[-3000:]

    resumed = run_train(argv)  # the requeued job: the same command
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped} " in resumed.stdout
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 7))
    for key in ("loss", "lr", "tokens", "grad_norm"):
        assert [r[key] for r in records] == [r[key] for r in expected], key
    assert [r.get("val_loss") for r in records] == [r.get("val_loss") for r in expected]


def test_a_signal_to_one_worker_stops_every_rank_at_the_same_update(tiny_corpus, cache_dir, tmp_path):
    """Only rank 1 gets SIGUSR1 (a rank that saw it before the others, say): the ranks agree at the
    next update, so rank 0 stops there too and the save, a collective, completes."""
    out = tmp_path / "run"
    job = _launch(
        tiny_args(tiny_corpus, cache_dir, out, "--training.steps", "500", "--checkpoint.enable", "true"), tmp_path
    )
    _after_first_step(job, out)
    os.kill(_workers(job.pid)[1], signal.SIGUSR1)
    code, _, stderr = _finish(job, tmp_path)

    assert code == REQUEUE and "Traceback" not in stderr and "worker(s) failed" not in stderr, stderr[-3000:]
    stopped = read_metrics(out)[-1]["step"]
    step, path = step_dirs(out / "checkpoint")[-1]
    assert step == stopped and (path / ".metadata").is_file() and len(list(path.glob("*.distcp"))) == 2
    assert f"torchacco: stopped at step {stopped} on SIGUSR1 and saved {path}" in stderr


def test_without_checkpoints_a_preemption_stops_cleanly_and_says_nothing_was_saved(tiny_corpus, cache_dir, tmp_path):
    out = tmp_path / "run"
    job = _launch(tiny_args(tiny_corpus, cache_dir, out, "--training.steps", "500"), tmp_path)
    _after_first_step(job, out)
    os.killpg(job.pid, signal.SIGTERM)
    code, _, stderr = _finish(job, tmp_path)
    # Not the requeue code: a requeued job would start over.
    assert code == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr[-3000:]
    stopped = read_metrics(out)[-1]["step"]
    assert f"torchacco: stopped at step {stopped} on SIGTERM; [checkpoint] enable = false, so nothing was saved" in (
        stderr
    )
    assert not (out / "checkpoint").exists()


def test_a_stop_that_cannot_finish_within_the_grace_period_exits_anyway(tiny_corpus, cache_dir, tmp_path):
    """Rank 1 freezes, so rank 0 can neither finish its update nor save: it gives up grace_s after
    the signal, says so, and still asks for a requeue (the earlier checkpoint stays)."""
    out = tmp_path / "run"
    argv = tiny_args(
        tiny_corpus,
        cache_dir,
        out,
        "--training.steps",
        "500",
        "--checkpoint.enable",
        "true",
        "--preemption.grace_s",
        "2",
    )
    job = _launch(argv, tmp_path)
    _after_first_step(job, out)
    workers = _workers(job.pid)
    os.kill(workers[1], signal.SIGSTOP)
    signalled = time.monotonic()
    os.kill(workers[0], signal.SIGUSR1)
    try:
        while workers[0] in _workers(job.pid).values():
            assert time.monotonic() - signalled < 60, "rank 0 did not give up"
            time.sleep(0.1)
        given_up = time.monotonic() - signalled
    finally:
        os.kill(workers[1], signal.SIGKILL)  # torchrun would, 30 s after its SIGTERM
    code, _, stderr = _finish(job, tmp_path)
    assert 2 <= given_up < 15, given_up
    assert code == REQUEUE and "Traceback" not in stderr, stderr[-3000:]
    assert "torchacco: preempted (SIGUSR1), but the update and its checkpoint did not finish within [preemption] " in (
        stderr
    )
    assert "grace_s = 2 (rank 0 was in " in stderr and "resumes from the latest complete checkpoint" in stderr
    assert not (out / "checkpoint").exists() or not step_dirs(out / "checkpoint")


def test_the_launcher_forwards_the_signals_and_waits_out_the_grace_period(tiny_corpus, cache_dir, tmp_path):
    from torchacco.launch import forward_preemption_signals

    argv = ["--standalone", "--nproc_per_node", "2", "-m", "torchacco.train", "--preemption.grace_s", "100.5"]
    cfg = load_config(argv[5:])
    assert forward_preemption_signals(argv, cfg) == [
        "--signals-to-handle",
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",  # torchrun's own, and SLURM's
        "--shutdown-timeout",
        "116",  # torchrun's SIGKILL comes after the workers' own deadline
        *argv,
    ]
    cfg.preemption.signals = "usr2"
    mine = ["--signals-to-handle", "SIGTERM", "--shutdown-timeout", "300", *argv]
    assert forward_preemption_signals(mine, cfg)[:2] == ["--signals-to-handle", "SIGTERM,SIGUSR2"]
    assert forward_preemption_signals(mine, cfg)[2:] == mine  # the user's own timeout stands


def test_the_launcher_runs_with_a_torchrun_that_has_no_shutdown_timeout(monkeypatch, capsys):
    """torch 2.11's torchrun (the GPU image's) has no --shutdown-timeout: the launch goes on without it."""
    from torchacco import launch

    parser = launch.get_args_parser()
    parse = parser.parse_args

    def without_the_option(argv):
        args = parse(argv)
        del args.shutdown_timeout
        return args

    monkeypatch.setattr(parser, "parse_args", without_the_option)
    monkeypatch.setattr(launch, "get_args_parser", lambda: parser)
    argv = ["--standalone", "--nproc_per_node", "2", "-m", "torchacco.train", "--preemption.grace_s", "100"]
    cfg = load_config(argv[5:])
    assert launch.forward_preemption_signals(argv, cfg) == [
        "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", *argv]  # fmt: skip
    assert "no --shutdown-timeout" in capsys.readouterr().err
    cfg.preemption.grace_s = 10
    launch.forward_preemption_signals(argv, cfg)
    assert capsys.readouterr().err == ""  # 10 s and the workers' watchdog fit in its 30 s
