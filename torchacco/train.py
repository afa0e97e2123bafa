"""Command-line entry: `python -m torchacco.train --config FILE [--section.key VALUE ...]`.

`run_train.sh` launches this under torchrun. A `UserError` prints one line and exits 1.
"""

from __future__ import annotations

import gc
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


if __name__ == "__main__":
    code = main()
    from torchacco.runners import left_stuck

    if left_stuck.is_set():  # a communication thread still inside gloo or NCCL: finalizing beside it can abort
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    gc.freeze()  # exit then skips collecting torch's object graph, over a second of every rank's end
    sys.exit(code)
