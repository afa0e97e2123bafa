"""The one exception type that reaches the user as a single clear line."""

import contextlib
import json
import os
import sys

ERRORS_DIR = "TORCHACCO_ERRORS_DIR"  # set by the launcher: each worker's error line, for the launcher to print


class UserError(Exception):
    """A mistake the user can fix (config, path, shape, world size). The message says what is wrong, where, and
    what to do; entry points print it as one line and exit non-zero instead of showing a traceback."""


class PeerFailure(UserError):
    """Another rank died or stalled. Every surviving rank reports it (rank 0 may be the dead one).
    `reported`: its line was printed already (`health.report`), before the process group's teardown."""

    def __init__(self, message: str, reported: bool = False):
        super().__init__(message)
        self.reported = reported


def error_line(message: str) -> str:
    """A message as the one `torchacco: error:` line (a value quoted from the user may hold newlines)."""
    return "torchacco: error: " + " ".join(message.split())


def print_error(message: str) -> None:
    """Print the error line with one write: ranks of a job share the launcher's stderr, and a message and its
    newline written apart interleave with another rank's line."""
    line = error_line(message) + "\n"
    sys.stderr.flush()
    try:
        data = line.encode()
        while data:  # one write up to the pipe's atomic size; a longer line may take more
            data = data[os.write(sys.stderr.fileno(), data) :]
    except (AttributeError, OSError, ValueError):  # a captured stderr without a file descriptor
        sys.stderr.write(line)
        sys.stderr.flush()


class Stalled(RuntimeError):
    """A wait on communication outlasted its deadline: a peer stalled, or a collective hangs. NCCL never raises for a
    hung collective (its watchdog aborts the process at the collective timeout), so the compute side gives up first
    and the run's diagnosis says who."""


class Terminated(BaseException):
    """SIGTERM (the launcher stopping the survivors of a failed worker, or a scheduler)."""


class Preempted(Exception):
    """Every rank stopped at the same update on a preemption signal (torchacco/preemption.py), after saving a
    checkpoint when checkpoints are on. Not an error: the process exits with `exit_code`, to be requeued."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def record_error(message: str, printed: bool) -> None:
    """This rank's error line in the launcher's folder (torchacco/launch.py), which prints the lines no rank printed:
    a mistake that only some ranks see (a node-local path) is not lost when rank 0 is not among them."""
    if folder := os.environ.get(ERRORS_DIR):
        path = os.path.join(folder, f"rank_{os.environ.get('RANK', '0')}.json")
        with contextlib.suppress(OSError), open(path, "w") as f:  # (a launcher gone: nobody to read it)
            json.dump({"line": error_line(message), "printed": printed}, f)


def run_cli(main, print_errors: bool = True) -> int:
    """Run an entry point: a `UserError` becomes one `torchacco: error:` line and exit code 1."""
    try:
        return main() or 0
    except UserError as e:
        printed = getattr(e, "reported", False)
        if (print_errors or isinstance(e, PeerFailure)) and not printed:
            print_error(str(e))
            printed = True
        record_error(str(e), printed)
        return 1
    except Preempted as e:
        if print_errors:
            print(f"torchacco: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143
