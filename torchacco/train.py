"""Training's entry: `torchacco train --config FILE [--section.key VALUE ...]` in one process; `run_train.sh` launches
`python -m torchacco.train` under torchrun on every rank. A `UserError` prints one line and exits 1.
"""

from __future__ import annotations

import os
import sys

from torchacco.config import load_config
from torchacco.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def run() -> None:
        from torchacco.trainer import train

        train(load_config(argv))

    # Every rank hits the same error; rank 0 says it once.
    return run_cli(run, print_errors=int(os.environ.get("RANK", 0)) == 0)


if __name__ == "__main__":  # each rank, under torchrun (torchacco/__main__.py says why this entry stays)
    from torchacco.__main__ import finish

    finish(main())
