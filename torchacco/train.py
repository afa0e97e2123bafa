"""Command-line entry: `python -m torchacco.train --config FILE [--section.key VALUE ...]`.

`run_train.sh` launches this under torchrun. A `UserError` prints one line and exits 1.
"""

from __future__ import annotations

import os
import sys

from torchacco.config import load_config
from torchacco.errors import UserError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = load_config(argv)
        from torchacco.trainer import train

        train(cfg)
    except UserError as e:
        if rank == 0:
            print(f"torchacco: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
