"""Benchmarks: they print and save their numbers (JSON + markdown + PNG); they are not tests, and not part of the
installed package. One command line, run from the repository's root: `python -m benchmarks --help` (benchmarks/cli.py)
lists the commands; yardstick/ is time to a target loss, cluster/ the emulated cluster, workers/ what its ranks run.
"""

import sys

if sys.argv[:1] == ["-m"] and "-m" in sys.orig_argv:  # `python -m benchmarks.<module>` is being located
    from benchmarks.cli import COMMAND_OF
    from torchacco.errors import error_line

    module = sys.orig_argv[sys.orig_argv.index("-m") + 1]
    if module in COMMAND_OF:
        command = COMMAND_OF[module]
        print(error_line(f"run it as python -m benchmarks {command} (not python -m {module})"), file=sys.stderr)
        raise SystemExit(2)
