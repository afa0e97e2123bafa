"""Virtual compute (torchacco/emulation.py): waits of the calibrated lengths that hold no CPU, gradients on every
parameter through the strategies' hooks, no losses reported, and one-line refusals."""

import json
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, read_metrics, run_train, tiny_args

from torchacco import emulation
from torchacco.config import Emulation, load_config
from torchacco.errors import UserError
from torchacco.models.gpt_neo import GPTNeo, ModelArgs
from torchacco.optim import ShardedAdamW, SlowMomentumAdamW
from torchacco.validate import validate

VIRTUAL = ["--emulation.virtual_compute", "true", "--emulation.forward_s", "0.01", "--emulation.backward_s", "0.02",
           "--emulation.optimizer_s_per_param", "1e-9", "--eval.every", "0"]  # fmt: skip


def _tiny_model() -> GPTNeo:
    torch.manual_seed(0)
    return GPTNeo(ModelArgs(vocab_size=64, max_seq_len=16, dim=16, n_layers=3, n_heads=2, window_size=8))


def test_a_wait_lasts_its_calibrated_time_and_holds_no_cpu():
    model = _tiny_model()
    settings = Emulation(virtual_compute=True, forward_s=0.3, backward_s=0.6, block_share=0.5)
    emulation.virtualize(model, settings, rank=0)
    ids = torch.randint(0, 64, (2, 16))
    wall, cpu = time.perf_counter(), time.process_time()
    out = model(ids)
    forward_wall, forward_cpu = time.perf_counter() - wall, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    out.sum().backward()
    backward_wall, backward_cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.3 <= forward_wall < 0.3 + 0.25 and 0.6 <= backward_wall < 0.6 + 0.25, (forward_wall, backward_wall)
    assert forward_cpu < 0.05 and backward_cpu < 0.05, (forward_cpu, backward_cpu)  # sleeps, not spins
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # every hook fires


def test_a_slow_rank_waits_slow_factor_times_as_long():
    model = _tiny_model()
    settings = Emulation(virtual_compute=True, forward_s=0.1, backward_s=0.1, slow_ranks="1", slow_factor=3.0)
    emulation.virtualize(model, settings, rank=1)
    start = time.perf_counter()
    model(torch.randint(0, 64, (1, 16)))
    assert 0.3 <= time.perf_counter() - start < 0.3 + 0.2


def test_adamw_becomes_a_wait_per_element(monkeypatch):
    # restored after the test: the install patches the classes for the process (a training worker's)
    monkeypatch.setattr(ShardedAdamW, "_update", ShardedAdamW._update)
    monkeypatch.setattr(torch.optim.AdamW, "step", torch.optim.AdamW.step)
    monkeypatch.setattr(SlowMomentumAdamW, "step", SlowMomentumAdamW.step)
    waits = []  # the seconds each step asks to sleep: exact, where a wall clock on a loaded machine is not
    monkeypatch.setattr(emulation.time, "sleep", waits.append)

    def waited(step) -> float:
        waits.clear()
        step()
        return sum(waits)

    emulation.install_optimizer_waits(1e-6)  # 0.2 s for 200k elements
    sharded = ShardedAdamW(torch.zeros(200_000), [], load_config([]).optimizer)
    grad = torch.ones(200_000)
    cpu = time.process_time()
    assert waited(lambda: sharded.step(grad, lr=1.0)) == pytest.approx(0.2)
    assert time.process_time() - cpu < 0.1
    assert not sharded.state.master.any()  # waited, computed nothing
    p = torch.nn.Parameter(torch.zeros(200_000))
    assert waited(torch.optim.AdamW([p]).step) == pytest.approx(0.2)
    slow = load_config(["--optimizer.slow_beta", "0.99"]).optimizer  # the slow moment's forms wait alike
    sharded, replicated = ShardedAdamW(torch.zeros(200_000), [], slow), SlowMomentumAdamW([{"params": [p]}], slow)
    for step in (lambda: sharded.step(grad, lr=1.0), replicated.step):
        assert waited(step) == pytest.approx(0.2)
    assert not sharded.state.master.any() and not p.any()


@pytest.mark.parametrize(
    "extra, problem",
    [
        (["--eval.every", "5"], "without an evaluation ([eval] every = 0)"),
        (["--model.compile", "true"], "without compile"),
        (["--emulation.forward_s", "0"], "needs forward_s and backward_s > 0"),
        (["--emulation.slow_ranks", "one"], "must list ranks"),
    ],
)
def test_virtual_compute_mistakes_are_one_line(extra, problem):
    with pytest.raises(UserError, match=problem.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        validate(load_config([*VIRTUAL, *extra]), world_size=2, here=False)


@pytest.mark.integration
@pytest.mark.parametrize(
    "kind", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow), "acco"]
)
def test_strategies_train_on_virtual_compute_and_report_no_loss(tiny_corpus, cache_dir, tmp_path, kind):
    """Real collectives over waits: FSDP's and DDP's hooks see every gradient, the job runs beside the waits,
    and no record carries a loss."""
    out = tmp_path / kind
    extra = ("--parallelism.data_parallel", kind, *VIRTUAL, "--training.global_batch_size", "16")
    proc = run_train(tiny_args(tiny_corpus, cache_dir, out, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_metrics(out)
    assert len(records) == 6 and all(r["loss"] is None and r["tokens_per_s"] > 0 for r in records)
    assert "losses are not computed" in proc.stdout + proc.stderr


def test_calibration_measures_the_configs_micro_batch():
    args = ["--model.flavor", "debug", "--tokenizer.vocab_size", "400", "--training.seq_len", "32",
            "--training.local_batch_size", "2"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "torchacco", "calibrate", "--config", "train_configs/default.toml",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["forward_s"] > 0 and found["backward_s"] > 0 and found["optimizer_s_per_param"] > 0
    assert 0 < found["block_share"] < 1
    assert emulation.overrides(found)[:2] == ["--emulation.virtual_compute", "true"]


def test_calibration_refuses_no_threads_in_one_line():
    argv = [sys.executable, "-m", "torchacco", "calibrate", "--threads", "0", "--config", "train_configs/default.toml"]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1].endswith("--threads must be at least 1, got 0")
