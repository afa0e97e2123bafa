"""A model built on meta and materialised after parallelism: the same values as one initialised
whole, and no rank ever holds the whole model."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchacco.build import build_model, build_on_meta
from torchacco.config import Config
from torchacco.device import Device
from torchacco.spec import get_model_spec

ROOT = Path(__file__).resolve().parents[1]


def _built(deferred: bool, seed: int = 5):
    cfg = Config()
    cfg.model.name, cfg.model.flavor = "llama3", "debug"
    build = build_on_meta if deferred else build_model
    return build(get_model_spec("llama3"), cfg.model, 0, seed, Device("cpu"))


def test_a_deferred_model_stays_on_meta_until_materialised():
    model, init = _built(deferred=True)
    assert all(p.is_meta for p in model.parameters())
    init()
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.exact
def test_a_pruned_stage_gets_the_whole_models_values_and_the_generator_advances_as_for_it():
    whole = _built(deferred=False)
    after_whole = torch.rand(4)
    stage, init = _built(deferred=True)
    stage.tok_embeddings = None  # as a pipeline stage without the embedding, pruned before allocation
    del stage.layers[3:]
    init()
    after_stage = torch.rand(4)
    expected = whole.state_dict()
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert torch.equal(after_stage, after_whole)  # the pruned parameters were drawn and thrown away


def _peaks(*args: str) -> tuple[int, list[int]]:
    worker = ROOT / "tests" / "workers" / "build_peak.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    proc = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("WHOLE"))
    fields = line.split()
    return int(fields[1]), [int(x) for x in fields[3:]]


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_no_rank_holds_the_whole_model_while_building_it_sharded():
    tp = ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel", "zero1")
    whole, eager = _peaks("--eager", *tp)
    assert min(eager) > 0.95 * whole, (whole, eager)  # the measurement sees a whole model when there is one
    for layout in (tp, ("--parallelism.data_parallel", "fsdp")):
        whole, peaks = _peaks(*layout)
        # half the model each, plus the largest parameter drawn whole (7%) and the allocator's slack
        assert max(peaks) < 0.8 * whole, (layout, whole, peaks)


@pytest.mark.integration
@pytest.mark.exact
def test_every_layouts_shards_hold_the_whole_models_initial_and_loaded_values(tmp_path):
    worker = ROOT / "tests" / "workers" / "sharded_init.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker)]
    proc = subprocess.run([*argv, str(tmp_path / "hf")], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = [line for line in proc.stdout.splitlines() if line.startswith(("SAME", "DIFFERS"))]
    expected = {f"SAME {layout} {what}" for layout in ("tp2", "pp2", "fsdp") for what in ("init", "load")}
    assert sorted(checks) == sorted([*expected, *expected]), checks  # both ranks, every check
