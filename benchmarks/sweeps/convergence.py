"""Convergence: validation loss against tokens and wall-clock, over seeds."""

from __future__ import annotations

import statistics
from pathlib import Path

from benchmarks.cluster import ClusterPlan, parse_rate, run_training
from benchmarks.names import ACCO, DDP, DPU, ZERO1
from benchmarks.sweeps.common import (
    DEFAULT_MODEL,
    QUIET,
    load,
    pyplot_or_none,
    rate_label,
    save_figure,
    save_results,
    strategies_arg,
    strategy_variants,
)


def val_curve(records: list[dict]) -> list[dict]:
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
    extra = [
        *DEFAULT_MODEL,
        *QUIET,
        "--model.flavor",
        args.flavor,
        "--training.seq_len",
        str(args.seq_len),
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        str(8 * args.nodes),
        "--training.steps",
        str(args.steps),
        "--eval.every",
        str(args.eval_every),
        "--eval.batches",
        str(args.eval_batches),
        "--lr_schedule.warmup_steps",
        str(max(1, args.steps // 10)),
    ]
    runs = Path(args.out) / "runs" / "cluster" / "convergence"
    curves: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    walls: dict[str, list[float]] = {s: [] for s in strategies}
    loads = []
    for seed in seeds:
        for s in strategies:
            print(f"[convergence] {s} seed {seed} (load {load()})", flush=True)
            loads.append(load()[0])
            res = run_training(
                plan,
                [*extra, *strategy_variants()[s], "--training.seed", str(seed)],
                runs / f"{s}_s{seed}",
                timeout_s=args.timeout,
            )
            curve = val_curve(res["records"])
            curves[s].append(curve)
            walls[s].append(curve[-1]["wall_s"])
            print(
                f"  final val loss {curve[-1]['val_loss']:.4f} at {curve[-1]['tokens']:,} tokens, "
                f"{curve[-1]['wall_s']:.1f} s training",
                flush=True,
            )
    summary = {}
    for s, cs in curves.items():
        n = min(len(c) for c in cs)
        pts = []
        for j in range(n):
            vals = [c[j]["val_loss"] for c in cs]
            pts.append(
                {
                    "step": cs[0][j]["step"],
                    "tokens": cs[0][j]["tokens"],
                    "wall_s": statistics.mean(c[j]["wall_s"] for c in cs),
                    "val_loss": statistics.mean(vals),
                    "val_loss_std": statistics.pstdev(vals) if len(vals) > 1 else 0.0,
                }
            )
        summary[s] = pts
    ref = DDP if DDP in summary else ZERO1
    lines = [
        f"{args.nodes} nodes, links {rate_label(plan.rate_bps)}, GPT-Neo {args.flavor} on the embedded corpus, "
        f"seq {args.seq_len}, global batch {8 * args.nodes} × {args.seq_len}, {args.steps} steps, seeds "
        f"{args.seeds}; validation loss mean ± std over seeds (relative to {ref} at equal tokens).",
        "",
        "| tokens | " + " | ".join(summary) + " |",
        "|---:|" + "---:|" * len(summary),
    ]
    for j, p in enumerate(summary[ref]):
        cells = []
        for pts in summary.values():
            q = pts[j]
            rel = q["val_loss"] / p["val_loss"] - 1
            cells.append(f"{q['val_loss']:.3f} ± {q['val_loss_std']:.3f} ({rel:+.1%})")
        lines.append(f"| {p['tokens']:,} | " + " | ".join(cells) + " |")
    lines.append(
        "| training wall-clock (s) | "
        + " | ".join(f"{statistics.mean(w):.0f} ± {statistics.pstdev(w):.0f}" for w in walls.values())
        + " |"
    )
    if ACCO in summary:
        final = summary[ACCO][-1]["val_loss"] / summary[ref][-1]["val_loss"] - 1
        lines += [
            "",
            f"Target (ACCO's validation loss at equal tokens within 1% of {ref.upper()}): "
            f"{final:+.2%} at the end → {'met' if abs(final) <= 0.01 else 'missed'}.",
        ]
        if DPU in summary and len(summary[DPU]) > 1:
            early = summary[DPU][0]["val_loss"] / summary[ref][0]["val_loss"] - 1
            lines.append(f"DPU at the first evaluation: {early:+.1%} vs {ref.upper()}.")
    table = "\n".join(lines) + "\n"
    data = {
        "sweep": "convergence",
        "nodes": args.nodes,
        "rate_bps": plan.rate_bps,
        "flavor": args.flavor,
        "steps": args.steps,
        "seeds": seeds,
        "summary": summary,
        "curves": curves,
        "wall_s": walls,
        "load_before_runs": loads,
        "load_end": load(),
    }
    base = save_results(Path(args.out), "convergence", data, table)
    plt = pyplot_or_none()
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
        axes[1].set_xlabel(f"training wall-clock (s), links {rate_label(plan.rate_bps)}")
        axes[0].set_ylabel(f"validation loss (mean ± std, {len(seeds)} seeds)")
        for ax in axes:
            ax.grid(alpha=0.3)
        axes[0].legend()
        save_figure(fig, base)
    return data
