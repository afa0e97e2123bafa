"""`python -m benchmarks throughput|heterogeneous|convergence|memory|all|time-to-loss|gpu-check ...` (see sweeps/)."""

import sys

from torchacco.errors import run_cli

if __name__ == "__main__":
    if sys.argv[1:2] == ["gpu-check"]:  # before the sweeps' imports: its parent process needs no torch
        from benchmarks.gpu_check import main

        sys.exit(run_cli(lambda: main(sys.argv[2:])))
    from benchmarks.sweeps.cli import run

    sys.exit(run_cli(lambda: run(sys.argv[1:])))
