"""The bytes of the tensors a strategy keeps, measured, for the dry run's estimate to be checked against.

    torchrun --nproc_per_node 2 tests/workers/strategy_memory.py STRATEGY [STRATEGY ...] -- [--section.key VALUE ...]

For each strategy in turn, builds the configured model (a `memcheck` flavor of Llama 3, registered here as in the
test) and the strategy as the trainer does, trains three updates on random tokens, and prints from rank 0 one JSON
line: the bytes of every tensor storage alive when the gradients are complete (FSDP: as its optimizer steps; the
sharded strategies: after their update, whose flat gradient buffer stays), less those alive before the build; and
the gradient bytes, the most alive after a micro-batch of the first update less those alive after the build.
Storages are found from the garbage collector's objects and the parameters' gradients, each counted once.
"""

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchacco.build import build_model, build_strategy
from torchacco.config import load_config
from torchacco.device import compute_dtype, select_device
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.models.llama3 import ModelArgs
from torchacco.parallel.collectives import CHECK_THREADS
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import Counts, UpdatePlan
from torchacco.spec import get_model_spec

MEMCHECK = ModelArgs(vocab_size=4096, max_seq_len=64, dim=256, n_layers=4, n_heads=4, n_kv_heads=4)


def live_bytes(model) -> int:
    storages: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if isinstance(t, torch.Tensor) and not t.is_meta:
            s = t.untyped_storage()
            if s.data_ptr():
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())

    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # (isinstance would touch deprecated module attributes)
            add(obj)
    for p in model.parameters() if model is not None else ():
        add(p)
        add(p.grad)  # a gradient may live in C++ only until read
    return sum(storages.values())


def measure(name: str, cfg, spec, dims, dev) -> tuple[int, int]:
    cfg.parallelism.data_parallel = name
    t = cfg.training
    dtype = compute_dtype(t.mixed_precision, dev)
    micro = t.global_batch_size // (t.local_batch_size * dims.dp_size)
    plan = UpdatePlan(micro, TokenSchedule(1e-3, 0, 1e9, "constant", 0.1), 1.0, dtype)
    before = live_bytes(None)
    model = build_model(spec, cfg.model, 0, t.seed, dev)
    strategy = build_strategy(model, cfg, dims, plan, dev)
    built, gradients = live_bytes(model), []
    measured = []
    optimizer = getattr(strategy, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):  # torch's AdamW frees the gradients after its step
        optimizer.register_step_pre_hook(lambda *_: measured.append(live_bytes(model)))
    loss_fn, generator = TokenLoss(), torch.Generator().manual_seed(dims.rank)
    updates = 0
    while updates < 3:
        tokens, loss_sum, n = 0, 0.0, 0
        for micro_batch in strategy.micro_batches():
            ids = torch.randint(0, MEMCHECK.vocab_size, (t.local_batch_size, t.seq_len + 1), generator=generator)
            with micro_batch:
                loss, count = loss_fn.of_batch(strategy.model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
                loss.backward()
            loss_sum, tokens, n = loss_sum + loss.item(), tokens + int(count), n + 1
            if updates == 0:
                gradients.append(live_bytes(model) - built)
        result = strategy.step(Counts(tokens, loss_sum, n, float(tokens)))
        if result is not None and result.committed:
            updates += 1
            if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
                measured.append(live_bytes(model))
    strategy.close()
    return max(measured) - before, max(gradients)


if __name__ == "__main__":
    # one process trains several strategies in turn over the same groups, which one run never does: the check of one
    # issuing thread per group (tests/conftest.py) would see the last strategy's main thread and the next one's job
    os.environ.pop(CHECK_THREADS, None)
    split = sys.argv.index("--")
    names, overrides = sys.argv[1:split], sys.argv[split + 1 :]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # init_distributed then reuses it
    dev = select_device("cpu", 0)
    dims = init_distributed(dev, 120, 1, 1)
    spec = get_model_spec("llama3")
    spec.flavors["memcheck"] = MEMCHECK
    cfg = load_config(overrides)
    for name in names:
        measured, gradients = measure(name, cfg, spec, dims, dev)
        if dims.rank == 0:
            print(json.dumps({"strategy": name, "bytes": measured, "gradients": gradients}), flush=True)
        gc.collect()
    dist.destroy_process_group()
