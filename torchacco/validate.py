"""`python -m torchacco.validate --config FILE [overrides]`: check a config before launch.

The launcher (`torchacco.launch`) runs this check in its own process before it starts any
worker, so a bad key, type, path or batch size is one line on the terminal instead of the
same error from every rank. Run alone, WORLD_SIZE is the number of processes to check for.
"""

from __future__ import annotations

import os
import sys

from torchacco.config import load_config
from torchacco.errors import run_cli


def main(argv: list[str] | None = None, world_size: int | None = None, local_world_size: int | None = None) -> int:
    from torchacco.trainer import validate

    argv = sys.argv[1:] if argv is None else argv
    world_size = world_size or int(os.environ.get("WORLD_SIZE", 1))
    return run_cli(lambda: validate(load_config(argv), world_size, local_world_size))


if __name__ == "__main__":
    sys.exit(main())
