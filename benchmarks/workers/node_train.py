"""BENCHMARK ONLY: `torchacco.train` on one emulated node, plus a per-rank report at exit.

Writes `$TORCHACCO_NODE_REPORT_DIR/rank<R>.json` with the rank's peak resident memory (CPU) or
peak allocated memory (CUDA), its wall time and its network address, so memory can be compared per
rank and per strategy (`metrics.jsonl` is written by rank 0 only). Training itself is unchanged.
"""

import json
import os
import resource
import sys
import time
from pathlib import Path


def _report(started: float, code: int) -> None:
    folder = os.environ.get("TORCHACCO_NODE_REPORT_DIR")
    if not folder:
        return
    rank = int(os.environ.get("RANK", 0))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {
        "rank": rank,
        "exit_code": code,
        "wall_s": time.perf_counter() - started,
        "cpu_user_s": usage.ru_utime,
        "cpu_sys_s": usage.ru_stime,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "node_addr": os.environ.get("TORCHACCO_NODE_ADDR", ""),
        "node": int(os.environ.get("TORCHACCO_NODE_INDEX", -1)),
    }
    try:
        import torch

        if torch.cuda.is_available():
            record["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    except Exception:  # a report must never fail the run
        pass
    try:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(record))
    except OSError:
        pass


def slow_rank_args() -> list[str]:
    """Under virtual compute, the slow node's ranks name themselves slow ([emulation] slow_ranks): which global
    ranks a node gets is the rendezvous' choice."""
    if os.environ.get("TORCHACCO_SLOW_NODE") != os.environ.get("TORCHACCO_NODE_INDEX", "-1"):
        return []
    factor = os.environ["TORCHACCO_SLOW_FACTOR"]
    return ["--emulation.slow_ranks", os.environ["RANK"], "--emulation.slow_factor", factor]


def main() -> int:
    started = time.perf_counter()
    from torchacco.train import main as train_main

    code = 1
    try:
        code = train_main(sys.argv[1:] + slow_rank_args()) or 0
    finally:
        _report(started, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
