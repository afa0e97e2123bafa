"""`python -m benchmarks ...`: the sweeps' command line (`predict` hands over to `python -m torchacco.predict`)."""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks import sweeps
from benchmarks.cluster import preflight
from benchmarks.sweeps import decomposition
from benchmarks.sweeps.common import load
from benchmarks.sweeps.convergence import convergence
from benchmarks.sweeps.heterogeneous import heterogeneous
from benchmarks.sweeps.memory import memory
from benchmarks.sweeps.throughput import throughput
from benchmarks.sweeps.time_to_loss import time_to_loss
from benchmarks.sweeps.ttl_strategies import strategies as ttl_strategies
from torchacco import predict

# CLI ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=sweeps.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    p = sub.add_parser("time-to-loss", help="the headline: time to a target validation loss per strategy")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--settings", default="a,b,c")
    p.add_argument("--strategies", default=",".join(ttl_strategies()))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--updates", type=int, default=160, help="DDP's updates: the token budget")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-batch", type=int, default=4, help="sequences per micro-batch (setting c: half)")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--cpu-per-node", type=float, default=0.45)
    p.add_argument("--retries", type=int, default=1, help="runs again when other work took CPU meanwhile")
    p.add_argument("--max-other-cpu", type=float, default=0.1, help="share of the machine's CPU other work may take")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the settings in <out>/time_to_loss.json, run the rest")
    p = sub.add_parser(
        "time-to-target",
        help="time to several target losses: tokens on loopback × speed on the cluster (sweeps/decomposition.py)",
    )
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="time_to_target_all", help="the results' file names' stem")
    p.add_argument("--updates", type=int, default=1000, help="DDP's base run: the token budget")
    p.add_argument("--lr", default="3e-3", help="the peak learning rate of every run (DDP's best at 1,000 updates)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument(
        "--variants",
        default=decomposition.VARIANTS,
        help="the token side's variants besides DDP (benchmarks.token_efficiency)",
    )
    p.add_argument("--budgets", default="0.75,1,1.25", help="multiples of --updates each variant runs")
    p.add_argument(
        "--levels", default="0.75,1", help="multiples of --updates DDP runs: its final losses are the targets"
    )
    p.add_argument("--settings", default="a,b")
    p.add_argument("--strategies", default=decomposition.STRATEGIES, help="timed on the cluster (benchmarks.speed)")
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
    sub.add_parser("predict", help="the cost model for a real cluster: the same as python -m torchacco.predict")
    sub.add_parser("gpu-check", help="the CUDA paths in one short GPU lease (benchmarks/gpu_check.py)", add_help=False)
    return parser


QUICK = {
    "throughput": dict(strategies="zero1,acco,acco_adaptive", steps=4, warmup=1, rates=""),
    "heterogeneous": dict(strategies="zero1,acco_adaptive", steps=3, warmup=1, nodes=2, cpu_per_node=0.9),
    "convergence": dict(strategies="zero1,acco", steps=10, seeds="0", eval_every=5, eval_batches=2),
    "memory": dict(strategies="zero1,acco", steps=2),
    "time-to-loss": dict(
        strategies="ddp,zero1,acco,acco_balanced", seeds="0", updates=30, eval_every=10, settings="a,c"
    ),
    "time-to-target": decomposition.QUICK,
}
SWEEPS = {
    "throughput": throughput,
    "heterogeneous": heterogeneous,
    "convergence": convergence,
    "memory": memory,
    "time-to-loss": time_to_loss,
    "time-to-target": decomposition.time_to_target_sweep,
}


def run(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["predict"]:
        return predict.main(argv[1:])
    if argv[:1] == ["gpu-check"]:
        from benchmarks.gpu_check import main

        return main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    preflight(need_cgroup=args.sweep in ("heterogeneous", "all", "time-to-loss", "time-to-target"))
    # `all`: the four sweeps of tokens/s, memory and convergence; time-to-loss and time-to-target run on their own
    names = [n for n in SWEEPS if n not in ("time-to-loss", "time-to-target")] if args.sweep == "all" else [args.sweep]
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
        SWEEPS[name](sub_args)
    print(f"done in {time.perf_counter() - started:.0f} s (load {load()})")
    return 0
