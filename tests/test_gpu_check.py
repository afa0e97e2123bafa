"""benchmarks/gpu_check.py, the prepared GPU check, on a machine without a GPU: its plan and dry run,
its CLI errors, and its parent's bookkeeping (a step cut at its limit, the next step still run)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
from conftest import ROOT

from benchmarks import gpu_check

PLAN_LINE = re.compile(r"^(\d)\. (\S+) \((\d+) s\)")


def planned(out: str) -> list[tuple[str, int]]:
    return [(m[2], int(m[3])) for m in map(PLAN_LINE.match, out.splitlines()) if m]


def test_the_dry_run_plans_the_six_steps_in_order_within_the_budget(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = planned(out)
    assert [name for name, _ in steps] == ["env", "cuda-tests", "parity", "throughput", "stall", "torchtitan"]
    assert sum(limit for _, limit in steps) <= 780
    assert "tests/test_cuda.py" in out and "TORCHACCO_FAULT='stall@rank0:step3'" in out
    # a subset keeps the order above; a smaller budget shrinks every limit to fit
    assert gpu_check.main(["--dry-run", "--steps", "stall,env", "--budget-s", "60"]) == 0
    steps = planned(capsys.readouterr().out)
    assert [name for name, _ in steps] == ["env", "stall"] and sum(limit for _, limit in steps) <= 60


MULTI = ["env", "parity", "acco-tp-pp", "diloco-fsdp", "memory-8b", "async-save-resume", "hung-collective",
         "torchft-nccl"]  # fmt: skip


def test_the_multi_gpu_dry_run_plans_its_steps_in_order_on_one_node_and_two(capsys):
    """Every command is checked as the launcher would check it for its world size (8 ranks, then 2 nodes × 8)."""
    assert gpu_check.main(["--dry-run", "--nproc", "8"]) == 0
    out = capsys.readouterr().out
    assert [name for name, _ in planned(out)] == MULTI
    for kind in ("ddp", "zero1", "fsdp", "acco"):  # dp 8 on the GPUs, compiled and eager; the CPU's reference
        assert all(f"   {kind}_{mode}: NPROC='8' " in out for mode in ("eager", "compiled"))
    for kind in ("zero1", "fsdp", "acco"):  # with Muon: dp 8 on the GPUs against 2 CPU ranks
        assert f"   muon_{kind}: NPROC='8' " in out and f"   muon_{kind}_cpu: " in out
        assert f"   {kind}_cpu: CUDA_VISIBLE_DEVICES=''" in out
    assert "   tp2_dp4: " in out and "   tp2_pp2_dp2: " in out and "   2x_fsdp4: " in out
    assert "--dry-run 1x8" in out and "--checkpoint.async_save true" in out and "freeze@replica1" in out
    two = ["--dry-run", "--nproc", "8", "--nnodes", "2", "--node-rank", "1", "--master-addr", "node0"]
    assert gpu_check.main([*two, "--steps", "acco-tp-pp,memory-8b"]) == 0
    out = capsys.readouterr().out
    assert "   tp2_pp2_dp4: NPROC='8' NNODES='2' NODE_RANK='1' MASTER_ADDR='node0'" in out and "--dry-run 2x8" in out


def test_the_multi_gpu_check_needs_a_multiple_of_4_gpus(capsys):
    assert gpu_check.main(["--dry-run", "--nproc", "6"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "torchacco: error: --nproc 6: the multi-GPU check needs a multiple of 4 (tp 2 × pp 2)"
    ]


def test_a_worker_is_found_by_its_rank_and_stopped_then_killed(tmp_path):
    """The hung-collective and torchft steps' machinery: a worker found by its dump folder and RANK, SIGSTOPped."""
    folder = str(tmp_path / "run")
    worker = [sys.executable, "-c", "import time; time.sleep(60)", "torchacco.train", "--job.dump_folder", folder]
    seen = []

    def stop(pid):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.2)
        seen.append((pid, gpu_check.workers(folder, "T")))

    code, _ = gpu_check.disturbed(worker, {"RANK": "1"}, lambda: gpu_check.workers(folder).get(1), stop, 3)
    [(pid, stopped)] = seen
    assert stopped == {1: pid} and code == -signal.SIGKILL  # stopped, then killed at the limit


def test_the_dry_run_fails_on_a_command_that_would_not_start(monkeypatch, capsys):
    names = gpu_check.compared()
    monkeypatch.setattr(gpu_check, "compared", lambda: ("acc0", *names[1:]))
    assert gpu_check.main(["--dry-run", "--steps", "parity"]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert errors and all(line.startswith("torchacco: error: parity/") and "acc0" in line for line in errors)


def test_an_unknown_step_is_one_error_line_and_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "gpu-check", "--steps", "env,nope", "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "torchacco: error: --steps: unknown step 'nope'; the steps are env, cuda-tests, parity, throughput, "
        "stall, torchtitan"
    ]


def test_a_step_past_its_limit_is_recorded_and_the_next_step_runs(monkeypatch, tmp_path):
    hang = "print('PART ' + '{\"check\": \"before the hang\"}', flush=True); import time; time.sleep(60)"
    steps = [
        gpu_check.Step("hang", 1, "prints a part, then hangs", child=[sys.executable, "-c", hang]),
        gpu_check.Step("crash", 5, "exits without a result", child=[sys.executable, "-c", "raise SystemExit(3)"]),
        gpu_check.Step("after", 5, "passes", child=[sys.executable, "-c", 'print(\'RESULT {"status": "passed"}\')']),
    ]
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    out = tmp_path / "summary.json"
    started = time.monotonic()
    assert gpu_check.main(["--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "100"]) == 0
    assert time.monotonic() - started < 15
    summary = json.loads(out.read_text())
    assert summary["date"] and summary["machine"] and "gpu-check" in summary["command"]
    hung, crashed, after = summary["steps"]
    assert hung["status"] == "timed out after 1 s" and hung["parts"] == [{"check": "before the hang"}]
    assert crashed["status"] == "failed: exit code 3, no result"
    assert after["status"] == "passed" and after["step"] == "after"
    assert summary["result"] == "1 passed, 1 failed, 1 timed out, 0 skipped"


def test_steps_whose_needs_are_absent_are_skipped_with_the_reason(tmp_path):
    ctx = Namespace(work=tmp_path, wheels=tmp_path / "none", titan_assets=tmp_path / "no-assets")
    titan = gpu_check.titan_step(ctx)
    assert titan["status"].startswith("skipped: torchtitan cannot run here: missing ")
    assert str(tmp_path / "no-assets" / "tests/assets/c4_test") in titan["status"]
    # the suite hides the GPUs from itself (conftest.py)
    assert gpu_check.stall_step(ctx) == {"status": "skipped: no GPU"}


def test_the_throughput_reference_is_the_measured_8_layer_case():
    rows = json.loads((ROOT / "bench_results" / "gpu_mfu.json").read_text())
    assert next(r["mfu"] for r in rows if r["name"] == gpu_check.CASE) == pytest.approx(0.467, abs=5e-4)
    assert gpu_check.rel_gap([5.0, 4.0], [5.0, 4.04]) == pytest.approx(0.04 / 4.04)
    assert gpu_check.rel_gap([5.0], [5.0, 4.0]) == float("inf")  # a run cut short never passes


@pytest.mark.parametrize(
    "rss_gib, logged, ok",
    [(2.5, "1,024.0", True), (0.5, "1,024.0", False), (7.5, "1,024.0", False), (2.5, None, False)],
    ids=["within", "below-the-staged-copy", "over-the-margin", "no-line"],
)
def test_the_async_save_check_compares_host_rss_with_the_staged_bytes_the_run_logged(
    tmp_path, monkeypatch, capsys, rss_gib, logged, ok
):
    """The largest worker's peak RSS holds the copy the run said it stages (1 GiB here), and at most 6 GiB more."""
    for run, steps in (("saved", 6), ("resumed", 3)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps({"loss": 4.0}) + "\n" for _ in range(steps)))
    said = f"torchacco: an asynchronous save holds about {logged} MiB of host memory per rank, ...\n" if logged else ""
    procs = {"saved": subprocess.CompletedProcess([], 0, "[rank0]: " + said, "")}
    usage = Namespace(ru_maxrss=int(rss_gib * 2**20))  # KiB
    monkeypatch.setattr(gpu_check.resource, "getrusage", lambda who: usage)
    problems = []
    gpu_check.resume_checks(Namespace(work=tmp_path), problems, [], procs)
    parts = [json.loads(line[5:]) for line in capsys.readouterr().out.splitlines() if line.startswith("PART ")]
    assert [p["check"] for p in parts] == ["exact resume", "host RSS"] and parts[0]["ok"]
    assert parts[1]["ok"] == ok and (parts[1]["staged_gib"] == 1.0) == bool(logged), parts
    assert len(problems) == (0 if ok else 1), problems
