"""The most host memory a rank allocates during its updates, measured, for the dry run's peak to be checked against.

    cc -shared -fPIC -O2 -o /tmp/malloc_peak.so tests/workers/malloc_peak.c
    LD_PRELOAD=/tmp/malloc_peak.so torchrun --nproc_per_node 2 tests/workers/peak_memory.py STRATEGY [...] -- [--k V]

malloc_peak.c counts the bytes torch's CPU allocator holds, on every thread (ACCO's job, gloo's: the profiler's memory
events miss the frees made on threads it does not follow), and not what oneDNN, gloo or Python allocate for
themselves. For each strategy in turn, builds the `memcheck` Llama 3 (strategy_memory.py's) and the strategy as the
trainer does, trains three updates on random tokens, and prints from rank 0 one JSON line: the most bytes allocated at
once from the build on, less those allocated before it, and the most in each part of an update (forward, backward,
step) with what the part starts on ("... from"), to say where the peak is.
"""

import contextlib
import ctypes
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from strategy_memory import MEMCHECK

from torchacco.build import build_model, build_strategy
from torchacco.config import load_config
from torchacco.device import compute_dtype, select_device
from torchacco.loss import TokenLoss
from torchacco.lr import TokenSchedule
from torchacco.parallel.collectives import CHECK_THREADS
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.strategy import Counts, UpdatePlan
from torchacco.spec import get_model_spec

LIB = ctypes.CDLL(None)  # malloc_peak.so, preloaded
for fn in ("malloc_peak_live", "malloc_peak_reset", "malloc_peak_most"):
    getattr(LIB, fn).restype = ctypes.c_long


def count_torchs_allocator() -> None:
    """Count the blocks that libc10's code (the CPU allocator's alloc_cpu and free_cpu) allocates and frees."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, mode, *_, path = line.split()
        if path.endswith("/libc10.so") and "x" in mode:
            LIB.malloc_peak_count_from(*(ctypes.c_size_t(int(x, 16)) for x in span.split("-")))
            return
    raise RuntimeError("libc10.so is not mapped")


def train(name: str, cfg, spec, dims, dev, parts: dict, updates: int = 3) -> None:
    cfg.parallelism.data_parallel = name
    t = cfg.training
    dtype = compute_dtype(t.mixed_precision, dev)
    micro = t.global_batch_size // (t.local_batch_size * dims.dp_size)
    plan = UpdatePlan(micro, TokenSchedule(1e-3, 0, 1e9, "constant", 0.1), 1.0, dtype)
    model = build_model(spec, cfg.model, 0, t.seed, dev)
    strategy = build_strategy(model, cfg, dims, plan, dev)

    @contextlib.contextmanager
    def part(label):  # the most allocated inside it (the running peak carries on across parts)
        before, start = LIB.malloc_peak_most(), LIB.malloc_peak_reset()
        yield
        most = LIB.malloc_peak_most()
        parts[label] = max(parts.get(label, 0), most)
        parts[label + " from"] = max(parts.get(label + " from", 0), start)  # what it starts on
        parts["all"] = max(parts.get("all", 0), before, most)
        LIB.malloc_peak_reset()

    loss_fn, generator = TokenLoss(), torch.Generator().manual_seed(dims.rank)
    done = 0
    while done < updates:
        tokens, loss_sum, n = 0, 0.0, 0
        for micro_batch in strategy.micro_batches():
            ids = torch.randint(0, MEMCHECK.vocab_size, (t.local_batch_size, t.seq_len + 1), generator=generator)
            with micro_batch:
                with part("forward"):
                    loss, count = loss_fn.of_batch(strategy.model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
                with part("backward"):
                    loss.backward()
            loss_sum, tokens, n = loss_sum + loss.item(), tokens + int(count), n + 1
        with part("step"):
            result = strategy.step(Counts(tokens, loss_sum, n, float(tokens)))
        done += result is not None and result.committed
    strategy.close()


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
    count_torchs_allocator()
    for name in names:
        gc.collect()
        parts, before = {}, LIB.malloc_peak_reset()
        train(name, cfg, spec, dims, dev, parts)
        gc.collect()
        peaks = {k: v - before for k, v in parts.items()}
        if dims.rank == 0:
            print(json.dumps({"strategy": name, "peak": peaks.pop("all"), **peaks}), flush=True)
    dist.destroy_process_group()
