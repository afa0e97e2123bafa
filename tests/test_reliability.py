"""Non-finite losses and gradients: every rank skips or aborts together; skipped updates leave θ as it was.

Lost workers (automatic restart and exact recovery) are tested with the resume tests in
test_checkpoint.py; stalled ranks in test_cli.py.
"""

import os
import signal
import subprocess
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import read_metrics, run_train, tiny_args

import torchacco.faults
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
        mp_group=None,
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


def test_fault_specs_parse_and_fire_once_per_launch_at_any_step_on_any_attempt(monkeypatch):
    faults = Faults("nan@rank1:step3:period2, nan@rank0:step9", rank=1)
    assert [faults.before_period(s) for s in (1, 2, 3, 3, 4)] == [False, False, False, True, False]
    with pytest.raises(UserError, match="cannot parse 'explode@rank1'"):
        Faults("explode@rank1", rank=0)

    # The launcher's store outlives torchrun's restarts: each attempt's faults share it.
    store, spec = dist.HashStore(), "nan@rank0:step2,nan@rank0:step5"
    first = Faults(spec, rank=0, store=store)
    assert [first.before_period(s) for s in (1, 2, 3)] == [False, True, False]  # dies after step 3, say
    restarted = Faults(spec, rank=0, store=store)  # resumed from step 0: step 2 does not fail again,
    assert [restarted.before_period(s) for s in range(1, 7)] == [False, False, False, False, True, False]  # 5 does
    assert not any(Faults(spec, rank=0, store=store).before_period(s) for s in range(1, 7))
    both = Faults("nan@rank0:step1", rank=0, store=store)  # no period: every period of the step
    assert [both.before_period(1), both.before_period(1), both.before_period(2)] == [True, True, False]

    kills = []
    monkeypatch.setattr("torchacco.faults.os.kill", lambda pid, sig: kills.append(sig))
    for _attempt in range(2):  # ACCO's step 2 has two periods: one kill, at the first, in all
        killer = Faults("kill@rank0:step2", rank=0, store=store)
        for step in (1, 2, 2, 3):
            killer.before_period(step)
    assert kills == [signal.SIGKILL]

    # A freeze arms at its step and stops the process once, at its next fault-tolerant outer step's first message.
    frozen = Faults("freeze@replica1:rank0:step2:4s, freeze@replica0:rank0:step1:9s", rank=0, store=store, replica=1)
    assert [f[1:] for f in frozen.faults] == [("freeze", 2, 4.0)]
    woken = []
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kwargs: woken.append(argv[-1]))
    torchacco.faults.in_outer_exchange()  # (not armed: nothing)
    for step in (1, 2, 3):
        frozen.before_period(step)
    torchacco.faults.in_outer_exchange()
    torchacco.faults.in_outer_exchange()
    assert kills == [signal.SIGKILL, signal.SIGSTOP] and woken == [f"sleep 4; kill -CONT {os.getpid()}"]
    with pytest.raises(UserError, match="cannot parse 'freeze@rank0:step2'"):
        Faults("freeze@rank0:step2", rank=0)

    # A pause sleeps its seconds as its step starts, once, on its own rank and replica only.
    slept = []
    monkeypatch.setattr(torchacco.faults.time, "sleep", slept.append)
    paused = Faults("pause@replica0:rank0:step2:30s, pause@rank1:step1:5s", rank=0, store=store, replica=0)
    assert [f[1:] for f in paused.faults] == [("pause", 2, 30.0)]
    for step in (1, 2, 2, 3):
        paused.before_period(step)
    assert slept == [30.0]


def _run(corpus, cache, out, fault, *extra):
    return run_train(tiny_args(corpus, cache, out, "--eval.every", "0", *extra), env={"TORCHACCO_FAULT": fault})


@pytest.mark.integration
@pytest.mark.faults
def test_abort_policy_stops_at_the_step_naming_the_rank(tiny_corpus, cache_dir, tmp_path):
    proc = _run(tiny_corpus, cache_dir, tmp_path / "out", "nan@rank1:step3", "--parallelism.data_parallel", "zero1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "non-finite loss or gradient at step 3 (from the loss of rank(s) 1" in errors[0]
    assert "on_nonfinite = 'skip'" in errors[0]
    assert [r["step"] for r in read_metrics(tmp_path / "out")] == [1, 2, 3]  # the failing step is logged


@pytest.mark.integration
@pytest.mark.faults
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


@pytest.mark.integration
@pytest.mark.faults
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
    another_mode = Config()  # a strategy's own section counts too
    another_mode.strategy_options["acco"].mode = "balanced"
    with pytest.raises(UserError, match=r"holds a different run \(differs in acco.mode\)"):
        run_folder.prepare(another_mode, out)
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


@pytest.mark.integration
@pytest.mark.faults
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


# Operations follow-ups: each of these failed before its fix. -------------------------------------


def _tcp_store(timeout_s: float, port: int = 0):
    """A key-value store server in this process, as torchrun's agent hosts one."""
    from datetime import timedelta

    return dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def _client(port: int, timeout_s: float):
    from datetime import timedelta

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


@pytest.mark.integration
def test_a_peer_that_never_joins_the_process_group_is_named_in_one_line():
    import time

    from torchacco.errors import PeerFailure
    from torchacco.parallel.process_groups import attempt_store

    server = _tcp_store(1.0)
    start = time.monotonic()
    with pytest.raises(PeerFailure, match=r"^rank 0: rank 1 did not join the process group within .* = 1: it died"):
        attempt_store(server, rank=0, world=2, timeout_s=1.0)  # rank 1 never came
    with pytest.raises(PeerFailure, match=r"^rank 1: rank 0 did not admit this rank .* = 1: rank 0, or a rank"):
        attempt_store(_client(server.port, 1.0), rank=1, world=2, timeout_s=1.0)  # rank 0 never answers
    assert time.monotonic() - start < 10


@pytest.mark.integration
def test_a_peer_dying_during_process_group_setup_gives_the_diagnosis_not_a_store_traceback(
    tiny_corpus, cache_dir, tmp_path
):
    """Rank 0 is a real worker; this test plays a rank 1 (on another node, say) that joins the
    attempt and dies before it sets up its process group, so rank 0's gloo waits for it."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    from torchacco.parallel.process_groups import attempt_store

    server = _tcp_store(30.0)
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    worker = subprocess.Popen(
        [sys.executable, "-m", "torchacco.train"]
        + tiny_args(tiny_corpus, cache_dir, tmp_path / "out", "--training.collective_timeout_s", "3"),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        attempt_store(_client(server.port, 60.0), rank=1, world=2, timeout_s=60.0)  # joined; then "dies"
        stdout, stderr = worker.communicate(timeout=90)
    finally:
        worker.kill()
    assert worker.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    errors = _errors(SimpleNamespace(stderr=stderr))
    assert len(errors) == 1, stderr[-3000:]
    assert "rank 0: setting up the process group failed (" in errors[0], errors[0]
    assert "rank 1 never reported (it died or stalled while starting)" in errors[0], errors[0]
    assert errors[0].endswith("collective_timeout_s = 3"), errors[0]


@pytest.mark.integration
def test_the_diagnosis_gives_up_on_a_store_that_does_not_answer(monkeypatch):
    """A frozen store host (SIGSTOP) answers nothing; the store client's own timeout (here 120 s,
    the collective timeout in a run) must not hold the diagnosis."""
    import os
    import signal
    import subprocess
    import sys
    import threading
    import time

    from torchacco import health

    serve = (
        "import sys, time, torch.distributed as d; from datetime import timedelta; "
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False); "
        "print(s.port, flush=True); time.sleep(300)"
    )
    host = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        client = _client(int(host.stdout.readline()), 120.0)
        client.set(f"{health.BEAT_KEY}1", '{"beat": 1, "where": "compute (step 1)"}')
        beat = health.Heartbeat(client, rank=0, world=2, interval_s=0.2)
        os.kill(host.pid, signal.SIGSTOP)
        _wait_until_stopped(host.pid)  # a thread still running on another core could answer the first read
        monkeypatch.setattr(health, "READ_TIMEOUT_S", 1.0)
        said, start = [], time.monotonic()
        reader = threading.Thread(target=lambda: said.append(beat.diagnose(watch_s=0.1)), daemon=True)
        reader.start()
        reader.join(timeout=60)
        assert said == ["the launcher's store is unreachable too: node 0 (its host) is probably down"]
        assert time.monotonic() - start < 5
        beat.close()
    finally:
        host.kill()  # SIGKILL ends a stopped process too; the blocked reads then fail
        host.wait()
    # Two reads and the 2.5 s between them fit in torchrun's 30 s from SIGTERM to SIGKILL.
    assert 2 * health.READ_TIMEOUT_S + 2.5 < 30


def _wait_until_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of `pid` is in the stopped state: kill() returns before the stop takes effect."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = [open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0] for t in tasks]
        if all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


class _CountingStore:
    def __init__(self):
        self.values, self.writes = {}, 0

    def set(self, key, value):
        self.writes += 1
        self.values[key] = value


@pytest.mark.parametrize(
    "message",
    [
        "Application timeout caused pair closure",  # gloo, from DDP's backward, on a stalled peer
        "Connection closed by peer [127.0.0.1]:1234",
        "[/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv operation to complete",
    ],
)
def test_gloos_plain_runtime_errors_on_a_dead_or_stalled_peer_are_peer_failures(message):
    from torchacco.health import is_peer_failure

    assert is_peer_failure(RuntimeError(message))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))


def test_the_heartbeat_writes_at_most_once_per_interval_however_often_the_phase_changes():
    import json
    import time

    from torchacco import health

    store = _CountingStore()
    beat = health.Heartbeat(store, rank=0, world=2, interval_s=0.5)
    try:
        start = time.monotonic()
        for step in range(1, 301):  # 1.2 s of 4 ms steps, three phases each
            beat.enter(f"compute (step {step})")
            beat.comm_phase("communication job")
            beat.enter(f"sync (step {step})")
            beat.comm_phase("")
            time.sleep(0.004)
        elapsed = time.monotonic() - start
        assert store.writes <= elapsed / 0.5 + 2, store.writes  # one at start, then one per interval
        beat.enter("checkpoint save (step 301)")
        beat.flush()  # what an injected kill does: the phase is published at once
        assert json.loads(store.values[f"{health.BEAT_KEY}0"])["where"] == "checkpoint save (step 301)"
    finally:
        beat.close()


@pytest.mark.integration
@pytest.mark.faults
def test_a_failed_checkpoint_mkdir_on_rank_0_fails_every_rank_at_once(tiny_corpus, cache_dir, tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "step-00000002.tmp").write_text("a file where rank 0 makes the save's folder")
    proc = _run(
        tiny_corpus,
        cache_dir,
        out,
        "",
        "--parallelism.data_parallel",
        "zero1",
        "--checkpoint.enable",
        "true",
        "--checkpoint.every",
        "1",
        "--job.overwrite",
        "true",  # the folder holds no config.toml yet
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc)
    # Rank 1 stops with rank 0's reason, not on its own after a collective timeout or torchrun's
    # SIGTERM (a second line, naming rank 0 as the one that stopped responding).
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "could not write checkpoint" in errors[0] and "step-00000002" in errors[0], errors[0]
    assert "the earlier checkpoint step-00000001 is intact" in errors[0], errors[0]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["zero1", "fsdp"])  # the sharded job, and torch's AdamW
@pytest.mark.faults
def test_under_pipeline_parallelism_the_nonfinite_error_names_global_ranks(tiny_corpus, cache_dir, tmp_path, kind):
    # pp = 2 on 2 ranks: rank 1 holds the last stage (the loss) and is rank 0 of its dp group;
    # rank 0, which reports, holds the first stage and sees no loss of its own.
    proc = _run(
        tiny_corpus,
        cache_dir,
        tmp_path / "out",
        "nan@rank1:step2",
        "--parallelism.data_parallel",
        kind,
        "--model.name",
        "llama3",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.steps",
        "3",
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = _errors(proc)
    assert len(errors) == 1 and "non-finite loss or gradient at step 2 (from the loss of rank(s) 1;" in errors[0], (
        proc.stderr[-3000:]
    )


def test_a_metrics_line_cut_short_by_a_crash_does_not_stop_a_resume(tmp_path):
    from torchacco.metrics import MetricsLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "lo')
    MetricsLogger(tmp_path, True, False, False, 10, keep_until_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "loss": 2.0}',
        '{"step": 2, "loss": 1.9}',
    ]


def test_nodes_whose_name_resolves_to_loopback_are_told_to_set_gloo_socket_ifname(monkeypatch):
    """gloo binds to what the host's name resolves to: Debian's 127.0.1.1 would make every node dial
    itself across a multi-node launch, and wait until the timeout."""
    from torchacco.parallel import process_groups

    addresses = {"node7": "127.0.1.1", "192.0.2.10": "192.0.2.10", "localhost": "127.0.0.1"}
    monkeypatch.setattr(process_groups.socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(process_groups.socket, "gethostbyname", lambda name: addresses[name])
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.10")  # node 0 elsewhere (a documentation address)
    with pytest.raises(UserError, match=r"'node7' resolves to the loopback address 127\.0\.1\.1.*GLOO_SOCKET_IFNAME="):
        process_groups.check_gloo_interface()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # an interface named: fine
    process_groups.check_gloo_interface()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "localhost")  # every "node" on this host: loopback is right
    process_groups.check_gloo_interface()


def test_the_progress_bar_of_a_run_that_stops_on_tokens_counts_tokens(tmp_path):
    from torchacco.metrics import MetricsLogger

    record = {"step": 30, "tokens": 750, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 100.0, "memory_gib": 1.0}
    record |= {"grad_norm": 1.0, "share_data": 0.0, "share_compute": 1.0, "share_sync": 0.0}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    by_tokens = MetricsLogger(tmp_path / "a", True, False, True, 150, max_tokens=1000)
    assert "[###############     ]  75%" in by_tokens._console_line(record)
    by_steps = MetricsLogger(tmp_path / "b", True, False, True, 150)
    assert "[####                ]  20%" in by_steps._console_line(record)
    by_tokens.close()
    by_steps.close()


@pytest.mark.integration
@pytest.mark.faults
def test_a_survivor_blocked_on_a_dead_peer_names_it_before_torchruns_sigkill(tiny_corpus, cache_dir, tmp_path):
    """torchrun stops the survivor of a dead worker with SIGTERM, which the survivor takes as a
    preemption signal, and SIGKILLs it 30 s later. Rank 0 here is blocked in a reduce-scatter that
    never starts (as a NCCL collective on a dead peer, which never fails) when rank 1 dies: it never
    reaches an update boundary, so its watchdog looks for a dead peer and exits with the diagnosis."""
    extra = ["--parallelism.data_parallel", "zero1", "--training.steps", "20", "--eval.every", "0"]
    proc = run_train(
        tiny_args(tiny_corpus, cache_dir, tmp_path / "out", *extra),
        env={"TORCHACCO_FAULT": "stall@rank0:step5,kill@rank1:step5"},
        timeout=240,
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Unable to shutdown process" not in proc.stderr, proc.stderr[-3000:]  # torchrun's SIGKILL
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    stuck = "rank 0: stopped by SIGTERM during its reduce-scatter, optimizer step and all-gather (step 5)"
    assert errors[0].startswith(f"torchacco: error: {stuck}"), errors
    assert "rank 1 stopped responding in compute (step 5)" in errors[0], errors


@pytest.mark.parametrize("tears_down", [True, False])
def test_a_reported_failure_is_printed_at_once_and_a_blocked_teardown_cannot_keep_the_process(tears_down):
    import subprocess
    import sys

    teardown = "health.torn_down(); time.sleep(1.5)" if tears_down else "time.sleep(60)"  # 60 s: blocked
    code = f"import time; from torchacco import health; health.TEARDOWN_S = 0.5; health.report('x\\n y'); {teardown}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.stderr == "torchacco: error: x y\n"
    assert proc.returncode == (0 if tears_down else 1)


def test_error_lines_of_ranks_sharing_stderr_never_interleave():
    """Ranks print their diagnosis at the same moment into the launcher's stderr: each line is one write."""
    import os
    import re
    import subprocess
    import sys

    code = "from torchacco.errors import print_error\nfor _ in range(300): print_error('rank %d: ' + 'x' * 900)"
    read, write = os.pipe()
    ranks = [subprocess.Popen([sys.executable, "-c", code % r], stderr=write) for r in range(3)]
    os.close(write)
    with open(read) as shared:
        lines = shared.read().splitlines()
    assert all(rank.wait(timeout=60) == 0 for rank in ranks)
    assert len(lines) == 900 and all(re.fullmatch(r"torchacco: error: rank \d: x{900}", line) for line in lines)


def test_waiting_for_the_jobs_kernels_has_a_deadline():
    from torchacco.errors import Stalled
    from torchacco.runners import wait_for_event

    class Event:  # as torch.cuda.Event: query() says whether the recorded kernels have finished
        def __init__(self, after: int):
            self.polls, self.after = 0, after

        def query(self) -> bool:
            self.polls += 1
            return self.polls > self.after

    wait_for_event(Event(after=5), timeout_s=5.0)
    with pytest.raises(Stalled, match="made no progress for 0 s"):
        wait_for_event(Event(after=10**9), timeout_s=0.05)


def test_the_flight_recorder_is_written_where_nccls_timeout_dump_goes(tmp_path, monkeypatch):
    import threading
    import time

    from torchacco.parallel.process_groups import dump_flight_recorder

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    assert dump_flight_recorder(tmp_path, 3, dump=lambda: b"trace") is None  # the recorder is off
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    path = dump_flight_recorder(tmp_path / "run", 3, dump=lambda: b"trace")
    assert path == tmp_path / "run" / "flight_recorder" / "rank_3" and path.read_bytes() == b"trace"

    def failing():
        raise RuntimeError("the recorder is gone")

    assert dump_flight_recorder(tmp_path / "run", 4, dump=failing) is None
    never = threading.Event()  # a dump blocked on a lock held beside the hang: the diagnosis goes on
    start = time.monotonic()
    assert dump_flight_recorder(tmp_path / "run", 5, dump=never.wait, timeout_s=0.2) is None
    assert time.monotonic() - start < 2


def test_the_flight_recorder_and_nccls_dump_on_timeout_are_on_by_default_and_a_users_setting_is_kept(
    tmp_path, monkeypatch
):
    from torchacco.parallel.process_groups import nccl_flight_recorder

    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    nccl_flight_recorder(tmp_path)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # without it NCCL's watchdog aborts without a dump
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    nccl_flight_recorder(tmp_path)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_the_diagnosis_names_the_rank_that_has_not_entered_the_collective_the_others_are_in():
    from torchacco.health import behind

    def beat(where, **groups):
        return {"beat": 5, "where": where, "collectives": {g: list(c) for g, c in groups.items()}}

    in_job = "wait for the communication job (step 3)"
    beats = {
        0: beat(in_job, dp=(12, "reduce_scatter"), tp=(4, "all_gather")),
        1: beat("compute (step 3)", dp=(11, "all_gather"), tp=(4, "all_gather")),
        2: beat(in_job, dp=(12, "reduce_scatter")),  # (not in the tp group)
    }
    said = behind(beats)
    assert said == (
        "rank 1 has not entered the reduce-scatter that ranks 0, 2 are in (their reduce-scatter or all-gather #12; "
        "rank 1 entered 11): rank 1 is alive, in compute (step 3)"
    )
    beats[1]["collectives"]["dp"][0] = 12  # every rank inside the same collective: nobody lags
    assert behind(beats) is None
    # Counted per group: DiLoCo's replicas step apart, and each replica's group is compared alone.
    assert behind({0: beat(in_job, a=(40, "all_gather")), 1: beat(in_job, b=(30, "all_gather"))}) is None
    assert behind({0: beat(in_job), 1: {"beat": 3, "where": in_job}}) is None  # nothing entered yet


def _resume_rank(rank: int, store_path: str, folder: str, out: str) -> None:
    """Rank 1's node lists the checkpoint folder as it was two saves ago (a network filesystem's stale cache)."""
    from datetime import timedelta
    from pathlib import Path

    import torchacco.checkpoint as checkpoint
    from torchacco.config import Checkpoint

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    if rank == 1:
        listed = checkpoint.step_dirs
        checkpoint.step_dirs = lambda f: [(s, p) for s, p in listed(f) if s <= 2]
    loaded = []
    checkpoint.Checkpointer.load = lambda self, path, state: loaded.append(path.name)
    dims = SimpleNamespace(rank=rank, data_size=2)
    state = SimpleNamespace(dp_size=2, step=0, tokens=0.0)
    strategy = SimpleNamespace(
        checkpoint_key=lambda dims: "model", traits=SimpleNamespace(resume_needs_same_ranks=True)
    )
    c = Checkpoint(enable=True, resume=True)
    checkpoint.resume(c, Path(folder), dims, strategy, state, None, timedelta(seconds=30))
    Path(f"{out}.{rank}").write_text(",".join(loaded))
    dist.destroy_process_group()


@pytest.mark.integration
def test_every_rank_resumes_from_the_step_rank_0_lists_even_beside_a_stale_listing(tmp_path):
    import torch.multiprocessing as mp

    for step in (2, 4):
        (tmp_path / "run" / "checkpoint" / f"step-{step:08d}").mkdir(parents=True)
    out = str(tmp_path / "loaded")
    mp.spawn(_resume_rank, args=(str(tmp_path / "store"), str(tmp_path / "run"), out), nprocs=2)
    loaded = [open(f"{out}.{rank}").read() for rank in range(2)]
    assert loaded == ["step-00000004,step-00000004"] * 2, loaded


LLAMA_PP2 = ("--model.name", "llama3", "--parallelism.pipeline_parallel_degree", "2")  # as the other pipeline tests
HANG_TIMEOUT_S = 45  # the watchdog's deadline: 36 s (torchacco/runners.py's stall_deadline_s), gloo's own 9 s later


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.parametrize(
    "extra",
    [
        ("--parallelism.data_parallel", "zero1"),
        ("--parallelism.data_parallel", "fsdp"),
        ("--parallelism.data_parallel", "ddp"),
        ("--parallelism.data_parallel", "zero1", "--parallelism.tensor_parallel_degree", "2"),
        ("--parallelism.data_parallel", "zero1", *LLAMA_PP2),
        ("--parallelism.data_parallel", "hsdp", "--hsdp.shard_degree", "1"),  # 2 replicas: the cross-replica all-reduce
    ],
    ids=["zero1", "fsdp", "ddp", "tp2", "pp2", "hsdp"],
)
def test_a_collective_hung_on_the_main_thread_ends_in_one_line_naming_the_rank_and_the_collective(
    tiny_corpus, cache_dir, tmp_path, extra
):
    """Rank 1 waits inside the communication library from step 3 (a receive no peer answers), the other rank in
    its next collective, both on the main thread (no overlapped schedule's timed wait): each rank's watchdog ends
    it with one line naming the rank, the collective and the diagnosis before the collective timeout (where NCCL's
    watchdog would abort without a word), having written its flight recorder."""
    import re
    import time

    args = tiny_args(tiny_corpus, cache_dir, tmp_path / "out", *extra, "--training.steps", "40", "--eval.every", "0",
                     "--training.collective_timeout_s", str(HANG_TIMEOUT_S))  # fmt: skip
    started = time.monotonic()
    env = {"TORCHACCO_FAULT": "hang@rank1:step3", "TORCH_FR_BUFFER_SIZE": "2000"}
    proc = run_train(args, env=env, timeout=240)
    elapsed = time.monotonic() - started
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert errors, proc.stderr[-3000:]
    for line in errors:  # the watchdog's words, not gloo's own timeout ("a collective failed")
        assert re.match(r"torchacco: error: rank [01]: its (gloo:)?[\w-]+( \(#\d+\))? on process group \d+ made no "
                        r"progress for 3\d s during its .*\(step [34]\)", line), line  # fmt: skip
    assert any(line.startswith("torchacco: error: rank 1: its recv") for line in errors), errors
    assert elapsed < 150, elapsed
    assert sorted(p.name for p in (tmp_path / "out" / "flight_recorder").iterdir())


@pytest.mark.integration
def test_acco_under_tensor_parallelism_issues_on_each_process_group_from_one_thread(tiny_corpus, cache_dir, tmp_path):
    """NCCL's communicators must not be driven by two host threads. A 2-rank ACCO run at tp 2 (its job's thread
    beside the compute thread's tensor-parallel collectives), with an evaluation: every collective torch's flight
    recorder saw (DTensor's from C++ included), each group issued on by one thread only over the whole run. Measured
    without the suite's own check (collectives.py), which would stop the run at the first."""
    import json
    import sys

    from conftest import ROOT

    argv = tiny_args(tiny_corpus, cache_dir, tmp_path / "run", "--parallelism.data_parallel", "acco",
                     "--parallelism.tensor_parallel_degree", "2", "--training.global_batch_size", "8",
                     "--training.steps", "4", "--eval.every", "2", "--eval.batches", "1")  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps([argv]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "20000"}
    env.pop("TORCHACCO_CHECK_COLLECTIVE_THREADS")
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              str(ROOT / "tests" / "workers" / "model_parallel_worker.py"), str(tmp_path / "runs.json")]  # fmt: skip
    proc = subprocess.run(worker, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        log = json.loads((tmp_path / "run" / f"collectives_rank{rank}.json").read_text())
        threads = {}
        for c in log["collectives"]:
            threads.setdefault(c["group"], set()).add(c["thread"])
        assert set(log["comm_threads"]) & set().union(*threads.values()), "the job thread issued nothing"
        assert all(len(t) == 1 for t in threads.values()), f"rank {rank}: groups issued on by two threads: {threads}"


def _threads_per_group(folder, ranks: int) -> list[tuple[dict, dict]]:
    """Per rank of a model_parallel_worker run with TORCH_FR_BUFFER_SIZE: (its log, group -> threads issuing on it)."""
    import json

    logs = []
    for rank in range(ranks):
        log = json.loads((folder / f"collectives_rank{rank}.json").read_text())
        threads = {}
        for c in log["collectives"]:
            threads.setdefault(c["group"], set()).add(c["thread"])
        logs.append((log, threads))
    return logs


@pytest.mark.integration
@pytest.mark.slow
def test_streaming_dilocos_transfer_beside_fsdp_issues_on_each_process_group_from_one_thread(
    tiny_corpus, cache_dir, tmp_path
):
    """Streaming DiLoCo at τ = 1 over 2 replicas of 2 FSDP ranks: each fragment's transfer runs on the side thread
    (on a replica group of its own) while the main thread gathers and reduce-scatters FSDP's shards. Under the suite's
    check (collectives.py raises on a second issuing thread) and torch's flight recorder (every collective, those
    issued from C++ included): the run finishes, the side thread issued, and no group saw two threads."""
    import json
    import sys

    from conftest import ROOT

    argv = tiny_args(tiny_corpus, cache_dir, tmp_path / "run", "--parallelism.replicas", "2",
                     "--parallelism.data_parallel", "fsdp", "--diloco.sync_every", "10", "--diloco.overlap_steps", "1",
                     "--diloco.fragments", "2", "--training.global_batch_size", "16", "--training.steps", "11",
                     "--eval.every", "0")  # fmt: skip
    (tmp_path / "runs.json").write_text(json.dumps([argv]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "20000"}
    assert env["TORCHACCO_CHECK_COLLECTIVE_THREADS"] == "1"
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
              str(ROOT / "tests" / "workers" / "model_parallel_worker.py"), str(tmp_path / "runs.json")]  # fmt: skip
    proc = subprocess.run(worker, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    stdout = (tmp_path / "run" / "stdout.txt").read_text()
    assert "error" not in stdout, stdout[-2000:]
    for rank, (log, threads) in enumerate(_threads_per_group(tmp_path / "run", 4)):
        side = set(log["comm_threads"])
        ranks_of = {g: log["group_ranks"][g] for g, t in threads.items() if t & side}
        # the side thread issued, on the replica group alone (one rank of each replica), FSDP's on the main thread
        assert list(ranks_of.values()) == [[rank % 2, rank % 2 + 2]], f"rank {rank}: the transfer issued on {ranks_of}"
        fsdp = [g for g, r in log["group_ranks"].items() if r == [rank // 2 * 2, rank // 2 * 2 + 1]]
        assert len(fsdp) == 1 and threads[fsdp[0]] == {log["main_thread"]}, f"rank {rank}: {threads}"
        assert all(len(t) == 1 for t in threads.values()), f"rank {rank}: groups issued on by two threads: {threads}"
