"""`python -m torchacco.bench throughput|heterogeneous|convergence|memory|all|predict ...` (see sweeps/)."""

import sys

from torchacco.bench.sweeps.cli import run
from torchacco.errors import run_cli

if __name__ == "__main__":
    sys.exit(run_cli(lambda: run(sys.argv[1:])))
