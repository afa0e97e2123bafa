"""`python -m benchmarks cluster`: one training run on the emulated cluster (or `--dry-run`: its commands)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import benchmarks.cluster
from benchmarks import common
from benchmarks.cluster.launch import run_training, summarize
from benchmarks.cluster.plan import ClusterError, ClusterPlan, add_node_options, node_options, parse_rate
from torchacco.errors import run_cli


def run(args) -> int:
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    plan = ClusterPlan(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate_bps=parse_rate(args.rate),
                       latency_ms=args.latency_ms, slow_node=args.slow_node, slow_factor=args.slow_factor,
                       cpu_per_node=args.cpu_per_node, **node_options(args))  # fmt: skip
    if args.dry_run:
        for cmd in plan.setup_commands() + [["# teardown"]] + plan.teardown_commands():
            print(" ".join(cmd))
        return 0
    if not train_args:
        raise ClusterError("give the training arguments after `--`, e.g. -- --config train_configs/default.toml")
    print(f"cluster: {plan.describe()}", flush=True)
    result = run_training(plan, train_args, Path(args.out), args.timeout, args.port, args.threads, args.verbose,
                          virtual_compute=args.virtual_compute)  # fmt: skip
    summary = summarize(result["records"], min(2, len(result["records"]) - 1))
    report = {"plan": plan.describe(), "wall_s": round(result["wall_s"], 1), **summary, "ranks": result["ranks"]}
    report |= {"virtual_compute": result["calibration"]} if args.virtual_compute else {}
    print(json.dumps(report, indent=2))
    return 0


def main(argv=None) -> int:
    parser = common.bare_parser("cluster", benchmarks.cluster.__doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks on each node (their traffic unshaped)")
    parser.add_argument("--rate", default="unshaped", help="per-link rate each way, e.g. 200mbit, 1gbit, unshaped")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way link latency (needs tc netem)")
    parser.add_argument("--slow-node", type=int, default=None, help="index of a node made slow by a CPU quota")
    parser.add_argument("--slow-factor", type=float, default=4.0)
    parser.add_argument("--cpu-per-node", type=float, default=None, help="CPU quota of every node, in cores")
    parser.add_argument("--out", default="bench_results/runs/cluster")
    add_node_options(parser)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--port", type=int, default=29400)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--virtual-compute", action="store_true", help="forward, backward and AdamW as calibrated "
                        "waits that hold no CPU, as on GPUs (speed only; torchacco/emulation.py)")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="print the setup and teardown commands only")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then torchacco.train arguments")
    args = parser.parse_args(argv)
    return run_cli(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
