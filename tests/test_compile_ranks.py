"""`[model] compile` at more than one rank, on CPU (inductor): FSDP over 2 ranks, tensor parallelism 2, pipeline
parallelism 2 and ACCO's flat parameters under tensor parallelism 2 each train to the eager run's losses.

Each pair (compiled, eager) runs from the same seed and data, in one launch of 2 gloo ranks
(tests/workers/model_parallel_worker.py). Inductor fuses and reorders fp32 sums, so the losses agree to the
tolerance the suite allows between two fp32 backends (tests/test_cuda.py: rel 1e-3), not bit for bit."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, tiny_args

LLAMA = ("--model.name", "llama3", "--model.flavor", "debug")
TP2, PP2 = ("--parallelism.tensor_parallel_degree", "2"), ("--parallelism.pipeline_parallel_degree", "2")
# name -> (strategy, extra arguments); every run on 2 ranks
CASES = {
    "fsdp-dp2": ("fsdp", ()),
    "zero1-tp2": ("zero1", TP2),
    "zero1-pp2": ("zero1", (*LLAMA, *PP2)),
    "acco-tp2": ("acco", TP2),
}
STEPS = 3


@pytest.fixture(scope="module")
def runs(tiny_corpus, cache_dir, tmp_path_factory):
    assert shutil.which(os.environ.get("CXX", "g++")), "inductor's CPU code needs a C++ compiler: apt-get install g++"
    root = tmp_path_factory.mktemp("compile_ranks")
    argvs = [
        tiny_args(tiny_corpus, cache_dir, root / f"{name}-{mode}", "--parallelism.data_parallel", kind, *extra,
                  "--training.global_batch_size", "8", "--training.seq_len", "32", "--training.steps", str(STEPS),
                  "--eval.every", "0", "--training.mixed_precision", "fp32", "--model.compile", str(mode == "compiled"))
        for name, (kind, extra) in CASES.items() for mode in ("compiled", "eager")
    ]  # fmt: skip
    (root / "runs.json").write_text(json.dumps(argvs))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(root / "ind")}
    worker = [str(ROOT / "tests" / "workers" / "model_parallel_worker.py"), str(root / "runs.json")]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           *worker], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def _frames(folder) -> int:
    return int((folder / "compiled_frames.txt").read_text())


@pytest.mark.integration
@pytest.mark.slow  # inductor compiles every block on 2 ranks: minutes on 2 cores
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_losses_equal_eager_at_two_ranks(runs, name):
    compiled, eager = (runs / f"{name}-{mode}" for mode in ("compiled", "eager"))
    logged = (compiled / "stdout.txt").read_text()
    assert "error" not in logged, logged[-2000:]
    assert _frames(compiled) > 0 and _frames(eager) == 0  # torch.compile compiled the one and not the other
    losses = [r["loss"] for r in read_metrics(compiled)]
    assert len(losses) == STEPS
    assert losses == pytest.approx([r["loss"] for r in read_metrics(eager)], rel=1e-3)
