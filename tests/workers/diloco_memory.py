"""The memory DiLoCo adds per rank over its inner strategy, counted over every live tensor storage.

    TORCHACCO_TEST_REPLICAS=2 TORCHACCO_TEST_DILOCO=sync_every=2 \\
        torchrun --nproc_per_node 4 tests/workers/diloco_memory.py KIND OUT

Each rank builds the inner strategy alone over its replica's ranks, then the same inside DiLoCo, each on a fresh
model, and reports the bytes each build added and the elements of θ the rank holds (its shard where the inner
strategy shards θ). Rank 0 writes every rank's report to OUT (JSON).
"""

import json
import sys

import overlap_worker as worker
import torch.distributed as dist

from torchacco.build import build_strategy
from torchacco.device import Device
from torchacco.parallel.process_groups import init_distributed
from torchacco.parallel.registry import strategy_class


def added_bytes(build) -> tuple[int, object]:
    model = worker.tiny_model()
    before = worker.live_tensor_bytes()
    strategy = build(model)
    return worker.live_tensor_bytes() - before, strategy


def main(kind: str, out: str) -> None:
    device = Device("cpu")
    dims = init_distributed(device, replicas=worker.REPLICAS)
    cfg = worker.config(kind, "deterministic")
    plan = worker.update_plan(cfg, dims, micro_batches=2)
    cls, sections = strategy_class(kind), {"parallelism": cfg.parallelism, "optimizer": cfg.optimizer}
    inner_bytes, inner = added_bytes(
        lambda m: cls.from_config(m, dims, plan, device, options=cfg.options(cls.traits.options), **sections)
    )
    inner.close()
    del inner
    diloco_bytes, diloco = added_bytes(lambda m: build_strategy(m, cfg, dims, plan, device))
    report = {
        "rank": dims.rank,
        "inner_bytes": inner_bytes,
        "diloco_bytes": diloco_bytes,
        "theta_elements": sum(p.numel() for fragment in diloco.state.by_fragment for p in fragment),
        "largest_fragment": max(b.numel() for b in diloco.state.global_params),
        "empty_fragments": sum(not fragment for fragment in diloco.state.by_fragment),  # each a 1-element placeholder
        "model_elements": sum(p.numel() for p in worker.tiny_model().parameters()),
    }
    diloco.close()
    reports = [None] * dims.world_size
    dist.all_gather_object(reports, report)
    if dims.rank == 0:
        with open(out, "w") as f:
            json.dump(reports, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    worker.exit_without_finalizing()
