"""BENCHMARK ONLY: `torchacco.train` with an artificial delay before every sharded-job collective.

Emulates a slow interconnect on one machine, where loopback gloo would make communication
nearly free: each reduce-scatter and all-gather of the ZeRO-1/ACCO/DPU/WP job first sleeps
TORCHACCO_BENCH_COMM_DELAY_MS milliseconds (sleeping releases the GIL, as a network wait does),
through the engine's seam for it (`torchacco.parallel.collectives.set_collective_hook`).
Never used by training itself.
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
