"""Heterogeneous cluster: one node slower (a CPU quota), tokens/s per strategy."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

from benchmarks.cluster import Cluster, ClusterPlan, parse_rate
from benchmarks.names import ACCO, ZERO1
from benchmarks.sweeps.common import (
    DEFAULT_MODEL,
    QUIET,
    collective_factors,
    default_workload,
    load,
    pyplot_or_none,
    rate_label,
    run_point,
    save_figure,
    save_results,
    strategies_arg,
)
from torchacco import cost_model as cm

_SPIN = "import time\nt=time.perf_counter(); n=0\nwhile time.perf_counter()-t<{s}: n+=1\nprint(n)"


def measure_cpu(plan: ClusterPlan, seconds: float = 3.0) -> list[float]:
    """Busy-loop iterations per second in every node at once (inside its CPU cgroup): the real slowdown."""
    rates = []
    with Cluster(plan) as cluster:
        logs = [Path(f"/tmp/tacc_spin_{os.getpid()}_{i}.txt") for i in range(plan.nodes)]
        procs = [
            cluster.launch(i, [sys.executable, "-c", _SPIN.format(s=seconds)], log=logs[i]) for i in range(plan.nodes)
        ]
        for p in procs:
            p.wait()
        for log in logs:
            try:
                rates.append(float(log.read_text().split()[-1]) / seconds)
            finally:
                log.unlink(missing_ok=True)
    return rates


def heterogeneous(args) -> dict:
    strategies = strategies_arg(args.strategies)
    plan_kw = dict(
        nodes=args.nodes,
        rate_bps=parse_rate(args.rate),
        slow_node=args.nodes - 1,
        slow_factor=args.slow_factor,
        cpu_per_node=args.cpu_per_node,
    )
    # The quota alone does not make the node exactly N× slower on a shared machine (the fast nodes may not
    # get their full quota): measure, and correct the slow node's quota until the measured ratio is right.
    for attempt in range(3):
        cpu = measure_cpu(ClusterPlan(**plan_kw), seconds=2.0)
        measured_factor = statistics.mean(cpu[:-1]) / cpu[-1]
        print(
            f"[heterogeneous] busy-loop rate per node {[f'{x:.3g}' for x in cpu]}: slow node "
            f"{measured_factor:.2f}× slower with a {plan_kw['slow_factor']:.2f}× smaller quota (load {load()})",
            flush=True,
        )
        if abs(measured_factor / args.slow_factor - 1) < 0.1 or attempt == 2:
            break
        plan_kw["slow_factor"] = max(1.0, plan_kw["slow_factor"] * args.slow_factor / measured_factor)
    work = default_workload(micro_batches=2, local_batch=args.local_batch)
    factors = {}
    if plan_kw["rate_bps"] is not None:
        factors = collective_factors(ClusterPlan(**plan_kw), work, Path(args.out) / "runs" / "cluster" / "het_probe")
        print(
            f"[heterogeneous] gloo collectives over their ring ideal: reduce-scatter {factors['rs_factor']:.2f}×, "
            f"all-gather {factors['ag_factor']:.2f}×, all-reduce {factors['ar_factor']:.2f}×",
            flush=True,
        )
    lb = args.local_batch
    gb = 2 * lb * args.nodes  # two micro-batches per rank and update (one per ACCO round)
    extra = [
        *DEFAULT_MODEL,
        *QUIET,
        "--eval.every",
        "0",
        "--training.steps",
        str(args.steps),
        "--training.local_batch_size",
        str(lb),
        "--training.global_batch_size",
        str(gb),
    ]
    runs = Path(args.out) / "runs" / "cluster" / "heterogeneous"
    points, uniform = [], {}
    for s in strategies:
        print(f"[heterogeneous] {s} (load {load()})", flush=True)
        p = run_point(ClusterPlan(**plan_kw), s, extra, runs / s, args.warmup, args.timeout)
        points.append(p)
        print(f"  {p['tokens_per_s']:,.0f} tok/s, micro-batches per rank {p['micro_batches_per_rank']}", flush=True)
    if args.uniform_reference:
        for s in (ZERO1, "acco_adaptive"):
            if s in strategies:
                print(f"[heterogeneous] reference without a slow node: {s}", flush=True)
                uniform[s] = run_point(
                    ClusterPlan(**{**plan_kw, "slow_node": None, "slow_factor": 1.0}),
                    s,
                    extra,
                    runs / f"{s}_uniform",
                    args.warmup,
                    args.timeout,
                )
    data = {
        "sweep": "heterogeneous",
        **plan_kw,
        "target_slow_factor": args.slow_factor,
        "local_batch": lb,
        "global_batch": gb,
        "warmup": args.warmup,
        "cpu_rates": cpu,
        "measured_slow_factor": measured_factor,
        "collective_factors": factors,
        "steps": args.steps,
        "points": points,
        "uniform": uniform,
        "load_end": load(),
    }
    return report_heterogeneous(data, Path(args.out))


def report_heterogeneous(data: dict, out: Path) -> dict:
    """Cost model, table and plot of a heterogeneous sweep (also re-run from its saved JSON)."""
    points, uniform, nodes = data["points"], data["uniform"], data["nodes"]
    measured_factor, factors = data["measured_slow_factor"], data["collective_factors"]
    work = default_workload(micro_batches=2, local_batch=data["local_batch"])
    zero1 = next((p for p in points if p["strategy"] == ZERO1), None)
    for p in points:
        p["vs_zero1"] = p["tokens_per_s"] / zero1["tokens_per_s"] if zero1 else math.nan
    if zero1:
        # cost model inputs, none taken from the runs it predicts except the fast ranks' compute: rank 0 (a fast
        # node) times its own micro-batches in ZeRO-1 (its wait for the slow rank shows as exposed communication);
        # the slow rank is the busy-loop factor slower; the optimizer runs at the throughput sweep's calibrated
        # speed scaled by the node's CPU share; the collectives' factors were probed on this cluster.
        opt_rate = 1.2e7
        try:
            opt_rate = json.loads((out / "cluster_throughput.json").read_text())["calibration"]["opt_rate"]
        except (OSError, ValueError, KeyError):
            pass
        hw = cm.Hardware(
            nodes=nodes,
            flops=1.0,
            bandwidth_bps=data["rate_bps"],
            compute_s=zero1["compute_s"] / work.micro_batches,
            slow_factor=measured_factor,
            opt_rate=opt_rate * data["cpu_per_node"],
            streams=False,  # the emulation computes on CPU
            **{k: v for k, v in factors.items() if k.endswith("factor")},
        )
        for p in points:
            pred = cm.predict(work, hw, p["strategy"])
            p["predicted_tokens_per_s"] = pred["tokens_per_s"]
            p["model_error"] = cm.relative_error(pred["tokens_per_s"], p["tokens_per_s"])
    lines = [
        f"{nodes} nodes × 1 CPU process, {data['cpu_per_node']:g} cores each, node {nodes - 1} at "
        f"{data['cpu_per_node'] / data['slow_factor']:.3g} cores (target {data['target_slow_factor']:g}× slower; "
        f"measured {measured_factor:.2f}× by a busy loop in every node at once), links "
        f"{rate_label(data['rate_bps'])}, GPT-Neo tiny, micro-batch {data['local_batch']} × 256, global batch "
        f"{data['global_batch']}, {data['steps']} steps ({data['warmup']} dropped).",
        "",
        "| strategy | tokens/s | step (s) | exposed comm (s) | micro-batches per rank | tokens per update | "
        "vs ZeRO-1 | predicted tokens/s | model error | load |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for p in points:
        lines.append(
            f"| {p['strategy']} | {p['tokens_per_s']:,.0f} | {p['step_time_s']:.2f} | {p['exposed_comm_s']:.2f} | "
            f"{p['micro_batches_per_rank'] or '-'} | {p['tokens_per_update']:,.0f} | {p['vs_zero1']:.2f}× | "
            f"{p.get('predicted_tokens_per_s', math.nan):,.0f} | {p.get('model_error', math.nan):+.0%} | "
            f"{p['load_before'][0]:.1f} |"
        )
    for s, p in uniform.items():
        lines.append(
            f"| {s}, no slow node | {p['tokens_per_s']:,.0f} | {p['step_time_s']:.2f} | "
            f"{p['exposed_comm_s']:.2f} | {p['micro_batches_per_rank'] or '-'} | {p['tokens_per_update']:,.0f} "
            f"| | | | {p['load_before'][0]:.1f} |"
        )
    best = max((p for p in points if p["strategy"].startswith(ACCO)), key=lambda p: p["vs_zero1"], default=None)
    if best and zero1:
        lines += [
            "",
            f"Target (ACCO ≥ 2.5× ZeRO-1 with the slow worker): {best['strategy']} {best['vs_zero1']:.2f}× → "
            f"{'met' if best['vs_zero1'] >= 2.5 else 'missed'}.",
        ]
    if zero1:
        errs = [abs(p["model_error"]) for p in points]
        lines.append(f"Cost model: mean absolute error {statistics.mean(errs):.0%} over {len(errs)} strategies.")
    table = "\n".join(lines) + "\n"
    base = save_results(out, "heterogeneous", data, table)
    plt = pyplot_or_none()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [p["strategy"] for p in points]
        ax.bar(names, [p["tokens_per_s"] for p in points], color="tab:blue", label="measured")
        if all("predicted_tokens_per_s" in p for p in points):
            ax.scatter(
                names,
                [p["predicted_tokens_per_s"] for p in points],
                color="black",
                marker="_",
                s=400,
                label="cost model",
                zorder=3,
            )
        for s, p in uniform.items():
            ax.axhline(p["tokens_per_s"], ls=":", color="grey")
            ax.text(len(names) - 0.5, p["tokens_per_s"], f"{s}, no slow node", fontsize=7, ha="right", va="bottom")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{nodes} nodes, one {measured_factor:.1f}× slower (measured)")
        ax.legend(fontsize=8)
        save_figure(fig, base)
    return data
