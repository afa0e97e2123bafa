"""torchrun, minus its traceback when a worker fails: the worker already printed why."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun


def main() -> int:
    try:
        torchrun(sys.argv[1:])
    except ChildFailedError as e:
        failures = e.failures
        rank, failure = min(failures.items())
        print(f"torchacco: {len(failures)} worker(s) failed (first: rank {rank}, exit code {failure.exitcode}); "
              "see the messages above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
