"""`python -m torchacco.validate --config FILE [overrides]`: check a config before launch.

run_train.sh calls this in one process, so a bad key, type, path or batch size is one
line on the terminal instead of the same error from every rank. WORLD_SIZE is the
number of processes the launch will use.
"""

from __future__ import annotations

import os
import sys

from torchacco.config import load_config
from torchacco.errors import UserError


def main(argv: list[str] | None = None) -> int:
    try:
        from torchacco.trainer import validate

        validate(load_config(sys.argv[1:] if argv is None else argv), int(os.environ.get("WORLD_SIZE", 1)))
    except UserError as e:
        print(f"torchacco: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
