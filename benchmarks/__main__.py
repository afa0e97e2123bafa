"""`python -m benchmarks <command>`: the benchmarks' one command line (benchmarks/cli.py; `--help` lists them)."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
