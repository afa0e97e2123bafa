"""The dry run (`./run_train.sh --config FILE --dry-run 4x8`) and `predict --config`: a config checked and its
memory counted for the cluster it is written for, without a GPU or data."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torchacco.config import load_config
from torchacco.errors import UserError
from torchacco.planning import cost_model as cm
from torchacco.planning import dry_run, predict
from torchacco.spec import get_model_spec

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "train_configs").glob("*.toml"))


def dry(capsys, *argv: str) -> str:
    assert dry_run.main(list(argv)) == 0
    return capsys.readouterr().out


def peak_gib(out: str) -> tuple[str, float]:
    m = re.search(
        r"^fits in 80 GiB: (yes|tight|no) \(peak ([0-9.]+) GiB on rank \d+; [0-9.]+ GiB, \d+%, with", out, re.M
    )
    assert m, out
    return m.group(1), float(m.group(2))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_recipe_dry_runs_at_the_cluster_it_declares(config, capsys):
    assert re.fullmatch(r"\d+x\d+", load_config(["--config", str(config)]).job.cluster), "[job] cluster"
    out = dry(capsys, "--config", str(config), "--dry-run", "--dry-run-report-only")
    verdict, peak = peak_gib(out)
    assert peak > 0
    # within 90% of the GPU with the reserve; a recipe that does not fit says so in its header (the dry run's exit 1
    # then tells a job script): 8B DDP's replicated state is the example of a layout that cannot fit
    does_not_fit = "does not fit" in config.read_text(encoding="utf-8")
    assert verdict == ("no" if does_not_fit else "yes"), out
    assert re.search(r"^time per update: [0-9.e+]+ s", out, re.M), out


def test_the_flagship_layouts_are_counted_per_rank_of_the_sharded_model(capsys):
    out = dry(capsys, "--config", "train_configs/llama3_8b_acco.toml", "--dry-run", "4x8")
    assert "layout: dp 4 × tp 8 × pp 1 × replicas 1; acco;" in out
    assert "| every rank (rank 0, 32 ranks) | 1.00B |" in out  # 8.03B / tp 8, embeddings and head included
    assert peak_gib(out)[0] == "yes"
    for name in ("llama3_70b_acco", "llama3_70b_fsdp"):
        assert peak_gib(dry(capsys, "--config", f"train_configs/{name}.toml", "--dry-run"))[0] == "yes", name
    out = dry(capsys, "--config", "train_configs/llama3_70b_acco.toml", "--dry-run", "16x8")
    stages = [float(m) for m in re.findall(r"^\| pp stage \d .*? \| ([0-9.]+)B \|", out, re.M)]
    assert len(stages) == 4 and stages[0] > stages[1] and stages[3] > stages[2], out  # embeddings, head
    # replicated fp32 weights and AdamW state: 16 bytes per parameter do not fit: one line and exit 1
    ddp = ["--config", "train_configs/llama3_8b_ddp.toml", "--dry-run", "4x8"]
    with pytest.raises(
        UserError,
        match=r"^does not fit: peak [0-9.]+ GiB on rank 0, [0-9.]+ GiB with the reserve > --dry-run-gpu-gib 80; shard",
    ):
        dry_run.main(ddp)
    assert peak_gib(capsys.readouterr().out)[0] == "no"  # the report comes first
    assert peak_gib(dry(capsys, *ddp, "--dry-run-report-only"))[0] == "no"
    out = dry(capsys, "--config", "train_configs/llama3_8b_ddp.toml", "--dry-run", "4x8", "--dry-run-gpu-gib", "240")
    assert "fits in 240 GiB: yes" in out
    # FSDP shards its fp32 state over all 32 ranks, HSDP over a node's 8: 16 bytes × 8.03B / 8 = 14.9 GiB
    for name, state in (("fsdp", 3.7), ("hsdp", 14.9)):
        argv = ["--config", "train_configs/llama3_8b_fsdp.toml", "--dry-run", "4x8", "--parallelism.data_parallel"]
        row = next(line for line in dry(capsys, *argv, name).splitlines() if line.startswith("| every rank"))
        cells = [float(x) for x in row.split("|")[3:8]]
        assert sum(cells) == pytest.approx(state, abs=0.3), (name, row)


def test_the_verdict_keeps_a_reserve_and_calls_the_last_tenth_tight():
    gpu = 80 * dry_run.GIB
    assert [dry_run.fits(x * gpu, gpu) for x in (0.5, 0.9, 0.95, 1.0, 1.01)] == ["yes", "yes", "tight", "tight", "no"]
    kind = dry_run.RankMemory("every rank", 0, 1, 0, dry_run.MemoryParts(weights=60 * dry_run.GIB), 0.0, 0.0)
    assert kind.needed / dry_run.GIB == pytest.approx(60 * 1.05 + 4)  # the CUDA context, NCCL, fragmentation


def test_torchs_fake_store_is_where_the_dry_run_takes_it_from():
    """The dry run's one private torch API (torch.testing._internal's FakeStore): this fails when torch moves it."""
    import torch.distributed as dist

    assert isinstance(dry_run.fake_store(), dist.Store)


def test_the_dry_run_sets_a_launched_ranks_environment_and_restores_the_callers():
    before = os.environ.get("LOCAL_WORLD_SIZE")
    with dry_run.launched_environment(8):
        assert os.environ["LOCAL_WORLD_SIZE"] == "8"
    assert os.environ.get("LOCAL_WORLD_SIZE") == before


def test_tensor_parallel_ranks_keep_the_row_wise_outputs_over_the_whole_sequence():
    """8B at tp 8 with selective checkpointing: wo's and w2's outputs, partial sums before their reduce-scatter,
    are 4 of the 22 bytes per token and dimension a block keeps, undivided by tp (6.25 GiB, not 2.75)."""
    cfg = load_config(["--config", "train_configs/llama3_8b_acco.toml"])
    args = get_model_spec("llama3").args("8B")
    blocks = cm.block_activation_bytes(args, 8192, "selective", tp=8)
    assert blocks == pytest.approx((18 / 8 + 4) * 8192 * 4096 * 32)
    assert cm.block_activation_bytes(args, 8192, "selective") == 22 * 8192 * 4096 * 32
    assert cm.block_activation_bytes(args, 8192, "full", tp=8) == 2 / 8 * 8192 * 4096 * 32  # the split input only
    assert dry_run.activations(cfg, args, 0) / dry_run.GIB == pytest.approx(6.25 + 0.12, abs=0.01)  # + the logits


def test_the_dry_run_counts_fsdps_unsharded_accumulation_when_chosen(capsys):
    """8B FSDP at 4x8, 8 micro-batches: reduce-scattered every micro-batch, a rank holds its 1/32 of the fp32
    gradient; with accumulate_unsharded, all of it (29.9 GiB) until the last micro-batch."""
    argv = ["--config", "train_configs/llama3_8b_fsdp.toml", "--dry-run", "4x8"]
    for extra, gradients in (([], 8.03e9 * 4 / 32), (["--parallelism.accumulate_unsharded", "true"], 8.03e9 * 4)):
        row = next(line for line in dry(capsys, *argv, *extra).splitlines() if line.startswith("| every rank"))
        assert float(row.split("|")[4]) == pytest.approx(gradients / dry_run.GIB, abs=0.1), row


def test_a_cluster_that_the_config_cannot_run_on_is_the_launchers_one_line():
    with pytest.raises(UserError, match=r"global_batch_size = 256 is not divisible by .* 1 × 3 = 3"):
        dry_run.plan(load_config(["--config", "train_configs/llama3_8b_acco.toml"]), dry_run.Cluster(3, 8))
    with pytest.raises(UserError, match=r"--dry-run '4by8' is not NODESxGPUS; .* e\.g\. 4x8"):
        dry_run.main(["--config", "train_configs/llama3_8b_acco.toml", "--dry-run", "4by8"])


@pytest.mark.integration
def test_run_train_sh_dry_run_starts_no_worker_and_exits_1_on_a_mistake():
    env = {**os.environ, "PYTHON": sys.executable}
    ok = subprocess.run(
        ["./run_train.sh", "--config", "train_configs/llama3_8b_acco.toml", "--dry-run", "4x8"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert ok.returncode == 0 and "fits in 80 GiB: yes" in ok.stdout, ok.stderr
    bad = subprocess.run(
        ["./run_train.sh", "--config", "train_configs/llama3_8b_acco.toml", "--dry-run=3x8"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("torchacco: error: [training] global_batch_size") and bad.stderr.count("\n") == 1
    too_big = subprocess.run(
        ["./run_train.sh", "--config", "train_configs/llama3_8b_ddp.toml", "--dry-run", "4x8"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert too_big.returncode == 1 and "fits in 80 GiB: no" in too_big.stdout
    assert too_big.stderr.startswith("torchacco: error: does not fit") and too_big.stderr.count("\n") == 1


def test_predict_evaluates_the_configs_own_layout_beside_the_alternatives(capsys):
    assert predict.main(["--config", "train_configs/llama3_8b_acco.toml", "--nodes", "4", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    own = next(line for line in out.splitlines() if line.startswith("| acco, tp 8 (the config's) |"))
    plain = next(line for line in out.splitlines() if line.startswith("| acco |"))
    assert "does not fit" not in own and "does not fit" in plain
    rows = predict.evaluate(predict.build_parser().parse_args(["--config", "train_configs/llama3_8b_acco.toml"]))[0]
    own = rows["acco, tp 8 (the config's)"].pred["tokens_per_update"]
    assert own == rows["acco"].pred["tokens_per_update"] == 256 * 8192  # the same global batch


def test_predict_times_the_configs_row_as_the_dry_run_does(capsys):
    """Both read the wire's bytes from the config's dtypes (bf16 gathers, fp32 reductions: 3 bytes per element)."""
    config = "train_configs/llama3_8b_zero1.toml"
    assert predict.main(["--config", config, "--nodes", "4", "--gpus-per-node", "8"]) == 0
    own = next(line for line in capsys.readouterr().out.splitlines() if "(the config's)" in line)
    out = dry(capsys, "--config", config, "--dry-run", "4x8")
    dry_s = float(re.search(r"time per update: ([\d.]+) s", out).group(1))
    assert float(own.split("|")[2]) == pytest.approx(dry_s, rel=0.01)


def test_tensor_parallelism_across_a_node_moves_the_same_bytes_over_its_link():
    """tp = G: each of a node's G rings carries 1/G of the model, and the G rings share the node's link."""
    work = cm.Workload(params=8e9, flops_per_token=5e10, tokens_per_micro_batch=8192, micro_batches=8)
    hw = cm.Hardware(nodes=4, ranks_per_node=8, flops=4e14, bandwidth_bps=1e11)
    local, ring = cm.model_parallel_layout(work, hw, tp=8, pp=1, local_params=1e9)
    assert (ring.nodes, ring.ranks_per_node, ring.world) == (4, 1, 4)
    per_node = dataclasses.replace(hw, ranks_per_node=1)
    assert cm.collective_s(local.params * 2, ring) == pytest.approx(cm.collective_s(work.params * 2, per_node))
    assert ring.compute_s == pytest.approx(5e10 * 8192 / 4e14 / 8)


MEMCHECK = [
    "--model.name",
    "llama3",
    "--model.flavor",
    "memcheck",
    "--model.vocab_size",
    "4096",
    "--training.mixed_precision",
    "bf16",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "16",
    "--hsdp.shard_degree",
    "1",
]  # fmt: skip  (4 micro-batches on 2 ranks)


def register_memcheck(monkeypatch) -> None:
    from torchacco.models.llama3 import ModelArgs

    flavor = ModelArgs(vocab_size=4096, max_seq_len=64, dim=256, n_layers=4, n_heads=4, n_kv_heads=4)
    monkeypatch.setitem(get_model_spec("llama3").flavors, "memcheck", flavor)  # the workers register the same


def measure_strategies(monkeypatch, strategies: list[str], *extra: str, nproc: int = 2, **env) -> dict[str, dict]:
    """tests/workers/strategy_memory.py on `nproc` gloo ranks: each strategy's bytes once its gradients are complete,
    and its gradients' most between micro-batches."""
    register_memcheck(monkeypatch)
    worker = ROOT / "tests" / "workers" / "strategy_memory.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), str(worker),
         *strategies, "--", *MEMCHECK, *extra],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )  # fmt: skip
    # every rank's error lines first: a crash on one rank ends the others' tracebacks in the tail
    errors = "\n".join(line for line in proc.stderr.splitlines() if "Error" in line)
    assert proc.returncode == 0, errors[-3000:] + "\n" + proc.stderr[-3000:]
    return {r["strategy"]: r for r in (json.loads(x) for x in proc.stdout.splitlines() if x[:1] == "{")}


def estimate(strategy: str, *extra: str) -> dry_run.RankMemory:
    cfg = load_config([*MEMCHECK, "--parallelism.data_parallel", strategy, *extra])
    run = dry_run.plan(cfg, dry_run.Cluster(1, 2))
    assert run.micro_batches == 4
    return run.kinds[0]


@pytest.mark.integration
@pytest.mark.slow  # every strategy built
def test_the_memory_estimate_is_what_the_strategies_allocate(monkeypatch):
    """Within 10% of the tensor bytes a 2-rank run keeps once its gradients are complete, at 4 micro-batches (bf16
    compute: ACCO's fp32 job buffer, 4 of its 16 bytes per parameter, counts); and FSDP's and HSDP's gradients
    between micro-batches: sharded (HSDP's shard group is one rank here, its all-reduce across replicas once per
    update)."""
    strategies = ["ddp", "zero1", "fsdp", "hsdp", "acco"]
    measured = measure_strategies(monkeypatch, strategies)
    for name in strategies:
        memory = estimate(name).memory
        # the estimate's gradients are their most between micro-batches: DDP's first update holds its own beside the
        # buckets, which it then makes them views of
        kept = memory.total - (memory.gradients / 2 if name == "ddp" else 0)
        assert measured[name]["bytes"] == pytest.approx(kept, rel=0.10), (name, measured[name], memory)
    for name in ("fsdp", "hsdp"):
        gradients = estimate(name).memory.gradients
        assert measured[name]["gradients"] == pytest.approx(gradients, rel=0.10), (name, measured[name], gradients)
    assert estimate("fsdp").memory.gradients == pytest.approx(estimate("hsdp").memory.gradients / 2)


@pytest.mark.integration
@pytest.mark.slow  # 4 ranks
def test_hsdp_over_2_replicas_of_2_shards_holds_sharded_gradients_and_all_reduces_them_once_per_update(monkeypatch):
    """HSDP at shard_degree 2 on 4 ranks (2 replicas × 2 shards), 4 micro-batches: the gradients it holds between
    micro-batches are the dry run's figure within 10% (half of shard_degree 1's); in torch's flight recorder, the
    first update's micro-batches reduce-scatter within the replica and only the last one all-reduces across
    replicas, once for each reduce-scatter."""
    extra = ("--hsdp.shard_degree", "2", "--training.global_batch_size", "32")
    measured = measure_strategies(monkeypatch, ["hsdp"], *extra, nproc=4, TORCH_FR_BUFFER_SIZE="20000")["hsdp"]
    cfg = load_config([*MEMCHECK, "--parallelism.data_parallel", "hsdp", *extra])
    run = dry_run.plan(cfg, dry_run.Cluster(2, 2))
    assert run.micro_batches == 4
    gradients = run.kinds[0].memory.gradients
    assert measured["gradients"] == pytest.approx(gradients, rel=0.10), (measured, gradients)
    assert gradients == pytest.approx(estimate("hsdp").memory.gradients / 2)  # shard_degree 1's, on 2 ranks
    *micro_batches, _step = measured["collectives"]
    assert len(micro_batches) == 4, measured["collectives"]
    shard, replicas = "[0, 1]", "[0, 2]"  # rank 0's groups
    # (gloo has no reduce-scatter: FSDP2 all-reduces in the shard group instead)
    scatters = [sum(n for op, n in c.items() if op.startswith(shard) and "all_gather" not in op) for c in micro_batches]
    all_reduces = [c.get(f"{replicas} gloo:all_reduce", 0) for c in micro_batches]
    assert all(scatters) and len(set(scatters)) == 1, micro_batches
    assert all_reduces == [0, 0, 0, scatters[-1]], micro_batches


@pytest.mark.integration
@pytest.mark.slow  # every strategy built, under a malloc counter
def test_the_dry_runs_peak_is_the_most_a_rank_allocates_per_update(monkeypatch, tmp_path):
    """Within 10% of the most bytes torch's CPU allocator holds at once on a rank of a 2-rank run, over its first three
    updates at 4 micro-batches (tests/workers/peak_memory.py, every thread counted): activations, autocast's bf16
    weights and DDP's first-update gradients beside its buckets, FSDP's gathered blocks, ACCO's job beside backward."""
    if not shutil.which("cc"):
        pytest.skip("needs a C compiler for tests/workers/malloc_peak.c")
    register_memcheck(monkeypatch)
    shim = tmp_path / "malloc_peak.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", shim, ROOT / "tests/workers/malloc_peak.c"], check=True)
    for name in ["ddp", "zero1", "fsdp", "hsdp", "acco"]:  # a process each: what one leaves behind is not the next's
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(ROOT / "tests/workers/peak_memory.py"), name, "--", *MEMCHECK],
            capture_output=True, text=True, timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", "LD_PRELOAD": str(shim)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = next(json.loads(x) for x in proc.stdout.splitlines() if x[:1] == "{")
        peak = estimate(name).peak
        assert measured["peak"] == pytest.approx(peak, rel=0.10), (name, measured, peak)


@pytest.mark.integration
@pytest.mark.slow  # a second build
def test_fsdp_accumulating_unsharded_gradients_is_counted_by_the_dry_run(monkeypatch):
    """[parallelism] accumulate_unsharded: an unsharded fp32 gradient of every parameter between micro-batches, twice
    the sharded one on 2 ranks."""
    option = ("--parallelism.accumulate_unsharded", "true")
    measured = measure_strategies(monkeypatch, ["fsdp"], *option)["fsdp"]
    held = estimate("fsdp", *option)
    assert held.memory.gradients == pytest.approx(2 * estimate("fsdp").memory.gradients)
    assert measured["gradients"] == pytest.approx(held.memory.gradients, rel=0.10), (measured, held.memory)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_the_slow_moment_adds_half_of_adamws_moments_to_the_estimate(strategy):
    """`[optimizer] slow_beta` keeps a third fp32 moment beside AdamW's two, of every element the optimizer owns."""
    plain, slow = (
        dry_run.plan(load_config(["--parallelism.data_parallel", strategy, *extra]), dry_run.Cluster(1, 2))
        .kinds[0].memory for extra in ([], ["--optimizer.slow_beta", "0.99"])
    )  # fmt: skip
    assert slow.optimizer == 1.5 * plain.optimizer > 0
    assert slow.total - plain.total == plain.optimizer / 2
