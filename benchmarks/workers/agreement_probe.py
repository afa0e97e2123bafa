"""BENCHMARK ONLY: what the per-update preemption agreement costs an update, on a link that is idle or
busy with a transfer (an outer step's all-reduce, a job) on another group.

Each of `--updates` updates sleeps `--compute-s` (the compute), then agrees as torchacco's
`Preemption.agreed()` does: `sync`, a one-number all-reduce on its own gloo group waited for at once
(the earlier way), or `async`, reading the all-reduce started at the previous boundary and starting
the next. Rank 0 writes `$TORCHACCO_NODE_REPORT_DIR/agreement.json`: the seconds each update spent
in the agreement, per (link, mode).
"""

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist


def agreement_costs(mode: str, updates: int, compute_s: float, group) -> list[float]:
    costs, pending = [], None
    for _ in range(updates):
        time.sleep(compute_s)
        start = time.perf_counter()
        flag = torch.zeros(1, dtype=torch.int32)
        if mode == "sync":
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        else:
            if pending is not None:
                pending.wait()
            pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        costs.append(time.perf_counter() - start)
    if pending is not None:
        pending.wait()
    return costs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--transfer-numel", type=int, default=4_000_000)
    parser.add_argument("--transfers", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    bulk, agree = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    result = {"updates": args.updates, "compute_s": args.compute_s, "transfer_bytes": args.transfer_numel * 4}
    for link in ("idle", "busy"):
        ended = [0.0]

        def transfer(ended: list[float]) -> None:  # a fixed count on both ranks: their all-reduces pair up
            buffer = torch.ones(args.transfer_numel)
            for _ in range(args.transfers):
                dist.all_reduce(buffer, group=bulk)
            ended[0] = time.perf_counter()

        dist.barrier()
        mover = threading.Thread(target=transfer, args=(ended,), daemon=True) if link == "busy" else None
        if mover is not None:
            mover.start()
        for mode in ("sync", "async"):
            result[f"{link}_{mode}_s"] = agreement_costs(mode, args.updates, args.compute_s, agree)
        measured_until = time.perf_counter()
        if mover is not None:
            mover.join()
            result["busy_throughout"] = ended[0] >= measured_until  # the link stayed busy while measured
        dist.barrier()
    if dist.get_rank() == 0 and os.environ.get("TORCHACCO_NODE_REPORT_DIR"):
        Path(os.environ["TORCHACCO_NODE_REPORT_DIR"], "agreement.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
