"""BENCHMARK ONLY: `torchacco.train` on one emulated node, then `$TORCHACCO_NODE_REPORT_DIR/rank<R>.json`: the rank's
peak memory, CPU and wall time, and its node (metrics.jsonl is rank 0's only)."""

import contextlib
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
        "peak_rss_gib": usage.ru_maxrss / 2**20,
        "node_addr": os.environ.get("TORCHACCO_NODE_ADDR", ""),
        "node": int(os.environ.get("TORCHACCO_NODE_INDEX", -1)),
    }
    with contextlib.suppress(Exception):  # a report must never fail the run
        import torch

        if torch.cuda.is_available():
            record["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    with contextlib.suppress(OSError):
        Path(folder, f"rank{rank}.json").write_text(json.dumps(record))


def slow_rank_args() -> list[str]:
    """Under virtual compute, the slow node's ranks name themselves slow (the rendezvous picks a node's ranks)."""
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
