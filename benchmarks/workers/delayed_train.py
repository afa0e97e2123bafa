"""BENCHMARK ONLY: `torchacco.train` with each sharded-job collective first sleeping TORCHACCO_BENCH_COMM_DELAY_MS
(a slow interconnect on one machine, where loopback is nearly free; a sleep releases the GIL, as a network wait does).
"""

import os
import sys
import time

from torchacco.parallel.collectives import set_collective_hook


def main() -> int:
    delay = float(os.environ.get("TORCHACCO_BENCH_COMM_DELAY_MS", "0")) / 1000
    if delay:
        set_collective_hook(lambda name: time.sleep(delay))
    from torchacco.train import main as train_main

    return train_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
