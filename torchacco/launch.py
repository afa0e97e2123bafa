"""torchrun, minus its tracebacks: a failed worker already printed why, and a rendezvous that
times out gets one line saying what to check. A `-m torchacco.train` launch first checks its
config here, in the launcher's process, so a mistake is one line before any worker starts."""

from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import get_args_parser
from torch.distributed.run import main as torchrun

from torchacco.validate import main as validate


def describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def check_training_config(argv: list[str]) -> int:
    """Validate `-m torchacco.train ARGS` for the world the launch will start; 0 if fine."""
    args = get_args_parser().parse_args(argv)
    if not (args.module and args.training_script == "torchacco.train"):
        return 0
    try:
        nodes, per_node = int(str(args.nnodes).rpartition(":")[2]), int(args.nproc_per_node)
    except ValueError:
        return 0  # "auto" or "gpu" process counts: the workers check once they know
    return validate(args.training_script_args, world_size=nodes * per_node, local_world_size=per_node)


def main() -> int:
    if check_training_config(sys.argv[1:]):
        return 1
    try:
        torchrun(sys.argv[1:])
    except ChildFailedError as e:
        failures = e.failures
        rank, failure = min(failures.items())
        print(
            f"torchacco: {len(failures)} worker(s) failed (first: rank {rank}, {describe(failure.exitcode)}); "
            "see the messages above",
            file=sys.stderr,
        )
        return 1
    except RendezvousError as e:
        print(
            f"torchacco: error: the nodes did not all join the rendezvous ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else 'no detail'}); check that NNODES nodes "
            "were started with the same MASTER_ADDR, MASTER_PORT and RDZV_ID, that node 0 is reachable on "
            "MASTER_PORT, and RDZV_TIMEOUT",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
