"""The bytes of the tensors a strategy keeps, measured, for the dry run's estimate to be checked against.

    torchrun --nproc_per_node 2 tests/workers/strategy_memory.py STRATEGY [STRATEGY ...] -- [--section.key VALUE ...]

For each strategy in turn, builds the configured model (a `memcheck` flavor of Llama 3, registered here as in the
test) and the strategy as the trainer does, trains three updates on random tokens, and prints from rank 0 one JSON
line: the bytes of every tensor storage alive when the gradients are complete (FSDP: as its optimizer steps; the
sharded strategies: after their update, whose flat gradient buffer stays), less those alive before the build; and
the gradient bytes, the most alive after a micro-batch of the first update less those alive after the build.
Storages are found from the garbage collector's objects and the parameters' gradients, each counted once.
With TORCH_FR_BUFFER_SIZE set, the line also holds "collectives": for each micro-batch of the first update, then its
step, the collectives torch's flight recorder saw issued meanwhile, as counts of "RANKS OP" (the group's global ranks).
"""

import gc
import json
import os
import pickle
import sys
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
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


class Recorded:
    """The collectives the flight recorder saw since the last call, as counts of "RANKS OP"."""

    def __init__(self):
        self.on, self.seen = bool(os.environ.get("TORCH_FR_BUFFER_SIZE")), -1
        self.since()

    def since(self) -> dict[str, int]:
        if not self.on:
            return {}
        entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(True, True, False))["entries"]
        new = [e for e in entries if e["record_id"] > self.seen]
        self.seen = max([self.seen, *(e["record_id"] for e in new)])
        ranks = {name: dist.get_process_group_ranks(_resolve_process_group(name))
                 for name in {e["process_group"][0] for e in new}}  # fmt: skip
        return dict(Counter(f"{ranks[e['process_group'][0]]} {e['profiling_name']}" for e in new))


def measure(name: str, cfg, spec, dims, dev) -> tuple[int, int, list]:
    cfg.parallelism.data_parallel = name
    t = cfg.training
    dtype = compute_dtype(t.mixed_precision, dev)
    micro = t.global_batch_size // (t.local_batch_size * dims.dp_size)
    plan = UpdatePlan(micro, TokenSchedule(1e-3, 0, 1e9, "constant", 0.1), 1.0, dtype)
    before = live_bytes(None)
    model = build_model(spec, cfg.model, 0, t.seed, dev)
    strategy = build_strategy(model, cfg, dims, plan, dev)
    built, gradients = live_bytes(model), []
    recorded, collectives = Recorded(), []
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
                collectives.append(recorded.since())
        result = strategy.step(Counts(tokens, loss_sum, n, float(tokens)))
        if updates == 0:
            collectives.append(recorded.since())
        if result is not None and result.committed:
            updates += 1
            if optimizer is None or not isinstance(optimizer, torch.optim.Optimizer):
                measured.append(live_bytes(model))
    strategy.close()
    return max(measured) - before, max(gradients), collectives


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
        measured, gradients, collectives = measure(name, cfg, spec, dims, dev)
        if dims.rank == 0:
            record = {"strategy": name, "bytes": measured, "gradients": gradients, "collectives": collectives}
            print(json.dumps(record), flush=True)
        gc.collect()
    dist.destroy_process_group()
