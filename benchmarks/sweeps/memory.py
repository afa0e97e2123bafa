"""Memory: peak resident memory per rank per strategy."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks.cluster import ClusterPlan
from benchmarks.names import ACCO, ZERO1
from benchmarks.sweeps.common import (
    DEFAULT_MODEL,
    QUIET,
    default_workload,
    load,
    pyplot_or_none,
    run_point,
    save_figure,
    save_results,
    strategies_arg,
)
from torchacco import cost_model as cm

MMAP_NOTE = (
    "; glibc set to return every buffer over 64 KiB on free (MALLOC_MMAP_THRESHOLD_=65536), so RSS follows live memory"
)


def memory(args) -> dict:
    strategies = strategies_arg(args.strategies)
    plan = ClusterPlan(nodes=args.nodes, rate_bps=None)
    work = default_workload(local_batch=1)
    extra = [
        *DEFAULT_MODEL,
        *QUIET,
        "--eval.every",
        "0",
        "--training.steps",
        str(args.steps),
        "--training.mixed_precision",
        args.precision,
        "--training.local_batch_size",
        "1",
        "--training.global_batch_size",
        str(2 * args.nodes),
        # the compute dtype's copy over ZeRO-1 (the default fp32 reduce makes ACCO's buffer fp32: 2 bytes more)
        "--parallelism.reduce_dtype",
        "bf16",
    ]
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
    zero1 = next((p for p in points if p["strategy"] == ZERO1), None)
    lines = [
        f"{args.nodes} nodes, GPT-Neo tiny ({work.params / 1e6:.2f}M params), compute dtype {args.precision}, "
        f"micro-batch 1 × 256, {args.steps} steps. Peak resident memory (RSS) of each rank's process, which "
        f"includes the Python/torch runtime (~0.3 GiB)"
        f"{MMAP_NOTE if env else ''}. "
        f"Predicted: persistent state only (the job's transient buffers are not in it). "
        f"One parameter copy in the compute dtype = "
        f"{copy_mib:.1f} MiB; in bf16 = {bf16_mib:.1f} MiB.",
        "",
        "| strategy | peak RSS per rank (MiB) | mean (MiB) | over ZeRO-1 (MiB) | predicted over ZeRO-1 (MiB) | load |",
        "|---|---|---:|---:|---:|---|",
    ]
    hw = cm.Hardware(nodes=args.nodes, flops=1.0, bandwidth_bps=None)
    for p in points:
        mibs = [x * 1024 for x in p["peak_rss_gib_per_rank"]]
        p["mean_rss_mib"] = statistics.mean(mibs) if mibs else math.nan
        p["over_zero1_mib"] = (
            p["mean_rss_mib"] - statistics.mean(x * 1024 for x in zero1["peak_rss_gib_per_rank"]) if zero1 else math.nan
        )
        p["predicted_over_zero1_mib"] = (
            cm.memory_bytes(work, hw, p["strategy"], compute_bytes) - cm.memory_bytes(work, hw, ZERO1, compute_bytes)
        ) / 2**20
        lines.append(
            f"| {p['strategy']} | {', '.join(f'{m:.0f}' for m in mibs)} | {p['mean_rss_mib']:.0f} | "
            f"{p['over_zero1_mib']:+.1f} | {p['predicted_over_zero1_mib']:+.1f} | {p['load_before'][0]:.1f} |"
        )
    acco = next((p for p in points if p["strategy"] == ACCO), None)
    if acco and zero1:
        lines += [
            "",
            f"Target (ACCO's overhead over ZeRO-1 ≤ one bf16 parameter copy, {bf16_mib:.1f} MiB): measured "
            f"{acco['over_zero1_mib']:+.1f} MiB → {'met' if acco['over_zero1_mib'] <= bf16_mib else 'missed'}.",
        ]
    table = "\n".join(lines) + "\n"
    data = {
        "sweep": "memory",
        "nodes": args.nodes,
        "precision": args.precision,
        "malloc_env": env,
        "param_copy_mib": copy_mib,
        "bf16_copy_mib": bf16_mib,
        "points": points,
        "load_end": load(),
    }
    base = save_results(Path(args.out), "memory", data, table)
    plt = pyplot_or_none()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / max(1, args.nodes)
        for r in range(args.nodes):
            ax.bar(
                [i + r * width for i in range(len(points))],
                [p["peak_rss_gib_per_rank"][r] * 1024 if r < len(p["peak_rss_gib_per_rank"]) else 0 for p in points],
                width,
                label=f"rank {r}",
            )
        ax.set_xticks([i + width * (args.nodes - 1) / 2 for i in range(len(points))], [p["strategy"] for p in points])
        ax.set_ylabel("peak RSS (MiB)")
        lo = min(min(p["peak_rss_gib_per_rank"]) for p in points) * 1024
        ax.set_ylim(lo * 0.9, None)
        ax.set_title(f"Peak memory per rank, GPT-Neo tiny, {args.precision}")
        ax.legend(fontsize=8)
        save_figure(fig, base)
    return data
