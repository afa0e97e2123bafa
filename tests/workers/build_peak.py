"""The memory a rank's model takes to build, against the whole model's fp32 bytes.

    torchrun --nproc_per_node 2 tests/workers/build_peak.py [--eager] --parallelism.tensor_parallel_degree 2 ...

Builds a 118M-parameter Llama 3 (a flavor of its own, so that one rank's half and the whole model
are far apart) the way the trainer does, and prints from each rank the growth of its peak resident
memory while building (the kernel's high-water mark, reset before the build). `--eager` builds the
whole model first, as a run that shards only after allocating would.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from models.llama3 import ModelArgs
from torchacco import trainer
from torchacco.build import build_model, build_on_meta
from torchacco.config import load_config
from torchacco.device import select_device
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import UpdatePlan
from torchacco.spec import get_model_spec

STATUS = Path("/proc/self/status")


def peak_kib() -> int:
    return next(int(line.split()[1]) for line in STATUS.read_text().splitlines() if line.startswith("VmHWM:"))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS


eager = "--eager" in sys.argv
cfg = load_config([a for a in sys.argv[1:] if a != "--eager"] + ["--model.name", "llama3", "--model.flavor", "peak"])
torch.set_num_threads(1)
dist.init_process_group("gloo")  # init_distributed then reuses it
dev = select_device("cpu", 0)
p = cfg.parallelism
dims = init_distributed(dev, 120, p.tensor_parallel_degree, p.pipeline_parallel_degree)
spec = get_model_spec("llama3")
spec.flavors["peak"] = ModelArgs(vocab_size=8192, max_seq_len=256, dim=1024, n_layers=8, n_heads=8, n_kv_heads=8)
plan = UpdatePlan(1, TokenSchedule(1e-3, 0, 1e6, "constant", 0.1), 1.0, torch.float32)
dist.barrier()
reset_peak()
start = peak_kib()
model, init = (
    (build_model(spec, cfg.model, 0, cfg.training.seed, dev), None)
    if eager
    else build_on_meta(spec, cfg.model, 0, cfg.training.seed, dev)
)
whole = sum(t.numel() * 4 for t in model.parameters())
if p.data_parallel == "fsdp":
    strategy, _ = trainer.parallelize(cfg, spec, dims, dev, model, TokenLoss(), plan, init)
else:  # the model alone: a replicated-update strategy's own buffers are not the build's
    trainer.apply_model_parallel(model, spec, p, cfg.model, cfg.training, dims, dev, TokenLoss())
    if init is not None:
        init()
grown = (peak_kib() - start) * 1024
out = [None] * dims.world_size
dist.all_gather_object(out, grown)
if dims.rank == 0:
    print("WHOLE", whole, "PEAKS", *out)
dist.destroy_process_group()
