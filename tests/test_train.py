"""The training loop end to end: strategies agree, the loss falls, the outputs keep their contract."""

import json
import math
import sys

import pytest
import torch
from conftest import FSDP_ASYNC, read_metrics, run_train, tiny_args
from torch.utils.data import IterableDataset

from torchacco.config import Config
from torchacco.trainer import train


@pytest.fixture(scope="module")
def strategy_runs(six_step_run):
    """Each strategy on 2 gloo ranks, 2 micro-batches per update, same data and seed (the runs
    the resume tests start from)."""
    return {
        dp: read_metrics(six_step_run(dp, *(FSDP_ASYNC if dp == "fsdp" else ()))) for dp in ("ddp", "zero1", "fsdp")
    }


@pytest.mark.integration
@pytest.mark.exact
def test_ddp_zero1_fsdp_give_the_same_losses(strategy_runs):
    ddp = [r["loss"] for r in strategy_runs["ddp"]]
    assert len(ddp) == 6
    for dp in ("zero1", "fsdp"):
        other = [r["loss"] for r in strategy_runs[dp]]
        assert other == pytest.approx(ddp, rel=1e-4), dp
        assert strategy_runs[dp][-1]["val_loss"] == pytest.approx(strategy_runs["ddp"][-1]["val_loss"], rel=1e-4)


@pytest.mark.integration
def test_loss_falls_and_metrics_keep_their_contract(strategy_runs):
    records = strategy_runs["zero1"]
    for r in records:
        for key in ("step", "tokens", "loss", "lr", "tokens_per_s", "grad_norm", "memory_gib"):
            assert key in r, key
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["tokens"] == 6 * 16 * 64  # global batch × seq_len per step, all ranks
    assert records[0]["loss"] == pytest.approx(math.log(400), rel=0.1)
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    assert "val_loss" in records[2] and "val_loss" in records[5]


def _trace_names(folder, rank: int) -> set[str]:
    traces = sorted((folder / "profile" / f"rank{rank}").glob("trace_step*.json"))
    assert [t.name for t in traces] == ["trace_step3.json"], traces
    return {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["zero1", "acco"])
def test_profiling_writes_a_trace_per_rank_with_the_loop_and_job_phases(six_step_run, kind):
    """Update 3 is traced on each rank; ACCO's job runs on its own thread and is in the trace too."""
    folder = six_step_run(kind)
    for rank in (0, 1):
        names = _trace_names(folder, rank)
        phases = ["forward_backward", "evaluation", "checkpoint_save", "job/reduce_scatter", "job/all_gather"]
        phases += ["job:commit", "job/optimizer_commit"]
        if kind == "acco":  # update 3's estimate round and the wait for it
            phases += ["job:estimate", "job/optimizer_estimate", "wait_for_job"]
        for phase in phases:
            assert f"torchacco/{phase}" in names, (rank, phase)


@pytest.mark.integration
@pytest.mark.slow
def test_bf16_strategies_agree_within_bf16_tolerance(tiny_corpus, cache_dir, tmp_path):
    losses = {}
    for dp in ("ddp", "zero1", "fsdp"):
        out = tmp_path / dp
        proc = run_train(
            tiny_args(
                tiny_corpus,
                cache_dir,
                out,
                "--parallelism.data_parallel",
                dp,
                "--training.mixed_precision",
                "bf16",
                "--training.steps",
                "3",
                "--eval.every",
                "0",
            )
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[dp] = [r["loss"] for r in read_metrics(out)]
    assert losses["zero1"] == pytest.approx(losses["ddp"], rel=2e-2)
    assert losses["fsdp"] == pytest.approx(losses["ddp"], rel=2e-2)


class Counting(IterableDataset):
    """Sequences counting up modulo 50: trivially learnable, so the loss must drop fast."""

    def __iter__(self):
        start = 0
        while True:
            seq = (torch.arange(33) + start) % 50
            yield {"input_ids": seq[:-1], "labels": seq[1:]}
            start += 7


def test_python_api_with_own_model_and_dataset(tmp_path):
    from torchacco.models.llama3 import spec

    args = spec.args("debug", vocab_size=64, n_layers=2)
    model = spec.model_cls(args)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    cfg = Config()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size = 30, 32, 8
    cfg.parallelism.data_parallel = "zero1"
    cfg.optimizer.lr = 3e-3
    cfg.eval.every = 30
    cfg.metrics.tensorboard = False
    summary = train(cfg, model=model, datasets=(Counting(), Counting()))
    assert summary["steps"] == 30
    assert summary["loss"] < 1.0 and summary["val_loss"] < 1.0
    assert (tmp_path / "config.toml").is_file() and (tmp_path / "metrics.jsonl").is_file()


def test_share_advice_names_the_estimate_share_that_fits_the_measured_times():
    from torchacco.parallel.acco import share_advice

    # Halves, a job a tenth of the compute (a fast link) or nine tenths (a slow one): 0.875 costs no time.
    for job_s in (0.1, 0.9):
        line = share_advice(0.5, compute_s=1.0, job_s=job_s, micro_batches=8)
        assert "estimate_share = 0.875 would cost no time" in line and f"{job_s:.0%}" in line and "needs" not in line
    assert "it needs a multiple of 8 micro-batches per rank (here 2)" in share_advice(0.5, 1.0, 0.1, micro_batches=2)
    assert share_advice(0.5, 1.0, 0.5, 8) is None  # halves hide half the compute; 0.875 would not
    # 0.875 with a job half the compute: min(M − C/8, 7C/8 − M) = 0.375 s exposed that halves hide.
    assert "can leave up to about 0.375 s per update exposed (38% of the compute)" in share_advice(0.875, 1.0, 0.5, 8)
    assert share_advice(0.875, 1.0, 0.05, 8) is None and share_advice(0.875, 1.0, 0.95, 8) is None
    assert share_advice(0.75, 1.0, 0.1, 8) is None and share_advice(0.5, 0.0, 0.1, 8) is None


def test_acco_logs_its_estimate_share_advice_once_from_the_times_it_measured(tmp_path, monkeypatch, capsys):
    from torchacco.parallel import acco

    calls = []

    def advice(share, compute_s, job_s, micro_batches):
        calls.append((share, compute_s, job_s, micro_batches))
        return "measured advice"

    monkeypatch.setattr(acco, "share_advice", advice)
    cfg = _python_cfg(tmp_path)
    cfg.parallelism.data_parallel = "acco"
    cfg.training.steps, cfg.training.global_batch_size = acco.ADVICE_AT_COMMIT + 2, 16  # two micro-batches of 8
    train(cfg, model=_llama(), datasets=(Counting(), Counting()))
    assert len(calls) == 1
    share, compute_s, job_s, micro_batches = calls[0]
    assert share == 0.5 and compute_s > 0 and job_s > 0 and micro_batches == 2
    assert capsys.readouterr().out.count("torchacco: measured advice") == 1


class Finite(torch.utils.data.Dataset):
    """Four windows, then nothing: a map-style dataset runs out after one epoch."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        seq = torch.arange(33) % 50
        return {"input_ids": seq[:-1], "labels": seq[1:]}


def _python_cfg(tmp_path) -> Config:
    cfg = Config()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size = 30, 32, 8
    cfg.parallelism.data_parallel = "zero1"
    cfg.eval.every = 0
    cfg.metrics.tensorboard = False
    return cfg


def _llama(vocab=64):
    from torchacco.models.llama3 import spec

    model = spec.model_cls(spec.args("debug", vocab_size=vocab, n_layers=2))
    with torch.no_grad():
        model.init_weights()
    return model


def test_a_dataset_that_runs_out_is_one_clear_error(tmp_path):
    from torchacco.errors import UserError

    with pytest.raises(UserError, match="the training dataset ran out; pass an endless one"):
        train(_python_cfg(tmp_path), model=_llama(), datasets=(Finite(), Finite()))


def test_a_model_on_another_device_is_one_clear_error(tmp_path):
    from torchacco.errors import UserError

    model = _llama().to("meta")
    with pytest.raises(UserError, match=r"the model passed to train\(\) is on meta, the run on cpu; move it there"):
        train(_python_cfg(tmp_path), model=model, datasets=(Counting(), Counting()))


@pytest.mark.integration
def test_multi_node_launch_through_c10d_rendezvous(tiny_corpus, cache_dir, tmp_path):
    """Two 'nodes' of one process each on this machine, as run_train.sh's multi-node path runs them."""
    from conftest import ROOT, two_nodes

    args = tiny_args(tiny_corpus, cache_dir, tmp_path, "--parallelism.data_parallel", "acco")
    nodes = two_nodes([ROOT, ROOT], *args, "--training.global_batch_size", "16")
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    assert "acco × 2" in nodes[0].stdout  # one data-parallel group over both nodes
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 7))


@pytest.mark.integration
def test_a_node_that_never_joins_fails_the_rendezvous_with_one_line(tiny_corpus, cache_dir, tmp_path):
    import os
    import socket
    import subprocess
    import time

    from conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "NNODES": "2",
        "NODE_RANK": "0",
        "NPROC": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RDZV_ID": f"lonely-{port}",
        "RDZV_TIMEOUT": "5",
        "PYTHON": sys.executable,
    }
    start = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "run_train.sh"), *tiny_args(tiny_corpus, cache_dir, tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and time.monotonic() - start < 60
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("torchacco: error:")]
    assert len(errors) == 1 and "did not all join the rendezvous" in errors[0] and "RDZV_TIMEOUT" in errors[0]


@pytest.mark.parametrize("argv", [[], ["--parallelism.data_parallel", "acco", "--training.global_batch_size", "16"]])
def test_the_config_of_a_run_is_read_in_at_most_15_modules(argv, tmp_path):
    """Functions take the sections they read: following `cfg` from train() through a 2-step run, the modules
    that read one of its sections are few (the config module's own methods among them)."""
    import dataclasses

    from torchacco.config import load_config
    from torchacco.models.llama3 import spec

    readers: dict[str, set[str]] = {}

    class Recording(Config):
        def __getattribute__(self, name):
            if not name.startswith("_"):
                module = sys._getframe(1).f_globals.get("__name__", "")
                readers.setdefault(module, set()).add(name)
            return super().__getattribute__(name)

    cfg = load_config(argv)
    cfg = Recording(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config)})
    cfg.job.dump_folder, cfg.eval.every, cfg.metrics.tensorboard = str(tmp_path), 0, False
    cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size = 2, 32, 8
    readers.clear()
    model = spec.model_cls(spec.args("debug", vocab_size=64, n_layers=2))
    with torch.no_grad():
        model.init_weights()
    train(cfg, model=model, datasets=(Counting(), None))
    modules = sorted(m for m in readers if m.startswith("torchacco"))
    assert {"torchacco.trainer", "torchacco.validate"} <= set(modules)  # the recording sees the reads
    assert len(modules) <= 15, modules
