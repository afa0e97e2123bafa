"""Token efficiency: validation loss at equal tokens, ACCO (and variants) against DDP, paired by seed.

    .venv/bin/python -m benchmarks token-efficiency --updates 1000 --lrs 1.5e-3,3e-3,6e-3 --seeds 0,1,2,3,4 \\
        --variants ddp,zero1,acco,acco_w05

One 2-rank gloo training run at a time (run_train.sh, NPROC=2, one thread per rank) on the time-to-target
recipe: GPT-Neo debug, 1k BPE vocabulary, seq 128, 16 sequences per update, AdamW β 0.9/0.95, wd 0.1, clipping
1.0, 5% warm-up then cosine, evaluation on 4 batches per rank every tenth of the run. For every (lr, variant, seed)
the final validation loss, and its gap to DDP's with the same seed and lr (the seeds fix initialisation and data
order, so the pairing removes most of the seed-to-seed spread). The spread of zero1 − ddp (the same mathematics in
another floating-point order) is the noise floor a variant is judged against.

With --budgets (e.g. 1,1.25,1.5), every variant but DDP also runs those multiples of --updates, each with its own
cosine, and the tokens it needs for DDP's final loss (same seed) are interpolated between the finished runs that
bracket it: the token side of time to target (benchmarks/time_to_target.py multiplies it by measured speed). With
--levels (e.g. 0.75,1), DDP runs those multiples too, each with its own cosine, and each of its final losses is a
target: the tokens ratio at several loss levels, each against the DDP run that reached that loss at its budget's end.

Writes bench_results/<--name>.{json,md} (+ .png with matplotlib; name token_efficiency by default). Runs are kept
under bench_results/<--runs, token_efficiency_runs>/u<updates>_lr<lr>_<variant>_s<seed>/ (prefixed with the flavor
but for debug) and reused when their metrics.jsonl is complete (--fresh reruns them). A change to the code can change
a run's floating-point order: a new --runs folder pairs runs of the same code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.acco_reference import recipe
from benchmarks.names import ACCO, DDP, DPU, FSDP, WP, ZERO1
from benchmarks.stats import mean_ci
from benchmarks.sweeps.common import panels, save_figure, write_report

ROOT = Path(__file__).resolve().parents[1]
# Micro-batches of 2 sequences. Evaluation counts micro-batches, so twice as many keep the validation sequences the
# recipe's (4 batches of 4 per rank): with 4 of 2, DDP's validation loss read 1.4% lower on the same θ trajectory.
LB2 = ["--training.local_batch_size", "2", "--eval.batches", "8"]
LB1 = ["--training.local_batch_size", "1", "--eval.batches", "16"]
DILOCO = ["--parallelism.data_parallel", DDP, "--parallelism.replicas", "2"]
VARIANTS = {
    DDP: ["--parallelism.data_parallel", DDP],
    ZERO1: ["--parallelism.data_parallel", ZERO1],
    FSDP: ["--parallelism.data_parallel", FSDP],  # DDP's update with everything sharded: another floor
    # DDP in another floating-point order (4 micro-batches of 2): the mathematics of DDP, a measure of the noise
    # floor, and the baseline with acco_share75's micro-batches
    "ddp_lb2": ["--parallelism.data_parallel", DDP, *LB2],
    "ddp_lb1": ["--parallelism.data_parallel", DDP, *LB1],  # the same, with acco_share875's micro-batches of 1
    ACCO: ["--parallelism.data_parallel", ACCO],
    # the estimate steps with ½ g̃ + ½ m̂: the noise-optimal blend of the half batch and the first moment
    "acco_w05": ["--parallelism.data_parallel", ACCO, "--acco.estimate_grad_weight", "0.5"],
    # 3 of the 4 micro-batches per rank at θ̃, 1 at θ (local batch 2): the estimate error's feedback as weak as DDP's
    "acco_share75": ["--parallelism.data_parallel", ACCO, *LB2, "--acco.estimate_share", "0.75"],
    # one-update-stale gradients: their token side replaces the cost model's assumed penalty
    DPU: ["--parallelism.data_parallel", DPU],
    WP: ["--parallelism.data_parallel", WP],
    # the estimate clipped by the last commit's norm, not by its own half batch's (larger: twice the noise)
    "acco_clip_commit": ["--parallelism.data_parallel", ACCO, "--acco.estimate_clip", "commit"],
    # 7 of the 8 micro-batches per rank at θ̃ (local batch 1): less of the estimate's noise in its error
    "acco_share875": ["--parallelism.data_parallel", ACCO, *LB1, "--acco.estimate_share", "0.875"],
    "acco_share75_clip_commit": [
        "--parallelism.data_parallel",
        ACCO,
        *LB2,
        "--acco.estimate_share",
        "0.75",
        "--acco.estimate_clip",
        "commit",
    ],
    # the commit counts each token computed at θ̃ 1.86 times: 65% of its weight on the half at θ̃ (a weaker feedback of
    # the estimate's error, in the linear model with noise of benchmarks/acco_stability.py, in git history)
    "acco_tw65": ["--parallelism.data_parallel", ACCO, "--acco.estimate_token_weight", "1.857"],
    "acco_w0": ["--parallelism.data_parallel", ACCO, "--acco.estimate_grad_weight", "0"],
    "acco_damped05": ["--parallelism.data_parallel", ACCO, "--acco.estimate_damping", "0.5"],
    # DiLoCo (docs/diloco.md): 2 replicas of one rank each, half the global batch per replica, an outer step every H
    **{f"diloco_h{h}": [*DILOCO, "--diloco.sync_every", str(h)] for h in (10, 50, 100)},
    # plain averaging every 50 updates (outer lr 1, no momentum): Nesterov's 0.7 and 0.9 step up to 7 times the
    # replicas' mean displacement once the momentum builds, which is DiLoCo's tuning for H in the hundreds
    "diloco_h50_avg": [*DILOCO, *"--diloco.sync_every 50 --diloco.outer_lr 1 --diloco.outer_momentum 0".split()],
    # plain averaging every 1, 10 and 20 updates: the gap as a function of H (at H = 1 the replicas never drift
    # apart, so what remains is the inner optimizer's, each replica's AdamW and clipping on half the batch)
    **{
        f"diloco_h{h}_avg": [
            *DILOCO,
            "--diloco.sync_every",
            str(h),
            *"--diloco.outer_lr 1 --diloco.outer_momentum 0".split(),
        ]
        for h in (1, 10, 20)
    },
    # Nesterov whose steady-state step is 1.4× the replicas' mean displacement (outer lr / (1 − momentum)), not 7×
    "diloco_h10_n07m05": [*DILOCO, *"--diloco.sync_every 10 --diloco.outer_lr 0.7 --diloco.outer_momentum 0.5".split()],
    # Streaming DiLoCo with plain averaging every 10 updates: each of the 2 fragments all-reduced in bf16 beside 1
    # inner update, eager (the replica goes on from its own θ and moves that update onto the mean when it arrives)
    "streaming_h10_avg": [
        *DILOCO,
        *"--diloco.sync_every 10 --diloco.fragments 2 --diloco.overlap_steps 1 --diloco.eager true".split(),
        *"--diloco.outer_lr 1 --diloco.outer_momentum 0 --diloco.outer_dtype bf16".split(),
    ],
    # Streaming DiLoCo: the 2 blocks as 2 fragments, each all-reduced in bf16 beside 1 inner update
    "streaming_h50": [
        *DILOCO,
        *"--diloco.sync_every 50 --diloco.fragments 2 --diloco.overlap_steps 1".split(),
        "--diloco.outer_dtype",
        "bf16",
    ],
}
CPU_FLAVORS = ("debug", "tiny", "36M")  # GPT-Neo flavors 1,000 updates of which fit a 2-core machine
QUIET = ["--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
         "--checkpoint.enable", "false", "--checkpoint.export_hf", "false", "--acco.drift_every", "1"]  # fmt: skip


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    return f"{os.cpu_count()}-core {model}, CPU, {platform.system()}"


def records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train(variant: str, lr: float, seed: int, updates: int, folder: Path, fresh: bool, flavor: str) -> list[dict]:
    done = records(folder)
    if done and not fresh and done[-1].get("step") == updates and "val_loss" in done[-1]:
        return done
    args = [*recipe(updates, lr, seed, flavor=flavor), *QUIET, *VARIANTS[variant], "--training.num_threads", "1"]
    args += ["--job.dump_folder", str(folder), "--job.overwrite", "true"]
    started = time.perf_counter()
    log = folder.parent / f"{folder.name}.log"  # (with_suffix would cut the name at the lr's dot)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run(["./run_train.sh", *args], cwd=ROOT, env={**os.environ, "NPROC": "2"}, stdout=out,
                              stderr=subprocess.STDOUT)  # fmt: skip
    if proc.returncode:
        sys.exit(f"token-efficiency: {variant} lr {lr:g} seed {seed} failed; see {log}")
    print(f"[token-efficiency] {variant} lr {lr:g} seed {seed}: val {records(folder)[-1]['val_loss']:.4f} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return records(folder)


def gap(a: float, b: float) -> float:
    return 100.0 * (a / b - 1.0)


def updates_to_target(target: float, finals: dict[int, float]) -> tuple[float | None, bool]:
    """The updates a variant needs to reach `target`, from its final validation losses at several budgets
    (updates -> loss, each run with its own cosine): linear between the two budgets whose runs bracket the target,
    not read from the middle of a curve. Returns (updates, is_upper_bound): the smallest budget and True when it
    already reaches the target, (None, False) when no budget does."""
    points = sorted(finals.items())
    if points[0][1] <= target:
        return float(points[0][0]), True
    for (n0, l0), (n1, l1) in zip(points, points[1:]):
        if l1 <= target < l0:
            return n0 + (n1 - n0) * (l0 - target) / (l0 - l1), False
    return None, False


def budget_multiples(parser: argparse.ArgumentParser, text: str, flag: str = "--budgets") -> list[float]:
    """--budgets (or --levels): comma-separated positive multiples of the base run's updates (one line for anything
    else)."""
    try:
        multiples = [float(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated multiples of --updates (e.g. 1,1.25,1.5), got {text!r}")
    if not all(math.isfinite(m) and m > 0 for m in multiples):
        parser.error(f"{flag} must be positive multiples of --updates, got {text!r}")
    return multiples


def budget_rows(by_budget: dict, ddp_finals: list[float], updates: int) -> dict:
    """Per seed: the updates this variant needs for DDP's final loss of the same seed (DDP's run of `updates`), as a
    share of DDP's."""
    ratios, bounds = [], []
    for seed_index, target in enumerate(ddp_finals):
        needed, bound = updates_to_target(target, {n: vals[seed_index] for n, vals in by_budget.items()})
        ratios.append(None if needed is None else needed / updates)
        bounds.append(bound)
    reached = [r for r in ratios if r is not None]
    return {
        "budgets": {str(n): vals for n, vals in sorted(by_budget.items())},
        "tokens_to_target_ratio": ratios,
        "ratio_is_upper_bound": bounds,
        "mean_tokens_to_target_ratio": statistics.fmean(reached) if len(reached) == len(ratios) else None,
        "sd_tokens_to_target_ratio": statistics.stdev(reached) if len(reached) == len(ratios) > 1 else None,
    }


def level_rows(by_budget: dict, ddp_by_budget: dict[int, list[float]], levels: list[int]) -> dict:
    """Per target level (DDP's budget, in updates): budget_rows against DDP's final losses at that budget, with the
    mean target and the mean ratio's 95% interval where every seed reached it."""
    out = {}
    for n in levels:
        row = budget_rows(by_budget, ddp_by_budget[n], n)
        reached = row["tokens_to_target_ratio"]
        half = mean_ci(reached)[1] if all(r is not None for r in reached) else None
        row |= {"target": statistics.fmean(ddp_by_budget[n]), "ci95_tokens_to_target_ratio": half}
        out[str(n)] = row
    return out


def along_run(curves: list[list[float]], tokens: list[int], per_update: float) -> dict:
    """The validation loss at each evaluation of the base budget's runs: its tokens, and the mean and standard
    deviation over the seeds (the band of the loss-against-tokens plot)."""
    columns = list(zip(*curves))
    return {"tokens": tokens, "tokens_per_update": per_update, "mean": [statistics.fmean(c) for c in columns],
            "sd": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns]}  # fmt: skip


def summarize(
    finals: dict, curves: dict, train_tails: dict, lrs: list[float], variants: list[str], eval_tokens: dict
) -> dict:  # fmt: skip
    """Per lr and variant: final val losses by seed, the paired gaps to DDP (%), their mean and spread, the val
    loss along the run with its spread over the seeds, the mean paired gap along the run (at each evaluation), and
    the paired gaps of the last tenth's training loss."""
    out = {}
    for lr in lrs:
        ddp = finals[(lr, DDP)]
        rows = {}
        for v in variants:
            vals = finals[(lr, v)]
            row = {"val_loss": vals, "mean_val_loss": statistics.fmean(vals),
                   "val_loss_along_run": along_run(curves[(lr, v)], *eval_tokens[(lr, v)])}  # fmt: skip
            if v != DDP:
                gaps = [gap(x, y) for x, y in zip(vals, ddp)]
                row |= {"gap_pct": gaps, "mean_gap_pct": statistics.fmean(gaps)}
                row["sd_gap_pct"] = statistics.stdev(gaps) if len(gaps) > 1 else float("nan")
                row["ci95_gap_pct"] = mean_ci(gaps)[1]  # the half-width of the mean's 95% t-interval
                along = [[gap(x, y) for x, y in zip(c, d)] for c, d in zip(curves[(lr, v)], curves[(lr, DDP)])]
                row["mean_gap_along_run_pct"] = [statistics.fmean(col) for col in zip(*along)]
                train = [gap(x, y) for x, y in zip(train_tails[(lr, v)], train_tails[(lr, DDP)])]
                row |= {"train_gap_pct": train, "mean_train_gap_pct": statistics.fmean(train)}
            rows[v] = row
        out[f"{lr:g}"] = rows
    return out


def interval(row: dict) -> str:
    """The mean gap's 95% interval, as low to high (empty for one seed)."""
    half = row["ci95_gap_pct"]
    if math.isnan(half):
        return ""
    return f"{row['mean_gap_pct'] - half:+.2f} to {row['mean_gap_pct'] + half:+.2f}"


def markdown(summary: dict, meta: dict) -> str:
    lines = [
        "# Token efficiency: validation loss at equal tokens vs DDP, paired by seed",
        "",
        f"{meta['date']}, {meta['machine']}; {meta.get('model', 'GPT-Neo debug')}, {meta['updates']} updates, "
        f"seeds {meta['seeds']}.",
        f"Command: `{meta['command']}`",
        "",
        "| lr | variant | mean val loss | gap vs ddp, mean ± sd (%) | 95% interval of the mean (%) | per seed (%) "
        "| gap along the run (%) | training-loss gap, last tenth: mean, per seed (%) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lr, rows in summary.items():
        for v, row in rows.items():
            if v == DDP:
                lines.append(f"| {lr} | ddp | {row['mean_val_loss']:.4f} | | | | | |")
                continue
            per_seed = ", ".join(f"{g:+.2f}" for g in row["gap_pct"])
            along = " ".join(f"{g:+.1f}" for g in row["mean_gap_along_run_pct"])
            lines.append(
                f"| {lr} | {v} | {row['mean_val_loss']:.4f} | {row['mean_gap_pct']:+.2f} ± {row['sd_gap_pct']:.2f} "
                f"| {interval(row)} | {per_seed} | {along} | {row['mean_train_gap_pct']:+.2f}: "
                + ", ".join(f"{g:+.2f}" for g in row["train_gap_pct"])
                + " |"
            )
    budgeted = [(lr, v, row) for lr, rows in summary.items() for v, row in rows.items() if "budgets" in row]
    if budgeted:
        lines += [
            "",
            "## Tokens to DDP's final loss",
            "",
            f"Each variant also ran budgets of {', '.join(map(str, meta['budgets']))} updates, each with its own "
            "cosine; "
            "the updates it needs for the final validation loss of DDP's run with the same seed are interpolated "
            "between the two budgets that bracket it, as a multiple of DDP's (≤: the smallest budget already "
            "reaches it; —: no budget does).",
            "",
            "| lr | variant | tokens to target × DDP's, mean ± sd | per seed |",
            "|---|---|---|---|",
        ]
        for lr, v, row in budgeted:
            each = ", ".join(
                "—" if r is None else ("≤" if b else "") + f"{r:.3f}"
                for r, b in zip(row["tokens_to_target_ratio"], row["ratio_is_upper_bound"])
            )
            mean = row["mean_tokens_to_target_ratio"]
            spread = "—" if mean is None else f"{mean:.3f} ± {row['sd_tokens_to_target_ratio'] or 0:.3f}"
            lines.append(f"| {lr} | {v} | {spread} | {each} |")
    leveled = [(lr, v, row) for lr, v, row in budgeted if len(row.get("levels", {})) > 1]
    if leveled:
        levels = list(leveled[0][2]["levels"])
        lines += [
            "",
            "## Tokens to several loss levels",
            "",
            "Each level is the final validation loss of DDP's run of that many updates (its own cosine; same seed); "
            "a variant's tokens to it, as a multiple of that run's, mean and 95% interval over the seeds ("
            "≤: a bound; —: a seed not reached within the budgets).",
            "",
            "| lr | variant | " + " | ".join(f"DDP's loss at {n} updates" for n in levels) + " |",
            "|---|---|" + "---:|" * len(levels),
        ]
        for lr, v, row in leveled:
            cells = []
            for n in levels:
                level = row["levels"][n]
                if level["ci95_tokens_to_target_ratio"] is None:
                    cells.append("—")
                    continue
                bound = "≤" if any(level["ratio_is_upper_bound"]) else ""
                cells.append(f"{bound}{level['mean_tokens_to_target_ratio']:.3f} ± "
                             f"{level['ci95_tokens_to_target_ratio']:.3f} (target {level['target']:.4f})")  # fmt: skip
            lines.append(f"| {lr} | {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> None:
    """Per lr: the validation loss against tokens, mean over the seeds with a ±1 sd band, the finished runs of
    every budget as points (the ones the tokens to target are interpolated between); then the paired gap to DDP
    along the run."""
    drawn = panels(2 * len(summary))
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (lr, rows) in zip(axes[::2], summary.items()):
        for v, row in rows.items():
            along = row["val_loss_along_run"]
            low = [m - d for m, d in zip(along["mean"], along["sd"])]
            high = [m + d for m, d in zip(along["mean"], along["sd"])]
            (line,) = ax.plot(along["tokens"], along["mean"], label=v)
            ax.fill_between(along["tokens"], low, high, color=line.get_color(), alpha=0.2)
            per_update = along["tokens_per_update"]
            finals = row.get("budgets") or row.get("levels_val_loss") or {}
            for n, vals in finals.items():
                spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
                ax.errorbar(int(n) * per_update, statistics.fmean(vals), yerr=spread, fmt="o", ms=3,
                            color=line.get_color())  # fmt: skip
        # the last 60% of the run, where the strategies' gaps are small against the loss itself
        start = len(along["tokens"]) * 2 // 5
        tops = [r["val_loss_along_run"]["mean"][start] for r in rows.values()]
        bottoms = [min(r["val_loss_along_run"]["mean"]) for r in rows.values()]
        bottoms += [min(vals) for r in rows.values() for vals in (r.get("budgets") or {}).values()]
        ax.set_ylim(min(bottoms) - 0.1, max(tops) + 0.05)
        ax.set(title=f"lr {lr}: loss against tokens (mean ± sd over seeds)", xlabel="tokens",
               ylabel="validation loss")  # fmt: skip
        ax.legend(fontsize=7)
    for ax, (lr, rows) in zip(axes[1::2], summary.items()):
        for v, row in rows.items():
            if v != DDP:
                curve = row["mean_gap_along_run_pct"]
                ax.plot([(i + 1) / len(curve) for i in range(len(curve))], curve, marker="o", label=v)
        ax.axhline(0, color="grey", lw=0.5)
        ax.set(
            title=f"lr {lr}: paired gap to DDP along the run",
            xlabel="share of the run",
            ylabel="val loss gap vs ddp (%)",
        )
        if ax.get_legend_handles_labels()[0]:  # (an lr sweep of DDP alone has no gap to draw)
            ax.legend(fontsize=7)
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks token-efficiency", description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--lrs", default="3e-3", help="comma-separated peak learning rates")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--variants", default="ddp,zero1,acco,acco_w05", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", help="the results' file name, without suffix (token_efficiency; for another flavor "
                        "<flavor>_token_efficiency)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results exist")
    parser.add_argument("--runs", default="token_efficiency_runs",
                        help="the folder under --out that keeps the runs (a new one pairs today's only)")  # fmt: skip
    parser.add_argument("--flavor", default="debug", choices=CPU_FLAVORS,
                        help="the GPT-Neo flavor trained: debug (the sweep's model), or a larger one to check a "
                        "finding on")  # fmt: skip
    parser.add_argument(
        "--budgets",
        default="1",
        help="comma-separated multiples of --updates that every variant but ddp also runs, each with its own "
        "cosine; the updates it needs for DDP's final loss are interpolated between them (e.g. 1,1.25,1.5)",
    )
    parser.add_argument(
        "--levels",
        default="1",
        help="comma-separated multiples of --updates that DDP runs, each with its own cosine; its final loss at each "
        "is a target, and each variant's tokens to it are interpolated between its --budgets (e.g. 0.75,1)",
    )
    args = parser.parse_args(argv)
    multiples = budget_multiples(parser, args.budgets)
    budgets = sorted({round(args.updates * m) for m in multiples} | {args.updates})
    levels = sorted({round(args.updates * m) for m in budget_multiples(parser, args.levels, "--levels")}
                    | {args.updates})  # fmt: skip
    if len(levels) > 1 and len(budgets) == 1:
        parser.error("--levels needs --budgets: a variant's tokens to each level are interpolated between its budgets "
                     "(e.g. --budgets 0.75,1,1.25 --levels 0.75,1)")  # fmt: skip
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    variants = [DDP, *(v for v in args.variants.split(",") if v != DDP)]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    out = ROOT / args.out
    name = args.name or ("token_efficiency" if args.flavor == "debug" else f"{args.flavor}_token_efficiency")
    prefix = "" if args.flavor == "debug" else f"{args.flavor}_"  # the debug model's runs keep their names
    finals, curves, train_tails, by_budget, eval_tokens = {}, {}, {}, {}, {}
    for lr in lrs:
        for v in variants:
            for seed in seeds:  # one run at a time: the machine's two cores are the two ranks
                for n in budgets if v != DDP else levels:
                    folder = out / args.runs / f"{prefix}u{n}_lr{lr:g}_{v}_s{seed}"
                    final = train(v, lr, seed, n, folder, args.fresh, args.flavor)[-1]["val_loss"]
                    by_budget.setdefault((lr, v), {}).setdefault(n, []).append(final)
                folder = out / args.runs / f"{prefix}u{args.updates}_lr{lr:g}_{v}_s{seed}"
                recs = records(folder)
                finals.setdefault((lr, v), []).append(recs[-1]["val_loss"])
                # The training loss of the last tenth of the run: each update's on data not seen before, and
                # the same sequences whatever the micro-batch size.
                last = recs[-max(1, len(recs) // 10) :]
                train_tails.setdefault((lr, v), []).append(statistics.fmean(r["loss"] for r in last))
                curves.setdefault((lr, v), []).append([r["val_loss"] for r in recs if "val_loss" in r])
                per_update = recs[-1]["tokens"] / recs[-1]["step"]  # (the same for every seed)
                eval_tokens[(lr, v)] = [r["tokens"] for r in recs if "val_loss" in r], per_update
    summary = summarize(finals, curves, train_tails, lrs, variants, eval_tokens)
    if len(budgets) > 1:
        for lr in lrs:
            for v in variants[1:]:
                summary[f"{lr:g}"][v] |= budget_rows(by_budget[(lr, v)], finals[(lr, DDP)], args.updates)
                if len(levels) > 1:
                    summary[f"{lr:g}"][v]["levels"] = level_rows(by_budget[(lr, v)], by_budget[(lr, DDP)], levels)
            if len(levels) > 1:
                summary[f"{lr:g}"][DDP]["levels_val_loss"] = {str(n): by_budget[(lr, DDP)][n] for n in levels}
    meta = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "updates": args.updates,
        "model": f"GPT-Neo {args.flavor}",
        "seeds": seeds,
        "budgets": budgets,
        "levels": levels,
        "command": "python -m benchmarks token-efficiency " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "summary": summary}
    write_report(out, name, data, markdown(summary, meta), lambda path: plot(summary, path))


if __name__ == "__main__":  # the old form: one line naming `python -m benchmarks <command>`
    from benchmarks.cli import moved

    raise SystemExit(moved(__spec__.name))
