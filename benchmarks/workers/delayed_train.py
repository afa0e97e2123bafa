"""BENCHMARK ONLY: `torchacco.train` with an artificial delay before every sharded-job collective.

Emulates a slow interconnect on one machine, where loopback gloo would make communication
nearly free: each reduce-scatter and all-gather of the ZeRO-1/ACCO/DPU/WP job first sleeps
TORCHACCO_BENCH_COMM_DELAY_MS milliseconds (sleeping releases the GIL, as a network wait does).
Never used by training itself.
"""

import functools
import os
import sys
import time

from torchacco.parallel import sharded_job as sharded


def _delayed(collective, seconds):
    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        time.sleep(seconds)
        return collective(*args, **kwargs)

    return wrapper


def main() -> int:
    delay = float(os.environ.get("TORCHACCO_BENCH_COMM_DELAY_MS", "0")) / 1000
    if delay:
        sharded.reduce_scatter = _delayed(sharded.reduce_scatter, delay)
        sharded.all_gather = _delayed(sharded.all_gather, delay)
    from torchacco.train import main as train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
