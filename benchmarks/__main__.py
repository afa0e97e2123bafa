"""`python -m benchmarks throughput|heterogeneous|convergence|memory|all|time-to-loss ...` (see sweeps/)."""

import sys

from benchmarks.sweeps.cli import run
from torchacco.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(lambda: run(sys.argv[1:])))
