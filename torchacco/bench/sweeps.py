"""Benchmark sweeps on the emulated cluster (`torchacco.bench.cluster`) and the cost model's validation.

    python -m torchacco.bench throughput     # strategy × link rate, default model, 2 nodes
    python -m torchacco.bench heterogeneous  # 4 nodes, one 4× slower (CPU quota)
    python -m torchacco.bench convergence    # val loss vs tokens and wall-clock, 3 seeds
    python -m torchacco.bench memory         # peak memory per rank per strategy
    python -m torchacco.bench all [--quick]  # all four
    python -m torchacco.bench predict ...    # the cost model for a real cluster (no root needed)

Each sweep prints a markdown table and writes `<out>/cluster_<sweep>.{json,md,png}` (PNG needs
matplotlib: `pip install -e .[bench]`). Raw run folders go to `<out>/runs/cluster/`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from torchacco.bench import cost_model as cm
from torchacco.bench.cluster import (ClusterPlan, Cluster, format_rate, measure_link, parse_rate, preflight,
                                     probe_collectives, run_training)
from torchacco.bench.compare import summarize
from torchacco.errors import UserError

STRATEGY_ARGS = {
    "ddp": ["--parallelism.data_parallel", "ddp"],
    "zero1": ["--parallelism.data_parallel", "zero1"],
    "fsdp": ["--parallelism.data_parallel", "fsdp"],
    "acco": ["--parallelism.data_parallel", "acco"],
    "acco_adaptive": ["--parallelism.data_parallel", "acco", "--acco.mode", "adaptive",
                      "--training.max_tokens", "1000000000000"],
    "dpu": ["--parallelism.data_parallel", "dpu", "--acco.dpu_warmup_steps", "0"],
    "wp": ["--parallelism.data_parallel", "wp"],
}
QUIET = ["--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
         "--checkpoint.enable", "false", "--checkpoint.export_hf", "false"]
DEFAULT_MODEL = ["--config", "train_configs/default.toml"]  # GPT-Neo tiny, 5.85M, seq 256, batch 4, global 16


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def strategies_arg(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in names if s not in STRATEGY_ARGS]
    if bad:
        raise UserError(f"unknown strategy {bad[0]!r}; choose from {', '.join(STRATEGY_ARGS)}")
    return names


# one measured point ------------------------------------------------------------------------

def run_point(plan: ClusterPlan, strategy: str, extra: list[str], folder: Path, warmup: int,
              timeout: float, threads: int = 1, env: dict | None = None) -> dict:
    load_before = load()
    result = run_training(plan, [*extra, *STRATEGY_ARGS[strategy]], folder, timeout_s=timeout, threads=threads,
                          env=env)
    records = result["records"]
    point = {"strategy": strategy, "rate": format_rate(plan.rate_bps), "rate_bps": plan.rate_bps,
             **summarize(records, min(warmup, len(records) - 1)), "wall_s": result["wall_s"],
             "load_before": load_before, "load_after": load(),
             "micro_batches_per_rank": _mean_lists([r.get("micro_batches_per_rank") for r in records[warmup:]]),
             "tokens_per_update": statistics.mean(r["tokens_per_update"] for r in records[warmup:] or records),
             "peak_rss_gib_per_rank": [round(r["peak_rss_gib"], 4) for r in result["ranks"]],
             "records": records}
    # compute-only time per update: what remains of the step once the exposed communication is removed
    point["compute_s"] = point["step_time_s"] - point["exposed_comm_s"]
    return point


def _mean_lists(lists):
    lists = [x for x in lists if x]
    if not lists:
        return []
    return [round(statistics.mean(col), 2) for col in zip(*lists)]


def _fmt_rate(bps):
    return format_rate(bps) if bps else "unshaped"


def _save(out: Path, name: str, data: dict, table: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"cluster_{name}"
    base.with_suffix(".json").write_text(json.dumps(data, indent=2, default=float))
    base.with_suffix(".md").write_text(table)
    print(table, flush=True)
    return base


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print("torchacco: note: matplotlib is not installed, so no PNG plots were drawn (JSON and markdown were "
              "written); install it with: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)
        return None


# throughput: strategy × link rate -----------------------------------------------------------

def calibrate(points: list[dict], work: cm.Workload, nodes: int) -> cm.Hardware:
    """Compute time per micro-batch from the fastest unshaped synchronous run (the least disturbed by the
    other jobs on this shared machine), the optimizer's speed from unshaped ZeRO-1's exposed time."""
    sync = [p for p in points if p["rate_bps"] is None and p["strategy"] in ("ddp", "zero1", "fsdp")]
    c = min(p["compute_s"] for p in sync) / work.micro_batches
    ref = next(p for p in sync if p["strategy"] == "zero1")
    opt_s = max(1e-4, ref["exposed_comm_s"])  # unshaped: the job is (almost) all optimizer step
    return cm.Hardware(nodes=nodes, flops=work.flops_per_token * work.tokens_per_micro_batch / c, bandwidth_bps=None,
                       compute_s=c, opt_rate=work.params / nodes / opt_s)


def collective_factors(plan: ClusterPlan, work: cm.Workload, folder: Path) -> dict:
    """Each gloo collective's measured time over its ring ideal at the plan's link rate (the cost model's f)."""
    probe = probe_collectives(plan, folder, int(work.params))
    ideal = cm.collective_s(probe["bytes"], cm.Hardware(nodes=plan.nodes, flops=1.0, bandwidth_bps=plan.rate_bps))
    return {"rs_factor": probe["reduce_scatter_s"] / ideal, "ag_factor": probe["all_gather_s"] / ideal,
            "ar_factor": probe["all_reduce_s"] / (2 * ideal), "probe": probe}


def default_workload(micro_batches: int = 2, local_batch: int = 4, seq_len: int = 256, flavor: str = "tiny"):
    # the CPU trains in fp32: gradients and parameters travel as 4-byte floats
    return cm.model_workload("gpt_neo", flavor, seq_len, local_batch, micro_batches, vocab_size=10000, comm_bytes=4)


def throughput(args) -> dict:
    strategies = strategies_arg(args.strategies)
    work = default_workload()
    runs = Path(args.out) / "runs" / "cluster" / "throughput"
    extra = [*DEFAULT_MODEL, *QUIET, "--eval.every", "0", "--training.steps", str(args.steps)]
    points, goodput, factors_at = [], {}, {}

    def probe(rate_bps):
        if rate_bps not in factors_at:
            print(f"[throughput] probing gloo collectives at {_fmt_rate(rate_bps)}", flush=True)
            f = collective_factors(ClusterPlan(nodes=args.nodes, rate_bps=rate_bps), work,
                                   runs / f"probe_{_fmt_rate(rate_bps)}")
            print(f"  time over the ring ideal: reduce-scatter {f['rs_factor']:.2f}×, all-gather "
                  f"{f['ag_factor']:.2f}×, all-reduce {f['ar_factor']:.2f}×", flush=True)
            factors_at[rate_bps] = f
        return factors_at[rate_bps]

    def measure(rate_bps):
        plan = ClusterPlan(nodes=args.nodes, rate_bps=rate_bps)
        if rate_bps is not None and rate_bps not in goodput:
            with Cluster(plan) as cluster:
                mb = max(1.0, min(32.0, rate_bps / 8 / 2**20 * 1.5))
                goodput[rate_bps] = measure_link(cluster, megabytes=mb)
            probe(rate_bps)
        for s in strategies:
            print(f"[throughput] {s} @ {_fmt_rate(rate_bps)} (load {load()})", flush=True)
            points.append(run_point(plan, s, extra, runs / f"{s}_{_fmt_rate(rate_bps)}", args.warmup, args.timeout))
            p = points[-1]
            print(f"  {p['tokens_per_s']:,.0f} tok/s, step {p['step_time_s']:.2f} s, exposed {p['exposed_comm_s']:.2f} s, "
                  f"overlap {p['overlap']:.0%}", flush=True)

    # 1. unshaped first: calibrates compute and the optimizer, which fixes the balance rate
    measure(None)
    if "zero1" not in strategies:
        raise UserError("the throughput sweep needs zero1 among --strategies (it calibrates the cost model)")
    hw = calibrate(points, work, args.nodes)
    probe_rate = parse_rate(args.probe_rate)
    factors = probe(probe_rate)
    hw.rs_factor, hw.ag_factor, hw.ar_factor = factors["rs_factor"], factors["ag_factor"], factors["ar_factor"]
    balance = cm.balance_bandwidth(work, hw)
    balance = float(f"{balance:.2g}")  # round to two significant digits
    rates = sorted({*(parse_rate(r) for r in args.rates.split(",") if parse_rate(r)), balance}, reverse=True)
    for rate in rates:
        measure(rate)

    # 2. the cost model's predictions for every measured point
    errors = []
    for p in points:
        # nominal rate, and the collectives' factors probed at that rate (they were measured against it;
        # goodput is reported as a check of the shaping)
        # and the compute time of ZeRO-1 at the same rate: the machine's load changes from minute to minute
        f = factors_at.get(p["rate_bps"], factors)
        ref = next(q for q in points if q["strategy"] == "zero1" and q["rate_bps"] == p["rate_bps"])
        pred = cm.predict(work, cm.Hardware(**{**hw.__dict__, "bandwidth_bps": p["rate_bps"],
                                               "compute_s": ref["compute_s"] / work.micro_batches,
                                               **{k: v for k, v in f.items() if k.endswith("factor")}}), p["strategy"])
        p["predicted_tokens_per_s"] = pred["tokens_per_s"]
        p["predicted_step_time_s"] = pred["step_time_s"]
        p["model_error"] = cm.relative_error(pred["tokens_per_s"], p["tokens_per_s"])
        errors.append(abs(p["model_error"]))
    zero1 = {p["rate_bps"]: p for p in points if p["strategy"] == "zero1"}
    for p in points:
        p["vs_zero1"] = p["tokens_per_s"] / zero1[p["rate_bps"]]["tokens_per_s"]

    by_rate: dict = {}
    for p in points:
        by_rate.setdefault(p["rate_bps"], []).append(p)
    lines = [f"2 nodes × 1 CPU process (1 thread each), GPT-Neo tiny ({work.params / 1e6:.2f}M params, fp32), "
             f"global batch 16 × 256, {args.steps} steps ({args.warmup} dropped). "
             f"Balance rate (ZeRO-1 exposed comm ≈ compute): **{_fmt_rate(balance)}** "
             f"(calibrated compute {hw.compute_s:.3f} s per micro-batch; gloo collectives probed at "
             f"{_fmt_rate(probe_rate)}: reduce-scatter {hw.rs_factor:.2f}×, all-gather {hw.ag_factor:.2f}×, "
             f"all-reduce {hw.ar_factor:.2f}× their ring ideal).", "",
             "Collectives probed at each rate (time over the ring ideal; used by the cost model there): " +
             ", ".join(f"{_fmt_rate(r)}: RS {f['rs_factor']:.2f}× AG {f['ag_factor']:.2f}× AR {f['ar_factor']:.2f}×"
                       for r, f in sorted(factors_at.items())) + ".", "",
             "| link | measured goodput | strategy | tokens/s | step (s) | exposed comm (s) | overlap | vs ZeRO-1 | "
             "predicted tokens/s | model error | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for rate in [None, *rates]:
        for p in by_rate.get(rate, []):
            gp = goodput.get(rate)
            mark = " ⟵ balance" if rate == balance else ""
            lines.append(f"| {_fmt_rate(rate)}{mark} | {f'{gp / 1e6:,.0f} Mbit/s' if gp else '-'} | {p['strategy']} | "
                         f"{p['tokens_per_s']:,.0f} | {p['step_time_s']:.2f} | {p['exposed_comm_s']:.2f} | "
                         f"{p['overlap']:.0%} | {p['vs_zero1']:.2f}× | {p['predicted_tokens_per_s']:,.0f} | "
                         f"{p['model_error']:+.0%} | {p['load_before'][0]:.1f} |")
    mae = statistics.mean(errors)
    bal = by_rate.get(balance, [])
    acco_best = max((p for p in bal if p["strategy"].startswith("acco")), key=lambda p: p["vs_zero1"], default=None)
    lines += ["", f"Cost model: mean absolute error of predicted tokens/s {mae:.0%} over {len(errors)} points "
                  f"(max {max(errors):.0%}); at each rate it is given the compute time of that rate's ZeRO-1 run and the "
                  f"collectives' times probed at that rate.",
              "Target (ACCO ≥ 1.7× ZeRO-1 at the balance rate): " +
              (f"{acco_best['strategy']} {acco_best['vs_zero1']:.2f}× → "
               f"{'met' if acco_best['vs_zero1'] >= 1.7 else 'missed'}" if acco_best else "not measured"), ""]
    table = "\n".join(lines)
    data = {"sweep": "throughput", "nodes": args.nodes, "steps": args.steps, "warmup": args.warmup,
            "balance_rate_bps": balance, "goodput_bps": {_fmt_rate(k): v for k, v in goodput.items()},
            "calibration": {"compute_s_per_micro_batch": hw.compute_s, "opt_rate": hw.opt_rate, **factors},
            "collective_factors_by_rate": {_fmt_rate(r): f for r, f in factors_at.items()},
            "workload": work.__dict__, "model_mean_abs_error": mae, "load_end": load(), "points": points}
    base = _save(Path(args.out), "throughput", data, table)
    plot_throughput(data, base.with_suffix(".png"))
    return data


def plot_throughput(data: dict, path: Path) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    pts = data["points"]
    rates = sorted({p["rate_bps"] for p in pts if p["rate_bps"]})
    unshaped_x = (max(rates) * 3) if rates else 1e10
    x_of = lambda p: p["rate_bps"] or unshaped_x  # noqa: E731
    for s in dict.fromkeys(p["strategy"] for p in pts):
        mine = sorted((p for p in pts if p["strategy"] == s), key=x_of)
        line, = axes[0].plot([x_of(p) / 1e6 for p in mine], [p["tokens_per_s"] for p in mine], "o-", label=s)
        axes[0].plot([x_of(p) / 1e6 for p in mine], [p["predicted_tokens_per_s"] for p in mine], "--",
                     color=line.get_color(), alpha=0.5)
        axes[1].plot([x_of(p) / 1e6 for p in mine], [p["exposed_comm_s"] for p in mine], "o-", label=s)
    ticks = [*rates, unshaped_x]
    for ax in axes:
        ax.set_xscale("log")
        ax.axvline(data["balance_rate_bps"] / 1e6, color="grey", ls=":", label="ZeRO-1 comm ≈ compute")
        ax.set_xticks([t / 1e6 for t in ticks], [format_rate(t) for t in rates] + ["unshaped"], rotation=30,
                      fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("link rate per node and direction")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tokens/s (dashed: cost model)")
    axes[1].set_ylabel("exposed communication per update (s)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Emulated 2-node cluster, GPT-Neo tiny: throughput vs link rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# heterogeneous: one node slower ------------------------------------------------------------

_SPIN = "import time\nt=time.perf_counter(); n=0\nwhile time.perf_counter()-t<{s}: n+=1\nprint(n)"


def measure_cpu(plan: ClusterPlan, seconds: float = 3.0) -> list[float]:
    """Busy-loop iterations per second in every node at once (inside its CPU cgroup): the real slowdown."""
    rates = []
    with Cluster(plan) as cluster:
        logs = [Path(f"/tmp/tacc_spin_{os.getpid()}_{i}.txt") for i in range(plan.nodes)]
        procs = [cluster.launch(i, [sys.executable, "-c", _SPIN.format(s=seconds)], log=logs[i])
                 for i in range(plan.nodes)]
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
    plan_kw = dict(nodes=args.nodes, rate_bps=parse_rate(args.rate), slow_node=args.nodes - 1,
                   slow_factor=args.slow_factor, cpu_per_node=args.cpu_per_node)
    # The quota alone does not make the node exactly N× slower on a shared machine (the fast nodes may not
    # get their full quota): measure, and correct the slow node's quota until the measured ratio is right.
    for attempt in range(3):
        cpu = measure_cpu(ClusterPlan(**plan_kw), seconds=2.0)
        measured_factor = statistics.mean(cpu[:-1]) / cpu[-1]
        print(f"[heterogeneous] busy-loop rate per node {[f'{x:.3g}' for x in cpu]}: slow node "
              f"{measured_factor:.2f}× slower with a {plan_kw['slow_factor']:.2f}× smaller quota (load {load()})",
              flush=True)
        if abs(measured_factor / args.slow_factor - 1) < 0.1 or attempt == 2:
            break
        plan_kw["slow_factor"] = max(1.0, plan_kw["slow_factor"] * args.slow_factor / measured_factor)
    work = default_workload(micro_batches=2, local_batch=args.local_batch)
    factors = {}
    if plan_kw["rate_bps"] is not None:
        factors = collective_factors(ClusterPlan(**plan_kw), work, Path(args.out) / "runs" / "cluster" / "het_probe")
        print(f"[heterogeneous] gloo collectives over their ring ideal: reduce-scatter {factors['rs_factor']:.2f}×, "
              f"all-gather {factors['ag_factor']:.2f}×, all-reduce {factors['ar_factor']:.2f}×", flush=True)
    lb = args.local_batch
    gb = 2 * lb * args.nodes  # two micro-batches per rank and update (one per ACCO round)
    extra = [*DEFAULT_MODEL, *QUIET, "--eval.every", "0", "--training.steps", str(args.steps),
             "--training.local_batch_size", str(lb), "--training.global_batch_size", str(gb)]
    runs = Path(args.out) / "runs" / "cluster" / "heterogeneous"
    points, uniform = [], {}
    for s in strategies:
        print(f"[heterogeneous] {s} (load {load()})", flush=True)
        p = run_point(ClusterPlan(**plan_kw), s, extra, runs / s, args.warmup, args.timeout)
        points.append(p)
        print(f"  {p['tokens_per_s']:,.0f} tok/s, micro-batches per rank {p['micro_batches_per_rank']}", flush=True)
    if args.uniform_reference:
        for s in ("zero1", "acco_adaptive"):
            if s in strategies:
                print(f"[heterogeneous] reference without a slow node: {s}", flush=True)
                uniform[s] = run_point(ClusterPlan(**{**plan_kw, "slow_node": None, "slow_factor": 1.0}), s, extra,
                                       runs / f"{s}_uniform", args.warmup, args.timeout)
    data = {"sweep": "heterogeneous", **plan_kw, "target_slow_factor": args.slow_factor, "local_batch": lb,
            "global_batch": gb, "warmup": args.warmup, "cpu_rates": cpu, "measured_slow_factor": measured_factor,
            "collective_factors": factors, "steps": args.steps, "points": points, "uniform": uniform, "load_end": load()}
    return report_heterogeneous(data, Path(args.out))


def report_heterogeneous(data: dict, out: Path) -> dict:
    """Cost model, table and plot of a heterogeneous sweep (also re-run from its saved JSON)."""
    points, uniform, nodes = data["points"], data["uniform"], data["nodes"]
    measured_factor, factors = data["measured_slow_factor"], data["collective_factors"]
    work = default_workload(micro_batches=2, local_batch=data["local_batch"])
    zero1 = next((p for p in points if p["strategy"] == "zero1"), None)
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
        hw = cm.Hardware(nodes=nodes, flops=1.0, bandwidth_bps=data["rate_bps"],
                         compute_s=zero1["compute_s"] / work.micro_batches, slow_factor=measured_factor,
                         opt_rate=opt_rate * data["cpu_per_node"],
                         **{k: v for k, v in factors.items() if k.endswith("factor")})
        for p in points:
            pred = cm.predict(work, hw, p["strategy"])
            p["predicted_tokens_per_s"] = pred["tokens_per_s"]
            p["model_error"] = cm.relative_error(pred["tokens_per_s"], p["tokens_per_s"])
    lines = [f"{nodes} nodes × 1 CPU process, {data['cpu_per_node']:g} cores each, node {nodes - 1} at "
             f"{data['cpu_per_node'] / data['slow_factor']:.3g} cores (target {data['target_slow_factor']:g}× slower; "
             f"measured {measured_factor:.2f}× by a busy loop in every node at once), links "
             f"{_fmt_rate(data['rate_bps'])}, GPT-Neo tiny, micro-batch {data['local_batch']} × 256, global batch "
             f"{data['global_batch']}, {data['steps']} steps ({data['warmup']} dropped).", "",
             "| strategy | tokens/s | step (s) | exposed comm (s) | micro-batches per rank | tokens per update | "
             "vs ZeRO-1 | predicted tokens/s | model error | load |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for p in points:
        lines.append(f"| {p['strategy']} | {p['tokens_per_s']:,.0f} | {p['step_time_s']:.2f} | {p['exposed_comm_s']:.2f} | "
                     f"{p['micro_batches_per_rank'] or '-'} | {p['tokens_per_update']:,.0f} | {p['vs_zero1']:.2f}× | "
                     f"{p.get('predicted_tokens_per_s', math.nan):,.0f} | {p.get('model_error', math.nan):+.0%} | "
                     f"{p['load_before'][0]:.1f} |")
    for s, p in uniform.items():
        lines.append(f"| {s}, no slow node | {p['tokens_per_s']:,.0f} | {p['step_time_s']:.2f} | "
                     f"{p['exposed_comm_s']:.2f} | {p['micro_batches_per_rank'] or '-'} | {p['tokens_per_update']:,.0f} "
                     f"| | | | {p['load_before'][0]:.1f} |")
    best = max((p for p in points if p["strategy"].startswith("acco")), key=lambda p: p["vs_zero1"], default=None)
    if best and zero1:
        lines += ["", f"Target (ACCO ≥ 2.5× ZeRO-1 with the slow worker): {best['strategy']} {best['vs_zero1']:.2f}× → "
                      f"{'met' if best['vs_zero1'] >= 2.5 else 'missed'}."]
    if zero1:
        errs = [abs(p["model_error"]) for p in points]
        lines.append(f"Cost model: mean absolute error {statistics.mean(errs):.0%} over {len(errs)} strategies.")
    table = "\n".join(lines) + "\n"
    base = _save(out, "heterogeneous", data, table)
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [p["strategy"] for p in points]
        ax.bar(names, [p["tokens_per_s"] for p in points], color="tab:blue", label="measured")
        if all("predicted_tokens_per_s" in p for p in points):
            ax.scatter(names, [p["predicted_tokens_per_s"] for p in points], color="black", marker="_", s=400,
                       label="cost model", zorder=3)
        for s, p in uniform.items():
            ax.axhline(p["tokens_per_s"], ls=":", color="grey")
            ax.text(len(names) - 0.5, p["tokens_per_s"], f"{s}, no slow node", fontsize=7, ha="right", va="bottom")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{nodes} nodes, one {measured_factor:.1f}× slower (measured)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(base.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return data


# convergence ----------------------------------------------------------------------------------

def _curve(records: list[dict]) -> list[dict]:
    """(tokens, training wall-clock, val_loss) at each evaluation; wall-clock sums each step's time
    (evaluation excluded, as the trainer's throughput does)."""
    out, wall, prev = [], 0.0, 0
    for r in records:
        wall += (r["tokens"] - prev) / r["tokens_per_s"]
        prev = r["tokens"]
        if "val_loss" in r:
            out.append({"step": r["step"], "tokens": r["tokens"], "wall_s": wall, "val_loss": r["val_loss"]})
    return out


def convergence(args) -> dict:
    strategies = strategies_arg(args.strategies)
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = ClusterPlan(nodes=args.nodes, rate_bps=parse_rate(args.rate))
    extra = [*DEFAULT_MODEL, *QUIET, "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
             "--training.local_batch_size", "4", "--training.global_batch_size", str(8 * args.nodes),
             "--training.steps", str(args.steps), "--eval.every", str(args.eval_every), "--eval.batches",
             str(args.eval_batches), "--lr_schedule.warmup_steps", str(max(1, args.steps // 10))]
    runs = Path(args.out) / "runs" / "cluster" / "convergence"
    curves: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    walls: dict[str, list[float]] = {s: [] for s in strategies}
    loads = []
    for seed in seeds:
        for s in strategies:
            print(f"[convergence] {s} seed {seed} (load {load()})", flush=True)
            loads.append(load()[0])
            res = run_training(plan, [*extra, *STRATEGY_ARGS[s], "--training.seed", str(seed)], runs / f"{s}_s{seed}",
                               timeout_s=args.timeout)
            curve = _curve(res["records"])
            curves[s].append(curve)
            walls[s].append(curve[-1]["wall_s"])
            print(f"  final val loss {curve[-1]['val_loss']:.4f} at {curve[-1]['tokens']:,} tokens, "
                  f"{curve[-1]['wall_s']:.1f} s training", flush=True)
    summary = {}
    for s, cs in curves.items():
        n = min(len(c) for c in cs)
        pts = []
        for j in range(n):
            vals = [c[j]["val_loss"] for c in cs]
            pts.append({"step": cs[0][j]["step"], "tokens": cs[0][j]["tokens"],
                        "wall_s": statistics.mean(c[j]["wall_s"] for c in cs),
                        "val_loss": statistics.mean(vals), "val_loss_std": statistics.pstdev(vals) if len(vals) > 1 else 0.0})
        summary[s] = pts
    ref = "ddp" if "ddp" in summary else "zero1"
    lines = [f"{args.nodes} nodes, links {_fmt_rate(plan.rate_bps)}, GPT-Neo {args.flavor} on the embedded corpus, "
             f"seq {args.seq_len}, global batch {8 * args.nodes} × {args.seq_len}, {args.steps} steps, seeds "
             f"{args.seeds}; validation loss mean ± std over seeds (relative to {ref} at equal tokens).", "",
             "| tokens | " + " | ".join(summary) + " |", "|---:|" + "---:|" * len(summary)]
    for j, p in enumerate(summary[ref]):
        cells = []
        for s, pts in summary.items():
            q = pts[j]
            rel = q["val_loss"] / p["val_loss"] - 1
            cells.append(f"{q['val_loss']:.3f} ± {q['val_loss_std']:.3f} ({rel:+.1%})")
        lines.append(f"| {p['tokens']:,} | " + " | ".join(cells) + " |")
    lines.append("| training wall-clock (s) | " + " | ".join(f"{statistics.mean(w):.0f} ± {statistics.pstdev(w):.0f}"
                                                         for w in walls.values()) + " |")
    if "acco" in summary:
        final = summary["acco"][-1]["val_loss"] / summary[ref][-1]["val_loss"] - 1
        lines += ["", f"Target (ACCO's validation loss at equal tokens within 1% of {ref.upper()}): "
                      f"{final:+.2%} at the end → {'met' if abs(final) <= 0.01 else 'missed'}."]
        if "dpu" in summary and len(summary["dpu"]) > 1:
            early = summary["dpu"][0]["val_loss"] / summary[ref][0]["val_loss"] - 1
            lines.append(f"DPU at the first evaluation: {early:+.1%} vs {ref.upper()}.")
    table = "\n".join(lines) + "\n"
    data = {"sweep": "convergence", "nodes": args.nodes, "rate_bps": plan.rate_bps, "flavor": args.flavor,
            "steps": args.steps, "seeds": seeds, "summary": summary, "curves": curves, "wall_s": walls,
            "load_before_runs": loads, "load_end": load()}
    base = _save(Path(args.out), "convergence", data, table)
    plt = _pyplot()
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for s, pts in summary.items():
            mean = [p["val_loss"] for p in pts]
            std = [p["val_loss_std"] for p in pts]
            for ax, key in zip(axes, ("tokens", "wall_s")):
                xs = [p[key] for p in pts]
                ax.plot(xs, mean, "o-", ms=3, label=s)
                ax.fill_between(xs, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], alpha=0.2)
        axes[0].set_xlabel("tokens")
        axes[1].set_xlabel(f"training wall-clock (s), links {_fmt_rate(plan.rate_bps)}")
        axes[0].set_ylabel(f"validation loss (mean ± std, {len(seeds)} seeds)")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(base.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return data


# memory -----------------------------------------------------------------------------------------

def memory(args) -> dict:
    strategies = strategies_arg(args.strategies)
    plan = ClusterPlan(nodes=args.nodes, rate_bps=None)
    work = default_workload(local_batch=1)
    extra = [*DEFAULT_MODEL, *QUIET, "--eval.every", "0", "--training.steps", str(args.steps),
             "--training.mixed_precision", args.precision, "--training.local_batch_size", "1",
             "--training.global_batch_size", str(2 * args.nodes)]
    runs = Path(args.out) / "runs" / "cluster" / "memory"
    # glibc keeps freed memory cached per thread arena (ACCO's communication thread has its own), which
    # would make RSS measure the allocator; with a small mmap threshold every tensor buffer is returned on
    # free, so peak RSS follows the peak of live memory (persistent state + transients + the runtime).
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"} if args.malloc == "mmap" else {}
    points = []
    for s in strategies:
        print(f"[memory] {s} (load {load()})", flush=True)
        points.append(run_point(plan, s, extra, runs / s, 0, args.timeout, env=env))
        print(f"  peak RSS per rank {points[-1]['peak_rss_gib_per_rank']} GiB", flush=True)
    compute_bytes = 2 if args.precision == "bf16" else 4
    copy_mib = work.params * compute_bytes / 2**20
    bf16_mib = work.params * 2 / 2**20
    zero1 = next((p for p in points if p["strategy"] == "zero1"), None)
    lines = [f"{args.nodes} nodes, GPT-Neo tiny ({work.params / 1e6:.2f}M params), compute dtype {args.precision}, "
             f"micro-batch 1 × 256, {args.steps} steps. Peak resident memory (RSS) of each rank's process, which "
             f"includes the Python/torch runtime (~0.3 GiB)"
             f"{'; glibc set to return every buffer over 64 KiB on free (MALLOC_MMAP_THRESHOLD_=65536), so RSS follows live memory' if env else ''}. "
             f"Predicted: persistent state only (the job's transient buffers are not in it). "
             f"One parameter copy in the compute dtype = "
             f"{copy_mib:.1f} MiB; in bf16 = {bf16_mib:.1f} MiB.", "",
             "| strategy | peak RSS per rank (MiB) | mean (MiB) | over ZeRO-1 (MiB) | predicted over ZeRO-1 (MiB) | load |",
             "|---|---|---:|---:|---:|---|"]
    hw = cm.Hardware(nodes=args.nodes, flops=1.0, bandwidth_bps=None)
    for p in points:
        mibs = [x * 1024 for x in p["peak_rss_gib_per_rank"]]
        p["mean_rss_mib"] = statistics.mean(mibs) if mibs else math.nan
        p["over_zero1_mib"] = p["mean_rss_mib"] - statistics.mean(x * 1024 for x in zero1["peak_rss_gib_per_rank"]) \
            if zero1 else math.nan
        p["predicted_over_zero1_mib"] = (cm.memory_bytes(work, hw, p["strategy"], compute_bytes)
                                         - cm.memory_bytes(work, hw, "zero1", compute_bytes)) / 2**20
        lines.append(f"| {p['strategy']} | {', '.join(f'{m:.0f}' for m in mibs)} | {p['mean_rss_mib']:.0f} | "
                     f"{p['over_zero1_mib']:+.1f} | {p['predicted_over_zero1_mib']:+.1f} | {p['load_before'][0]:.1f} |")
    acco = next((p for p in points if p["strategy"] == "acco"), None)
    if acco and zero1:
        lines += ["", f"Target (ACCO's overhead over ZeRO-1 ≤ one bf16 parameter copy, {bf16_mib:.1f} MiB): measured "
                      f"{acco['over_zero1_mib']:+.1f} MiB → {'met' if acco['over_zero1_mib'] <= bf16_mib else 'missed'}."]
    table = "\n".join(lines) + "\n"
    data = {"sweep": "memory", "nodes": args.nodes, "precision": args.precision, "malloc_env": env,
            "param_copy_mib": copy_mib,
            "bf16_copy_mib": bf16_mib, "points": points, "load_end": load()}
    base = _save(Path(args.out), "memory", data, table)
    plt = _pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, args.nodes)
        for r in range(args.nodes):
            ax.bar([i + r * width for i in range(len(points))],
                   [p["peak_rss_gib_per_rank"][r] * 1024 if r < len(p["peak_rss_gib_per_rank"]) else 0 for p in points],
                   width, label=f"rank {r}")
        ax.set_xticks([i + width * (args.nodes - 1) / 2 for i in range(len(points))], [p["strategy"] for p in points])
        ax.set_ylabel("peak RSS (MiB)")
        lo = min(min(p["peak_rss_gib_per_rank"]) for p in points) * 1024
        ax.set_ylim(lo * 0.9, None)
        ax.set_title(f"Peak memory per rank, GPT-Neo tiny, {args.precision}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(base.with_suffix(".png"), dpi=110)
        plt.close(fig)
    return data


# predict ----------------------------------------------------------------------------------------

def predict_cmd(args) -> dict:
    dev = cm.DEVICES.get(args.device)
    if dev is None:
        raise UserError(f"unknown --device {args.device!r}; one of {', '.join(cm.DEVICES)} (or give --flops)")
    try:
        work = cm.model_workload(args.model, args.flavor, args.seq_len, args.local_batch, args.micro_batches,
                                 comm_bytes=args.comm_bytes)
    except ValueError as e:
        raise UserError(str(e)) from None
    flops = args.flops or dev["flops"] * args.mfu
    bw = parse_rate(args.bandwidth)
    hw = cm.Hardware(nodes=args.nodes, ranks_per_node=args.gpus_per_node, flops=flops, bandwidth_bps=bw,
                     latency_s=args.latency_ms / 1000, intra_bps=dev["intra_bps"], opt_rate=dev["opt_rate"],
                     slow_factor=args.slow_factor)
    preds = cm.predict_all(work, hw)
    mem = {s: cm.memory_bytes(work, hw, s) for s in preds}
    z, a, aa = preds["zero1"], preds["acco"], preds["acco_adaptive"]
    print(f"{args.model} {args.flavor}: {work.params / 1e9:.2f}B params, {work.flops_per_token / 1e9:.1f} GFLOP/token; "
          f"{args.nodes} nodes × {args.gpus_per_node} {args.device} at {flops / 1e12:.0f} TFLOP/s each; "
          f"inter-node {_fmt_rate(bw)}, {args.latency_ms:g} ms; micro-batch {args.local_batch} × {args.seq_len}, "
          f"{args.micro_batches} per rank and update; compute {z['compute_s']:.3f} s per micro-batch, "
          f"sharded job {z['job_s']:.3f} s\n")
    print(cm.format_table(preds, mem))
    best = max(("zero1", "acco", "acco_adaptive"), key=lambda s: preds[s]["tokens_per_s"])
    verdict = ("ACCO" if best != "zero1" and preds[best]["tokens_per_s"] > 1.02 * z["tokens_per_s"] else "ZeRO-1 (or either)")
    print(f"ZeRO-1 or ACCO? {verdict}: ACCO deterministic {a['tokens_per_s'] / z['tokens_per_s']:.2f}×, "
          f"adaptive {aa['tokens_per_s'] / z['tokens_per_s']:.2f}× ZeRO-1's tokens/s; ACCO costs "
          f"{(mem['acco'] - mem['zero1']) / 2**30:.1f} GiB more per GPU (one bf16 parameter copy).")
    print(f"Notes: adaptive ACCO's batch per update grows to {aa['tokens_per_update'] / z['tokens_per_update']:.2f}× "
          "ZeRO-1's (it keeps accumulating while the job runs); DPU and WP hide the job too but apply one-step-stale "
          "gradients (worse loss per token). Memory is persistent state only (weights, gradients, optimizer), no "
          "activations.")
    return {"workload": work.__dict__, "hardware": hw.__dict__, "predictions": preds}


# CLI ------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torchacco.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--precision", default="bf16", choices=("fp32", "bf16"),
                   help="compute dtype (the target is stated for bf16; fp32 runs ~3× faster on CPU)")
    p.add_argument("--malloc", default="mmap", choices=("mmap", "default"),
                   help="mmap: glibc returns freed tensor memory at once (RSS follows live memory)")
    p = sub.add_parser("all", help="throughput, heterogeneous, convergence and memory")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("predict", help="the cost model for a real cluster")
    p.add_argument("--model", default="llama3")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--bandwidth", default="100gbit", help="inter-node link per node and direction")
    p.add_argument("--latency-ms", type=float, default=0.01)
    p.add_argument("--device", default="H100", help=f"one of {', '.join(cm.DEVICES)}")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--flops", type=float, default=None, help="achieved FLOP/s per GPU (overrides device × MFU)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2, help="per GPU and update (ZeRO-1's accumulation)")
    p.add_argument("--comm-bytes", type=float, default=2.0, help="bytes per element on the wire (bf16: 2)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="one GPU this much slower")
    return parser


QUICK = {
    "throughput": dict(strategies="zero1,acco,acco_adaptive", steps=4, warmup=1, rates=""),
    "heterogeneous": dict(strategies="zero1,acco_adaptive", steps=3, warmup=1, nodes=2, cpu_per_node=0.9),
    "convergence": dict(strategies="zero1,acco", steps=10, seeds="0", eval_every=5, eval_batches=2),
    "memory": dict(strategies="zero1,acco", steps=2),
}
SWEEPS = {"throughput": throughput, "heterogeneous": heterogeneous, "convergence": convergence, "memory": memory}


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep == "predict":
        predict_cmd(args)
        return 0
    preflight(need_cgroup=args.sweep in ("heterogeneous", "all"))
    names = list(SWEEPS) if args.sweep == "all" else [args.sweep]
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
