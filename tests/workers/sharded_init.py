"""Each layout's shards of a model built on meta hold the values of the model initialised (or
loaded) whole.

    torchrun --nproc_per_node 2 tests/workers/sharded_init.py FOLDER

For Llama 3 debug under tp 2, pp 2 and FSDP over 2 ranks: seeded initialisation, then [model]
init_from a Hugging Face folder (FOLDER, written here from a whole model of another seed). Prints
"SAME <layout> <init|load>" for each check that holds on each rank (all printed by rank 0), and the first
differing tensor otherwise.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchacco import hf_io, trainer
from torchacco.build import build_model, build_on_meta
from torchacco.config import load_config
from torchacco.device import select_device
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import UpdatePlan
from torchacco.spec import get_model_spec

LAYOUTS = {
    "tp2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel", "zero1"],
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel", "zero1"],
    "fsdp": ["--parallelism.data_parallel", "fsdp"],
}
folder = Path(sys.argv[1])
dist.init_process_group("gloo")
dev = select_device("cpu", 0)
spec = get_model_spec("llama3")
plan = UpdatePlan(1, TokenSchedule(1e-3, 0, 1e6, "constant", 0.1), 1.0, torch.float32)


def config(layout: str, *extra: str):
    return load_config(["--model.name", "llama3", "--model.flavor", "debug", "--training.seed", "3", *LAYOUTS[layout],
                        *extra])  # fmt: skip


whole = build_model(spec, config("tp2").model, 0, 3, dev).state_dict()
loaded = build_model(spec, config("tp2").model, 0, 4, dev)
if dist.get_rank() == 0:
    hf_io.save_hf(folder, "llama3", loaded.args, loaded.state_dict())
dist.barrier()
loaded = loaded.state_dict()

dims, results = None, []
for layout in LAYOUTS:
    for what, reference, extra in (("init", whole, ()), ("load", loaded, ("--model.init_from", str(folder)))):
        cfg = config(layout, *extra)
        p = cfg.parallelism
        if dims is None or (dims.tp_size, dims.pp_size) != (p.tensor_parallel_degree, p.pipeline_parallel_degree):
            dims = init_distributed(dev, 120, p.tensor_parallel_degree, p.pipeline_parallel_degree)
        model, init = build_on_meta(spec, cfg.model, 0, 3, dev)
        strategy, _ = trainer.parallelize(cfg, spec, dims, dev, model, TokenLoss(), plan, init)
        differs = [
            name
            for name, t in model.state_dict().items()
            if not torch.equal(t.full_tensor() if isinstance(t, DTensor) else t, reference[name])
        ]
        results.append(f"SAME {layout} {what}" if not differs else f"DIFFERS {layout} {what} {differs[0]}")
        strategy.close()
gathered = [None] * dist.get_world_size()
dist.all_gather_object(gathered, results)
if dist.get_rank() == 0:  # one writer: two ranks' lines would interleave
    print("\n".join(line for lines in gathered for line in lines), flush=True)
dist.destroy_process_group()
