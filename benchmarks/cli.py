"""`python -m benchmarks <command>`: the benchmarks' one command line. Run it from the repository's root; the
commands on the emulated cluster (`benchmarks/cluster/`) need root (`sudo .venv/bin/python -m benchmarks ...`).

The yardstick, time to a target loss (benchmarks/time_to_target.py):
    time-to-target        the whole benchmark: tokens on loopback × speed on the cluster, [--validate] whole runs
    token-efficiency      its token side: loss at equal tokens against DDP, paired by seed (loopback, no root)
    speed                 its speed side: seconds per update per strategy and setting on the cluster
    time-to-target-table  the product alone, from saved token-efficiency and speed results
    end-to-end            whole runs on the cluster to DDP's loss, against the product
    efficiency-table      torchacco/token_efficiency.json (what `predict` reads) from token-efficiency results
The cost model (`torchacco.cost_model`):
    predict               for a real cluster: the same as python -m torchacco.predict (no root)
    cost-model-check      its time per update against the cluster's measured speed (--probe: measure its inputs)
Sweeps on the cluster (benchmarks/sweeps/: <out>/cluster_<sweep>.{json,md,png}, raw runs in <out>/runs/cluster/):
    throughput            strategy × link rate, default model, 2 nodes
    heterogeneous         4 nodes, one 4× slower (CPU quota)
    convergence           val loss vs tokens and wall-clock, 3 seeds
    memory                peak memory per rank per strategy
    all [--quick]         those four
Tools:
    cluster               one training run on the emulated cluster: cluster [options] -- <torchacco.train arguments>
    compare               training variants side by side on one machine
    acco-reference        ACCO's equations written out again in one process (benchmarks/acco_reference.py)
    gpu                   the GPU benchmarks: gpu mfu|overlap
    gpu-check             the CUDA paths in one short GPU lease (benchmarks/gpu_check.py; its parent needs no torch)

`python -m benchmarks <command> --help` gives a command's options. PNGs need matplotlib (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from torchacco.errors import run_cli

# commands that are another module's own command line: module, one line of help
MODULES = {
    "token-efficiency": ("benchmarks.token_efficiency", "loss at equal tokens against DDP, paired by seed"),
    "speed": ("benchmarks.speed", "seconds per update per strategy and setting on the cluster"),
    "time-to-target-table": ("benchmarks.time_to_target", "time to target from saved token and speed results"),
    "end-to-end": ("benchmarks.end_to_end", "whole runs on the cluster against the time-to-target product"),
    "efficiency-table": ("benchmarks.efficiency_table", "torchacco/token_efficiency.json from token results"),
    "predict": ("torchacco.predict", "the cost model for a real cluster (python -m torchacco.predict)"),
    "cost-model-check": ("benchmarks.cost_model_check", "the cost model against the cluster's measured speed"),
    "cluster": ("benchmarks.cluster.__main__", "one training run on the emulated cluster"),
    "compare": ("benchmarks.compare", "training variants side by side on one machine"),
    "acco-reference": ("benchmarks.acco_reference", "ACCO's equations again in one process"),
    "gpu": ("benchmarks.gpu", "the GPU benchmarks: mfu, overlap"),
    "gpu-check": ("benchmarks.gpu_check", "the CUDA paths in one short GPU lease"),
}


def moved(module: str) -> int:
    """`python -m benchmarks.<module>`, a form these commands no longer take: one line naming the new one."""
    command = next((c for c, (m, _) in MODULES.items() if m == module), "--help")
    print(f"torchacco: error: run it as python -m benchmarks {command} (not python -m {module})", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from benchmarks import time_to_target

    sub = parser.add_subparsers(dest="sweep", required=True)

    def common(p, strategies, steps, nodes=2, warmup=2, timeout=600):
        p.add_argument("--out", default="bench_results")
        p.add_argument("--strategies", default=strategies)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--warmup", type=int, default=warmup, help="logged steps dropped from the averages")
        p.add_argument("--nodes", type=int, default=nodes)
        p.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
        p.add_argument("--quick", action="store_true", help="a ~2-minute smoke version")

    p = sub.add_parser("throughput", help="strategy × link rate")
    common(p, "ddp,zero1,fsdp,acco,acco_adaptive,dpu", 6)
    p.add_argument("--rates", default="50mbit,1gbit", help="link rates besides unshaped and the computed balance rate")
    p.add_argument("--probe-rate", default="100mbit", help="link rate at which the gloo collectives are timed")
    p = sub.add_parser("heterogeneous", help="one node slower")
    common(p, "ddp,zero1,acco,acco_adaptive,dpu", 5, nodes=4, warmup=1)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--cpu-per-node", type=float, default=0.45, help="cores per node (quota); the slow node gets less")
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--uniform-reference", action="store_true", help="also run zero1/acco_adaptive with no slow node")
    p = sub.add_parser("convergence", help="validation loss vs tokens and wall-clock, seeds")
    common(p, "ddp,zero1,acco,dpu,wp", 50)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p = sub.add_parser("memory", help="peak memory per rank per strategy")
    common(p, "ddp,zero1,fsdp,acco,dpu,wp", 3, warmup=0)
    p.add_argument(
        "--precision",
        default="bf16",
        choices=("fp32", "bf16"),
        help="compute dtype (the target is stated for bf16; fp32 runs ~3× faster on CPU)",
    )
    p.add_argument(
        "--malloc",
        default="mmap",
        choices=("mmap", "default"),
        help="mmap: glibc returns freed tensor memory at once (RSS follows live memory)",
    )
    p = sub.add_parser(
        "time-to-target",
        help="the yardstick: time to several target losses, tokens on loopback × speed on the cluster",
    )
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="time_to_target_all", help="the results' file names' stem")
    p.add_argument("--updates", type=int, default=1000, help="DDP's base run: the token budget")
    p.add_argument("--lr", default="3e-3", help="the peak learning rate of every run (DDP's best at 1,000 updates)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument(
        "--variants",
        default=time_to_target.VARIANTS,
        help="the token side's variants besides DDP (token-efficiency)",
    )
    p.add_argument("--budgets", default="0.75,1,1.25", help="multiples of --updates each variant runs")
    p.add_argument(
        "--levels", default="0.75,1", help="multiples of --updates DDP runs: its final losses are the targets"
    )
    p.add_argument("--settings", default="a,b")
    p.add_argument("--strategies", default=time_to_target.STRATEGIES, help="timed on the cluster (speed)")
    p.add_argument("--speed-updates", type=int, default=110, help="updates per speed run (the first 10 are warm-up)")
    p.add_argument("--repeats", type=int, default=2, help="speed runs per strategy and setting")
    p.add_argument(
        "--validate", default="", help="setting:strategy,... run whole on the cluster to DDP's loss (seed: the first)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds for the calibration run")
    p.add_argument("--quick", action="store_true", help="a few-minute smoke version (bench_results/quick)")
    p.add_argument("--resume", action="store_true", help="keep finished runs with the same arguments; run the rest")
    p = sub.add_parser("all", help="throughput, heterogeneous, convergence and memory")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--quick", action="store_true")
    for name, (_, text) in MODULES.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


QUICK = {
    "throughput": dict(strategies="zero1,acco,acco_adaptive", steps=4, warmup=1, rates=""),
    "heterogeneous": dict(strategies="zero1,acco_adaptive", steps=3, warmup=1, nodes=2, cpu_per_node=0.9),
    "convergence": dict(strategies="zero1,acco", steps=10, seeds="0", eval_every=5, eval_batches=2),
    "memory": dict(strategies="zero1,acco", steps=2),
}


def sweeps() -> dict:
    """command -> the function that runs it on its parsed arguments (imported when asked: they need torch)."""
    from benchmarks import time_to_target
    from benchmarks.sweeps.convergence import convergence
    from benchmarks.sweeps.heterogeneous import heterogeneous
    from benchmarks.sweeps.memory import memory
    from benchmarks.sweeps.throughput import throughput

    QUICK["time-to-target"] = time_to_target.QUICK
    return {"throughput": throughput, "heterogeneous": heterogeneous, "convergence": convergence, "memory": memory,
            "time-to-target": time_to_target.time_to_target_sweep}  # fmt: skip


def run(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODULES:  # before the sweeps' imports: gpu-check's parent process needs no torch
        return importlib.import_module(MODULES[argv[0]][0]).main(argv[1:]) or 0
    from benchmarks.cluster import preflight
    from benchmarks.sweeps.common import load

    parser = build_parser()
    args = parser.parse_args(argv)
    preflight(need_cgroup=args.sweep in ("heterogeneous", "all", "time-to-target"))
    # `all`: the four sweeps of tokens/s, memory and convergence; time-to-target runs on its own
    commands = sweeps()
    names = [n for n in commands if n != "time-to-target"] if args.sweep == "all" else [args.sweep]
    started = time.perf_counter()
    for name in names:
        sub_args = parser.parse_args([name, "--out", args.out])
        if name == args.sweep:
            sub_args = args
        if args.quick:
            for key, value in QUICK[name].items():
                setattr(sub_args, key, value)
            if args.out == "bench_results":
                sub_args.out = "bench_results/quick"
        commands[name](sub_args)
    print(f"done in {time.perf_counter() - started:.0f} s (load {load()})")
    return 0


def main(argv=None) -> int:
    return run_cli(lambda: run(argv))
