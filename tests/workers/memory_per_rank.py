"""Parameter and optimizer-shard elements per rank under tp/pp/dp (the README's memory table).

    torchrun --nproc_per_node 4 tests/workers/memory_per_rank.py --model.name llama3 \
        --parallelism.data_parallel acco --parallelism.tensor_parallel_degree 2 \
        --parallelism.pipeline_parallel_degree 2

Builds the configured model (vocabulary 366, the tests' tokenizer) and strategy on every rank
and prints, from rank 0, each rank's stored parameter elements and optimizer shard.
"""

import sys

import torch
import torch.distributed as dist

from torchacco.build import build_model, build_strategy
from torchacco.config import load_config
from torchacco.device import select_device
from torchacco.lr import TokenSchedule
from torchacco.parallel.model_parallel import apply_model_parallel, local_numel
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import UpdatePlan
from torchacco.spec import get_model_spec

dist.init_process_group("gloo")  # init_distributed then reuses it
cfg = load_config(sys.argv[1:])
dev = select_device("cpu", 0)
dims = init_distributed(dev, 60, cfg.parallelism.tensor_parallel_degree, cfg.parallelism.pipeline_parallel_degree)
spec = get_model_spec(cfg.model.name)
model = build_model(spec, cfg.model, 366, cfg.training.seed, dev)
full = sum(p.numel() for p in model.parameters())
model, pipe = apply_model_parallel(model, spec, cfg.parallelism, cfg.model, cfg.training, dims, dev)
plan = UpdatePlan(2, TokenSchedule(1e-3, 0, 1e6, "constant", 0.1), cfg.training.max_norm, torch.float32)
dp = build_strategy(model, cfg, dims, plan, dev)
mine = [dims.rank, local_numel(model), dp.sharded.flat.shard_numel if hasattr(dp, "sharded") else 0]
out = [None] * dims.world_size
dist.all_gather_object(out, mine)
if dims.rank == 0:
    print("CONFIG", " ".join(sys.argv[1:]), "full", full)
    for r, p, s in out:
        print(f"rank {r}: params {p} ({p / full:.3f} of full), optimizer shard {s} ({s / full:.3f})")
dp.close()
dist.destroy_process_group()
