"""BENCHMARK ONLY: time the collectives over gloo on each emulated node (under torchrun); rank 0 writes
`$TORCHACCO_NODE_REPORT_DIR/collectives.json`: the seconds of gloo's own (DDP, FSDP) and, as ring_*, torchacco's
point-to-point rings (the sharded job's: torchacco/parallel/collectives.py) on `--numel` fp32 elements.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchacco.parallel import collectives

OPS = ("reduce_scatter", "all_gather", "all_reduce", "ring_reduce_scatter", "ring_all_gather")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=5_850_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", default="", help="comma-separated names of the collectives to time; default: all")
    # a rank's collective returns once its own part is done: its sends may still be on the wire, and the next
    # collective waits for them. "all": the time until every rank is done (a barrier inside the timing)
    parser.add_argument("--until", choices=("own", "all"), default="own")
    # median: a collective's typical time; mean: what it costs a run on average, where its time is bimodal (the
    # ring's two directions take turns on one TCP connection on some calls and not on others)
    parser.add_argument("--stat", choices=("median", "mean"), default="median")
    args = parser.parse_args()
    unknown = [name for name in args.ops.split(",") if name and name not in OPS]
    if unknown:
        parser.error(f"--ops: unknown collective {unknown[0]!r}; from {', '.join(OPS)}")
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 2:  # as the trainer's data-parallel group of 2 (parallel/dims.py)
        collectives.add_return_group(dist.group.WORLD, dist.new_group(backend="gloo"))
    numel = args.numel // world * world
    full = torch.randn(numel)
    shard = torch.empty(numel // world)
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ops = {
        "reduce_scatter": lambda: rs(shard, full),
        "all_gather": lambda: ag(full, shard),
        "all_reduce": lambda: dist.all_reduce(full),
        "ring_reduce_scatter": lambda: collectives.reduce_scatter(shard, full),
        "ring_all_gather": lambda: collectives.all_gather(full, shard),
    }
    if args.ops:
        ops = {name: ops[name] for name in args.ops.split(",") if name}
    result = {"numel": numel, "bytes": numel * 4, "world": world}
    result |= {"until": args.until, "stat": args.stat, "repeats": args.repeats, "connections": 2 if world == 2 else 1}
    stat = getattr(statistics, args.stat)
    for name, op in ops.items():
        times, cpu = [], []
        for _ in range(args.repeats):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            op()
            if args.until == "all":
                dist.barrier()
            times.append(time.perf_counter() - t)
            cpu.append(time.process_time() - c)
        result[name + "_s"] = stat(times)
        result[name + "_cpu_s"] = stat(cpu)  # CPU time the process spent during it (all threads)
    if rank == 0 and os.environ.get("TORCHACCO_NODE_REPORT_DIR"):
        Path(os.environ["TORCHACCO_NODE_REPORT_DIR"], "collectives.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
