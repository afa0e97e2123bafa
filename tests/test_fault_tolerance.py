"""Fault-tolerant DiLoCo replicas ([diloco] fault_tolerant) over torchft: each replica its own torchrun job
under one ./run_train.sh. Without failures the losses are today's DiLoCo's, bit for bit; a replica killed
mid-period leaves survivors whose losses equal today's DiLoCo with that replica's pseudo-gradients weighed 0
from that outer step on (`mute`, faults.py); a restarted replica heals to its donor's state, element for
element; impossible settings are one line each."""

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, read_metrics, run_train, tiny_args
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchacco.config import load_config
from torchacco.errors import UserError
from torchacco.fault_tolerance import ReplicaLink, copy_into
from torchacco.validate import validate

FT = ("--diloco.fault_tolerant", "true")
# Longer than a replica's restart (torchrun's relaunch, imports, the build: about 8 s on a busy 2-core machine), and
# well within the quorum's join timeout (60 s), during which the restarted replica waits for the paused one.
RESTART_S = 30


def replica_args(
    corpus: Path,
    cache: Path,
    out: Path,
    replicas: int,
    *extra: str,
    steps: int = 12,
    schedule: int = 12,
    ranks: int = 1,
    per_rank: int = 4,
) -> list[str]:
    """Replicas of one rank (ddp), H = 3, one thread per rank: the runs with and without torchft compute alike.
    The lr schedule spans `schedule` updates (max_tokens), so a run stopped early follows the same one."""
    return tiny_args(
        corpus, cache, out, "--parallelism.replicas", str(replicas), "--parallelism.data_parallel", "ddp",
        "--diloco.sync_every", "3", "--training.global_batch_size", str(per_rank * replicas * ranks),
        "--training.steps", str(steps), "--training.max_tokens", str(schedule * per_rank * replicas * ranks * 64),
        "--training.num_threads", "1",
        "--eval.every", "0", *extra,
    )  # fmt: skip


def losses(folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(folder)]


@pytest.mark.slow  # two whole runs compared
def test_without_failures_the_losses_are_todays_diloco_bit_for_bit(tiny_corpus, cache_dir, tmp_path):
    """Also when the whole run stops at step 6 and resumes from its replicas' checkpoints: each keeps its own."""
    plain = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "plain", 2))
    assert plain.returncode == 0, plain.stderr[-3000:]
    ft = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "ft", 2, *FT))
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert losses(tmp_path / "ft") == losses(tmp_path / "plain")
    assert len(losses(tmp_path / "ft" / "replica_1")) == 12  # the other replica's folder, inside the run's
    outer = [r for r in read_metrics(tmp_path / "ft") if "outer_step" in r]
    assert [r["outer_replicas"] for r in outer] == [2, 2, 2, 2]
    save = ("--checkpoint.enable", "true", "--checkpoint.every", "3")
    for steps in (6, 12):
        half = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "resumed", 2, *FT, *save, steps=steps))
        assert half.returncode == 0, half.stderr[-3000:]
    assert "healed" not in half.stdout
    assert losses(tmp_path / "resumed") == losses(tmp_path / "plain")


@pytest.mark.parametrize(
    "replicas, kill",
    [
        pytest.param(2, "kill@replica1:rank0:step5", marks=pytest.mark.faults),
        pytest.param(3, "kill@replica2:rank0:step5", marks=pytest.mark.slow),
        pytest.param(2, "kill_mid_transfer@replica1:rank0:step6", marks=pytest.mark.faults),
    ],
    ids=["2", "3", "2-mid-transfer"],
)
def test_a_killed_replica_leaves_survivors_that_merge_only_the_live(tiny_corpus, cache_dir, tmp_path, replicas, kill):
    """The last replica is SIGKILLed as it starts step 5 (mid-period: outer steps after 3, 6, 9, 12), or in the
    outer step after update 6 once it has sent its first message (mid-transfer), and not restarted; the others
    finish, and their losses are those of today's DiLoCo in which that replica's pseudo-gradients weigh nothing
    from that step on (5, or the outer step after 6)."""
    lost, step = replicas - 1, kill.rsplit("step", 1)[1]
    env = {"TORCHACCO_FAULT": kill}
    ft = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "ft", replicas, *FT), nproc=replicas, env=env)
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert f"replica(s) {lost} failed for good; the others finished the run" in ft.stderr
    if kill.startswith("kill_mid_transfer"):  # it died inside the round the survivor had begun with it
        assert "replica 0: outer step round 1 failed" in ft.stdout, ft.stdout[-3000:]
    env = {"TORCHACCO_FAULT": f"mute@replica{lost}:step{step}"}
    reference = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "ref", replicas), nproc=replicas, env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    for survivor in range(replicas - 1):
        folder = tmp_path / "ft" / (f"replica_{survivor}" if survivor else "")
        assert len(losses(folder)) == 12
        if survivor == 0:  # (the reference logs replica 0's)
            assert losses(folder) == losses(tmp_path / "ref")
        outer = [r["outer_replicas"] for r in read_metrics(folder) if "outer_step" in r]
        assert outer == [replicas] + [replicas - 1] * 3


@pytest.mark.faults
def test_a_replica_frozen_mid_transfer_is_left_behind_and_heals_back(tiny_corpus, cache_dir, tmp_path):
    """Replica 1 stops (SIGSTOP) in its outer step after update 6, its first message sent, for 4 s. The survivor's
    round fails after round_timeout_s (2 s), runs again without it and goes on: its losses are today's DiLoCo's
    with replica 1 weighed 0 from that outer step until replica 1, awake, heals from it (weight 0 in that round
    too). Both finish (the survivor's 300 updates outlast the freeze); the survivor names each change of the
    replicas present in one line."""
    args = ("--diloco.round_timeout_s", "2", "--diloco.join_timeout_s", "5")
    env = {"TORCHACCO_FAULT": "freeze@replica1:rank0:step6:4s"}
    ft = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "ft", 2, *FT, *args, steps=300, schedule=300),
                   nproc=2, env=env)  # fmt: skip
    assert ft.returncode == 0, ft.stderr[-3000:]
    assert "replica 1 healed from a live replica" in ft.stdout, ft.stdout[-3000:]
    assert "replica 0: outer step round 1 failed" in ft.stdout, ft.stdout[-3000:]
    assert "replica 0: 1 of 2 replicas in this outer step (were 2)" in ft.stdout
    assert "replica 0: 2 of 2 replicas in this outer step (were 1)" in ft.stdout
    records = read_metrics(tmp_path / "ft")
    present = [(r["step"], r["outer_replicas"]) for r in records if "outer_step" in r]
    assert present[:2] == [(3, 2), (6, 1)], present
    back = next(step for step, n in present[2:] if n == 2)  # the round replica 1 healed in
    assert all(n == 1 for step, n in present if 6 <= step < back)
    env = {"TORCHACCO_FAULT": "mute@replica1:step6"}  # (its outer steps from the one after update 6)
    reference = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "ref", 2, steps=300, schedule=300), env=env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert losses(tmp_path / "ft")[: back + 1] == losses(tmp_path / "ref")[: back + 1]
    assert read_metrics(tmp_path / "ft" / "replica_1")[-1]["step"] == 300


def checkpoint(folder: Path, tmp_path: Path) -> dict:
    """A DCP checkpoint as one dict; the strategy's entry (its key names the replica) as 'strategy'."""
    out = tmp_path / f"{folder.parent.parent.name}_{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    state = torch.load(out, weights_only=False)
    return {"strategy" if k.startswith("replica") else k: v for k, v in state.items()}


def leaves(tree, path: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from leaves(v, f"{path}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from leaves(v, f"{path}/{i}")
    else:
        yield path, tree


@pytest.mark.parametrize(
    "kind, ranks, steps",
    [
        pytest.param("ddp", 1, 45, marks=pytest.mark.faults, id="ddp-1-45"),
        pytest.param("zero1", 2, 150, marks=pytest.mark.slow, id="zero1-2ranks"),
        pytest.param("fsdp", 2, 150, marks=pytest.mark.slow, id="fsdp-2ranks"),
        pytest.param("acco", 1, 45, marks=pytest.mark.slow, id="acco"),
    ],
)
def test_a_restarted_replica_heals_to_its_donors_state(tiny_corpus, cache_dir, tmp_path, kind, ranks, steps):
    """Replica 1 loses a rank at step 5 and restarts (MAX_RESTARTS=1) while replica 0 pauses at step 7 (so that it is
    still running on any machine when replica 1 is back): replica 1 heals from replica 0 at an outer step and
    checkpoints there as replica 0 does: every tensor of both checkpoints (θ_global, the outer momentum, the inner
    strategy's model and optimizer state, rank for rank with ZeRO-1's and FSDP's shards) and the loop's counts are
    equal. The run finishes with both replicas, and the run again from a later checkpoint repeats it bit for bit."""
    save = ("--checkpoint.enable", "true", "--checkpoint.every", "3", "--checkpoint.keep", "0")
    inner = ("--parallelism.data_parallel", kind)
    per_rank = 8 if kind == "acco" else 4  # (ACCO: two micro-batches per update, the estimate's and the commit's)
    env = {"TORCHACCO_FAULT": f"kill@replica1:rank{ranks - 1}:step5,pause@replica0:rank0:step7:{RESTART_S}s",
           "MAX_RESTARTS": "1"}  # fmt: skip
    args = replica_args(tiny_corpus, cache_dir, tmp_path / "ft", 2, *FT, *save, *inner, steps=steps, schedule=steps,
                        ranks=ranks, per_rank=per_rank)  # fmt: skip
    ft = run_train(args, nproc=2 * ranks, env=env)
    assert ft.returncode == 0, ft.stderr[-3000:]
    joined = re.search(r"replica 1 joined the run at step (\d+); its updates 4-(\d+) before it stopped", ft.stdout)
    assert joined and "healed from a live replica" in ft.stdout, ft.stdout[-3000:]
    step = int(joined[1])
    assert 6 <= step < steps and step % 3 == 0
    name = f"step-{step:08d}"
    donor = checkpoint(tmp_path / "ft" / "checkpoint" / name, tmp_path)
    healed = checkpoint(tmp_path / "ft" / "replica_1" / "checkpoint" / name, tmp_path)
    assert donor["train"] == healed["train"]
    a, b = dict(leaves(donor["strategy"])), dict(leaves(healed["strategy"]))
    assert a.keys() == b.keys() and len(a) > 20
    different = [k for k in a if (not torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] != b[k])]
    assert not different, different[:10]
    assert joined[2] == "4"  # killed as it started step 5: update 4 was its last, and it died with it
    outer = [r["outer_replicas"] for r in read_metrics(tmp_path / "ft") if "outer_step" in r]
    assert outer[-1] == 2 and len(outer) == steps // 3
    # A checkpoint taken after the heal resumes exactly: the run again from it, both replicas, equals the first.
    resume_at = min(step + 6, steps - 3)
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "ft", again)
    for saved in [*again.glob("checkpoint/step-*"), *again.glob("replica_1/checkpoint/step-*")]:
        if int(saved.name.removeprefix("step-")) > resume_at:
            shutil.rmtree(saved)
    args = replica_args(tiny_corpus, cache_dir, again, 2, *FT, *save, *inner, steps=steps, schedule=steps, ranks=ranks,
                        per_rank=per_rank)  # fmt: skip
    resumed = run_train(args, nproc=2 * ranks)
    assert resumed.returncode == 0 and "healed" not in resumed.stdout, resumed.stderr[-3000:]
    for replica in ("", "replica_1"):
        first, second = (
            [(r["step"], r["loss"]) for r in read_metrics(run / replica) if r["step"] > resume_at]
            for run in (tmp_path / "ft", again)
        )
        assert len(first) == steps - resume_at and second == first


def test_impossible_settings_are_one_line(tmp_path, monkeypatch):
    def check(*overrides: str) -> str:
        with pytest.raises(UserError) as e:
            validate(load_config(["--parallelism.replicas", "2", *FT, *overrides]), world_size=2, here=False)
        return str(e.value)

    assert "min_replicas = 3 can never be met" in check("--diloco.min_replicas", "3")
    assert "round_timeout_s = 0 must be positive" in check("--diloco.round_timeout_s", "0")
    assert "set overlap_steps = 0" in check("--diloco.sync_every", "4", "--diloco.overlap_steps", "1")
    assert "set topk = 0" in check("--diloco.topk", "0.01")
    assert "set outer_dtype = 'fp32'" in check("--diloco.outer_dtype", "bf16")
    assert "set balance_replicas = false" in check("--diloco.balance_replicas", "true", "--training.max_tokens", "9999")
    monkeypatch.setenv("TORCHACCO_REPLICA", "2")
    assert "number the replicas' jobs 0 to 1" in check()
    monkeypatch.setenv("TORCHACCO_REPLICA", "one")
    assert "TORCHACCO_REPLICA=one is not a replica number" in check()
    monkeypatch.delenv("TORCHACCO_REPLICA")
    one_replica = r"fault_tolerant set: they shape the exchange between replicas, and \[parallelism\] replicas = 1"
    with pytest.raises(UserError, match=one_replica):
        validate(load_config([*FT]), world_size=2, here=False)


@pytest.mark.faults  # waits out the lighthouse's connect timeout
def test_an_unreachable_lighthouse_is_one_line(tiny_corpus, cache_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {"TORCHACCO_REPLICA": "0", "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}  # (a replica's job, as on a cluster)  # fmt: skip
    proc = run_train(replica_args(tiny_corpus, cache_dir, tmp_path / "run", 2, *FT), nproc=1, env=env, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert errors and "no lighthouse answers at http://127.0.0.1:9" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_peer_laid_out_otherwise_is_refused_and_a_state_is_copied_in_place():
    link = object.__new__(ReplicaLink)
    link.replica, link.layout, link._state = 1, "1 ranks, ddp, tp 1, pp 1", (None, None)
    with pytest.raises(UserError, match="cannot heal from a replica laid out otherwise"):
        link._load({"layout": "2 ranks, ddp, tp 1, pp 1"})
    mine = {"w": torch.zeros(3), "n": 1, "moments": [torch.zeros(2)], "new": None}
    got = copy_into(mine, {"w": torch.ones(3), "n": 5, "moments": [torch.full((2,), 2.0)], "new": torch.ones(1)})
    assert got["w"] is mine["w"] and torch.equal(mine["w"], torch.ones(3)) and got["n"] == 5
    assert got["moments"][0] is mine["moments"][0] and torch.equal(mine["moments"][0], torch.full((2,), 2.0))
    assert torch.equal(got["new"], torch.ones(1))


def test_the_lighthouse_command_starts_and_prints_its_address():
    proc = subprocess.Popen([sys.executable, "-m", "torchacco", "lighthouse", "--bind", "[::]:0"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        assert line.startswith("torchacco: lighthouse at http://") and "TORCHFT_LIGHTHOUSE=" in line, line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_goodput_report_states_the_ratios_each_fault_and_each_heal_against_the_link():
    from benchmarks.cluster import ClusterPlan
    from benchmarks.fault_goodput import agent, main, markdown, survivor_waits

    run = {"wall_s": 100.0, "train_s": 80.0, "updates": 1000, "merged_tokens": 2e6, "final_val_loss": 4.0,
           "replicas_per_outer_step": [2] * 100, "faults": [], "survivor_waits_s": [], "heals": []}  # fmt: skip
    faults = [{"kind": "kill", "at_s": 30.0}, {"kind": "cut", "at_s": 60.2},
              {"kind": "stall", "mid_transfer": False, "at_s": 90.4}]  # fmt: skip
    faulted = {**run, "wall_s": 110.0, "train_s": 88.0, "merged_tokens": 1.9e6, "final_val_loss": 4.02,
               "replicas_per_outer_step": [2] * 90 + [1] * 10, "faults": faults, "survivor_waits_s": [12.1, 3.0],
               "heals": [{"wait_and_copy_s": 1.3, "mib": 13.6, "copy_s": 1.06}]}  # fmt: skip
    meta = {"date": "2026-11-27", "machine": "m", "command": "c"}
    text = markdown({"meta": meta, "link_mbit_s": 114.0, "every_s": 30.0, "outage_s": 20.0, "undisturbed": run,
                     "faulted": faulted})  # fmt: skip
    assert "goodput **0.909**" in text and "| +0.50% |" in text
    said = "30 s: SIGKILLed; 60 s: link cut mid-transfer for 20 s; 90 s: stopped mid-transfer for 20 s (no transfer"
    assert said in text
    assert "| outer steps with one replica | 10 of 100 |" in text and "over 1 s: 12.1, 3 s (undisturbed: none)" in text
    assert "| 1 | 1.3 | 1.06 | 13.6 | 1.00 | 1.06 |" in text  # 13.6 MiB over 114 Mbit/s: 1.00 s
    records = [{"tokens_per_update": 100.0, "tokens_per_s": 1000.0}, {"tokens_per_update": 100.0, "tokens_per_s": 50.0}]
    assert survivor_waits(records) == [2.0]
    for bad in (
        ["--faults", "kill,flood"],
        ["--every", "30", "--outage-s", "30"],
        ["--undisturbed-from", "/no/such.json"],
    ):
        with pytest.raises(SystemExit):
            main(bad)
    argv = agent(ClusterPlan(nodes=2), 1, ["--x"])
    assert argv[-3:] == ["-m", "torchacco.train", "--x"]
    assert "is_host=1" in argv and argv[argv.index("--rdzv_endpoint") + 1].startswith("10.77.0.")


def test_the_goodput_faults_come_in_turn_and_each_outage_ends(monkeypatch):
    import benchmarks.fault_goodput as bench
    from benchmarks.cluster import ClusterPlan

    signals = []
    monkeypatch.setattr(bench, "worker", lambda replica: 4242)
    monkeypatch.setattr(bench, "wait_for_transfer", lambda pid: True)
    monkeypatch.setattr(bench.os, "kill", lambda pid, sig: signals.append(sig))
    injector = bench.Injector(ClusterPlan(nodes=2), ["kill", "stall"], every=0.2, outage_s=0.1)
    started = time.monotonic()
    while len(injector.events) < 3 or injector._undo:
        injector.poll(started)
        time.sleep(0.01)
    assert [e["kind"] for e in injector.events] == ["kill", "stall", "kill"]
    assert signals == [signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL]
    assert all(e["at_s"] >= 0.2 * i - 0.05 for i, e in enumerate(injector.events, 1))  # (every 0.2 s, at 0.1 s)


def test_a_round_goes_through_torchfts_wrapper_and_a_failed_collective_is_the_managers_not_an_exception(
    monkeypatch, capsys
):
    """The round's group is torchft's managed wrapper over its own process group (on NCCL, the one that aborts
    a lost peer's communicator), never the bare group under it; a collective's failure is recorded by the manager,
    returns at once, and the round runs again, so a survivor never blocks on a lost peer."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from torchft.process_group import ManagedProcessGroup, ProcessGroupGloo

    from torchacco.fault_tolerance import start_lighthouse

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    lighthouse = start_lighthouse(1, 5.0, bind="127.0.0.1:0")
    options = SimpleNamespace(lighthouse=lighthouse.address(), round_timeout_s=10.0, min_replicas=1)
    dims = SimpleNamespace(rank=0, world_size=1, timeout=timedelta(seconds=30))
    link = ReplicaLink(options, 0, 1, dims, "cpu", "1 ranks, ddp, tp 1, pp 1")
    groups = []

    def exchange(group):
        groups.append(group)
        if len(groups) == 1:  # as gloo's error on a lost peer: the manager holds it, the collective returns
            link.manager.report_error(RuntimeError("Connection closed by peer"))
        t = torch.full((3,), 2.0)
        dist.all_reduce(t, group=group)
        return t

    try:
        link.heal_with(lambda: {}, lambda state: None)
        assert torch.equal(link.round(exchange), torch.full((3,), 2.0))
    finally:
        link.close()
        lighthouse.shutdown()
        dist.destroy_process_group()
    assert len(groups) == 2 and all(isinstance(g, ManagedProcessGroup) for g in groups)
    assert groups[0]._manager is link.manager and isinstance(link.manager._pg, ProcessGroupGloo)
    assert "outer step round 1 failed (Connection closed by peer)" in capsys.readouterr().out
