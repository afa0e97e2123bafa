"""`torchacco COMMAND [ARGS]` (or `python -m torchacco COMMAND`); `torchacco COMMAND --help`: its options.
./run_train.sh launches training on a node's ranks.

"""

# Two modules keep an entry of their own, started by path: `python -m torchacco.launch`, torchrun's agent (run_train.sh
# starts it, the launcher one per fault-tolerant replica), and `python -m torchacco.train`, each rank under torchrun.
# The launcher checks the config of a `-m torchacco.train` launch, and process lines name the workers by it;
# run_train.sh's DRY=1 line, which job scripts check, stays as it is.

import gc
import importlib
import os
import sys

from torchacco.errors import print_error, run_cli

# command -> (the module whose `main(argv)` runs it, imported when asked: `config --help` needs no torch; what it does)
COMMANDS = {
    "train": ("torchacco.train", "train in this one process (./run_train.sh launches every rank)"),
    "predict": ("torchacco.planning.predict", "the strategy that reaches a loss soonest on a cluster, and its config"),
    "dry-run": ("torchacco.planning.dry_run", "a config checked on a cluster: memory per rank, time per update"),
    "prepare-data": ("torchacco.prepare_data", "the corpus tokenized into the cache, ahead of a cluster job"),
    "generate": ("torchacco.generate", "text sampled from an exported model"),
    "instructions": ("torchacco.data.instructions", "the finetuning recipes' instructions, from the embedded corpus"),
    "export": ("torchacco.export", "a run's checkpoint as a Hugging Face folder"),
    "config": ("torchacco.config", "the configuration reference (--help [SECTION]: a section's keys)"),
    "validate": ("torchacco.validate", "the launcher's checks of a config, alone"),
    "calibrate": ("torchacco.emulation", "the compute per micro-batch that [emulation] virtual_compute waits"),
    "lighthouse": ("torchacco.fault_tolerance", "the lighthouse of a cluster's fault-tolerant DiLoCo run"),
    "traits": ("torchacco.parallel.registry", "docs/parallelism.md's table of the strategies' traits"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return __doc__ + "\n".join(f"    {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        from torchacco.config import did_you_mean  # (no torch)

        said = f"unknown command {argv[0]!r}{did_you_mean(argv[0], COMMANDS) or ';'}" if argv else "no command;"
        print_error(f"{said} the commands: {', '.join(COMMANDS)} (torchacco --help says what each does)")
        return 1
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return run_cli(lambda: module.main(argv[1:]))


def finish(code: int):
    """Exit with `code`, past what would slow or break the interpreter's exit."""
    runners = sys.modules.get("torchacco.runners")
    if runners is not None and runners.left_stuck.is_set():  # a communication thread still inside gloo or NCCL:
        sys.stdout.flush()  # finalizing beside it can abort
        sys.stderr.flush()
        os._exit(code)
    gc.freeze()  # exit then skips collecting torch's object graph, over a second of a process's end
    sys.exit(code)


def run() -> None:
    """The `torchacco` console script."""
    finish(main())


if __name__ == "__main__":
    run()
