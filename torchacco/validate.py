"""`python -m torchacco.validate --config FILE [overrides]`: check a config before launch.

run_train.sh calls this in one process, so a bad key, type, path or batch size is one
line on the terminal instead of the same error from every rank. WORLD_SIZE is the
number of processes the launch will use.
"""

from __future__ import annotations

import os
import sys

from torchacco.config import load_config
from torchacco.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    from torchacco.trainer import validate

    argv = sys.argv[1:] if argv is None else argv
    return run_cli(lambda: validate(load_config(argv), int(os.environ.get("WORLD_SIZE", 1))))


if __name__ == "__main__":
    sys.exit(main())
