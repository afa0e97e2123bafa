"""`python -m benchmarks <command>`: the benchmarks' one command line. Run it from the repository's root; the
commands on the emulated cluster (benchmarks/cluster/) need root (`sudo .venv/bin/python -m benchmarks ...`).

The yardstick, time to a target loss (benchmarks/yardstick/):
    time-to-target        the whole benchmark: tokens on loopback × speed on the cluster, [--validate] whole runs
    token-efficiency      its token side: loss at equal tokens against DDP, paired by seed (loopback, no root)
    speed                 its speed side: seconds per update (and peak memory) per strategy and setting on the cluster
    time-to-target-table  the product alone, from saved token-efficiency and speed results
    end-to-end            whole runs on the cluster to DDP's loss, against the product
    efficiency-table      torchacco/planning/token_efficiency.json (what `predict` reads) from token-efficiency results
    figures               the README's figures: time to DDP's loss against the link rate, measured and modelled
The cost model (`torchacco.planning.cost_model`):
    predict               for a real cluster: the same as python -m torchacco predict (no root)
    cost-model-check      its time per update against the cluster's measured speed (--probe: measure its inputs)
Tools:
    cluster               one training run on the emulated cluster: cluster [options] -- <torchacco.train arguments>
    gpu                   the GPU benchmarks: gpu mfu|overlap
    gpu-check             the CUDA paths in one short GPU lease (its parent process needs no torch)
    fault-goodput         fault-tolerant DiLoCo replicas on the cluster, with and without a replica killed repeatedly

`python -m benchmarks <command> --help` gives a command's options. PNGs need matplotlib (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchacco.errors import run_cli

# command -> the module whose `main(argv)` runs it (imported when asked: gpu-check's parent needs no torch)
MODULES = {
    "time-to-target": "benchmarks.yardstick",
    "token-efficiency": "benchmarks.yardstick.tokens",
    "speed": "benchmarks.yardstick.speed",
    "time-to-target-table": "benchmarks.yardstick.table",
    "end-to-end": "benchmarks.yardstick.end_to_end",
    "efficiency-table": "benchmarks.yardstick.efficiency",
    "figures": "benchmarks.figures",
    "predict": "torchacco.planning.predict",
    "cost-model-check": "benchmarks.cost_model_check",
    "cluster": "benchmarks.cluster.__main__",
    "gpu": "benchmarks.gpu",
    "gpu-check": "benchmarks.gpu_check",
    "fault-goodput": "benchmarks.fault_goodput",
}
# modules with no `__main__`: `python -m <module>` gets one line naming its command
COMMAND_OF = {m: c for c, m in MODULES.items() if m.startswith(("benchmarks.yardstick.", "benchmarks.cost_model",
                                                                 "benchmarks.figures"))}  # fmt: skip


def run(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODULES:
        return importlib.import_module(MODULES[argv[0]]).main(argv[1:]) or 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("command", choices=list(MODULES))
    parser.parse_args(argv[:1])
    return 0


def main(argv=None) -> int:
    return run_cli(lambda: run(argv))
