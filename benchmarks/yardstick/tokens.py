"""Token efficiency: validation loss at equal tokens against DDP, paired by seed (loopback, no root).

    .venv/bin/python -m benchmarks token-efficiency --updates 1000 --lrs 3e-3 --seeds 0,1,2,3,4 --variants ddp,acco

One gloo run at a time (2 ranks; RANKS names variants on more) on the yardstick's recipe (common.recipe); each variant's
final loss against DDP's with the same seed and lr; zero1 − ddp is the noise floor. --budgets: every variant but DDP
also runs those multiples of --updates and its tokens to DDP's final loss are interpolated between them; --levels: DDP
runs those multiples too, each a target. Runs are kept under <out>/<--runs>/ and reused when complete (--fresh reruns
them). Writes <out>/<--name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.common import ACCO, DDP, DPU, FSDP, QUIET, ROOT, WP, ZERO1, mean_ci, recipe, records


def _dp(name: str, more: str = "") -> list[str]:
    return ["--parallelism.data_parallel", name, *more.split()]


# Evaluation counts micro-batches, so micro-batches of 2 (1) evaluate 8 (16) to keep the recipe's validation sequences
LB2, LB1 = "--training.local_batch_size 2 --eval.batches 8", "--training.local_batch_size 1 --eval.batches 16"
DILOCO = "--parallelism.replicas 2 --diloco.sync_every"  # 2 replicas of one rank, an outer step every H updates
AVG = "--diloco.outer_lr 1 --diloco.outer_momentum 0"  # plain averaging
STREAMING_AVG = f"{DILOCO} 10 --diloco.fragments 2 --diloco.overlap_steps 1 --diloco.eager true {AVG}"
BF16 = f"{STREAMING_AVG} --diloco.outer_dtype bf16"  # Streaming DiLoCo in bf16 (streaming_h10_avg)
PIER = "--diloco.outer_lr 0.7 --diloco.outer_momentum 0.9 --diloco.outer_momentum_warmup 20"
SLOW99 = "--optimizer.slow_beta 0.99 --optimizer.slow_weight 0.5"
R4 = "--parallelism.replicas 4 --eval.batches 2"  # 4 replicas of one rank; 2 eval batches each read the same 32
WARM = "--diloco.warm_start 100"  # a warm start of 100 updates averaged in fp32 (post-local SGD)
MUON = "--optimizer.name muon"  # torch.optim.Muon for the hidden matrices, AdamW for the rest
SNOO = "--parallelism.replicas 1 --diloco.sync_every 10 --diloco.outer_lr 0.7 --diloco.outer_momentum 0.5"  # 1 replica


def _topk(k: float, code: str = "int2", mean: str = "replicas", more: str = "") -> list[str]:
    """Streaming DiLoCo sending a share `k` of each chunk of its pseudo-gradient in `code`, error-fed, each element
    averaged over all replicas or over the `senders` (SparseLoCo's mean: replicas)."""
    return _dp(DDP, f"{STREAMING_AVG} --diloco.outer_dtype {code} --diloco.topk {k} --diloco.topk_mean {mean} {more}")


VARIANTS = {
    DDP: _dp(DDP), ZERO1: _dp(ZERO1), FSDP: _dp(FSDP),  # FSDP: DDP's update with everything sharded, another floor
    # DDP in other floating-point orders (4 or 8 micro-batches per rank): the noise floor at acco_share's batches
    "ddp_lb2": _dp(DDP, LB2), "ddp_lb1": _dp(DDP, LB1), ACCO: _dp(ACCO),
    **{f"{v}_b8": _dp(v, "--training.global_batch_size 8") for v in (DDP, ZERO1)},  # 8 sequences an update, same tokens
    "acco_share75": _dp(ACCO, f"{LB2} --acco.estimate_share 0.75"),  # 3 of 4 micro-batches per rank at θ̃
    DPU: _dp(DPU), WP: _dp(WP),  # one-update-stale gradients
    "acco_clip_commit": _dp(ACCO, "--acco.estimate_clip commit"),  # the estimate clipped by the last commit's norm
    "acco_share875": _dp(ACCO, f"{LB1} --acco.estimate_share 0.875"),
    "acco_share75_clip_commit": _dp(ACCO, f"{LB2} --acco.estimate_share 0.75 --acco.estimate_clip commit"),
    **{f"diloco_h{h}": _dp(DDP, f"{DILOCO} {h}") for h in (10, 50, 100)},
    **{f"diloco_h{h}_avg": _dp(DDP, f"{DILOCO} {h} {AVG}") for h in (1, 10, 20, 50)},
    # Nesterov whose steady-state step is 1.4× the replicas' mean displacement (outer lr / (1 − momentum)), not 7×
    "diloco_h10_n07m05": _dp(DDP, f"{DILOCO} 10 --diloco.outer_lr 0.7 --diloco.outer_momentum 0.5"),
    # Streaming DiLoCo: 2 fragments, each all-reduced in bf16 beside 1 inner update; eager: the replica goes on from
    # its own θ and moves that update onto the mean when it arrives
    "streaming_h10_avg": _dp(DDP, BF16), "streaming_h10_avg_acco": _dp(ACCO, BF16),  # ACCO inside each replica
    "streaming_h50": _dp(DDP, f"{DILOCO} 50 --diloco.fragments 2 --diloco.overlap_steps 1 --diloco.outer_dtype bf16"),
    # the same sending 1% (3%, 10%; 1.5%: the largest 100× smaller than bf16 on the wire) in 2 (4) bits
    **{f"streaming_h10_avg_topk{round(k * 100)}_{code}": _topk(k, code) for k, code in ((0.01, "int2"), (0.03, "int2"),
                                                                                        (0.1, "int4"))},
    "streaming_h10_avg_topk1p5_int2": _topk(0.015),
    # the per-token ablation of the bf16 Streaming DiLoCo: after the warm start; with Nesterov (0.7, 0.9) whose
    # momentum warms up over a fragment's first 20 outer steps (Pier)
    "streaming_h10_avg_warm100": _dp(DDP, f"{BF16} {WARM}"),
    "streaming_h10_pier": _dp(DDP, f"{BF16} {PIER}"),
    "streaming_h10_pier_warm100": _dp(DDP, f"{BF16} {PIER} {WARM}"),  # both
    "streaming_h10_pier_decay": _dp(DDP, f"{BF16} {PIER} --diloco.outer_momentum_decay true"),  # μ follows the lr
    "streaming_h50_avg": _dp(DDP, BF16.replace(" 10 ", " 50 ")),  # the recommended Streaming DiLoCo at H 50
    "streaming_h10_avg_topk1_int2_decay1": _topk(0.01, more="--diloco.error_decay 1"),  # no decay of the residual
    # outer lr 2: of 2 replicas' top-k, an element only one sent moves θ_global by half its value at outer lr 1
    "streaming_h10_avg_topk1_int2_outer2": _topk(0.01, more="--diloco.outer_lr 2"),
    # each element averaged over the replicas that sent it, not over all of them
    **{f"streaming_h10_avg_topk{k}_int2_senders": _topk(k / 100, mean="senders") for k in (1, 3)},
    "streaming_h10_avg_topk1_int2_warm100": _topk(0.01, more=WARM),
    # 3% over the senders (docs/diloco.md's recommendation) with the bf16 wire's per-token techniques; 10% in 4 bits
    "streaming_h10_avg_topk3_int2_senders_warm100": _topk(0.03, mean="senders", more=WARM),
    # at 8 sequences an update: the same first 10% of the tokens
    "streaming_h10_avg_topk3_int2_senders_warm200": _topk(0.03, mean="senders", more=WARM.replace("100", "200")),
    "streaming_h10_pier_topk3_int2_senders": _topk(0.03, mean="senders", more=PIER),
    "streaming_h10_pier_warm100_topk3_int2_senders": _topk(0.03, mean="senders", more=f"{PIER} {WARM}"),
    "streaming_h10_avg_topk10_int4_senders": _topk(0.1, "int4", "senders"),
    "streaming_h50_avg_topk3_int2_senders": _topk(0.03, mean="senders", more="--diloco.sync_every 50"),  # at H 50
    # QSR: H grows as (peak lr / lr)² up to a cap: 10 to 40, and 6 to 24 (more often early, less late: H 10's bytes)
    "streaming_h10_avg_qsr40": _dp(DDP, f"{BF16} --diloco.sync_every_max 40"),
    "streaming_h6_avg_qsr24": _dp(DDP, f"{BF16.replace(' 10 ', ' 6 ')} --diloco.sync_every_max 24"),
    # slow momentum (MT-DAO): a second first moment of β 0.99 takes half of AdamW's direction; ddp_slow99 its baseline
    "ddp_slow99": _dp(DDP, SLOW99),
    "streaming_h10_avg_slow99": _dp(DDP, f"{BF16} {SLOW99}"),
    # 4 replicas of one rank (4 sequences each); alone, and with the warm start and the warmed-up Nesterov
    "streaming_h10_avg_r4": _dp(DDP, f"{BF16} {R4}"),
    "streaming_h10_pier_warm100_r4": _dp(DDP, f"{BF16} {PIER} {WARM} {R4}"),
    **{f"streaming_h10_avg_topk3_int2{tag}_r4": _topk(0.03, mean=mean, more=f"{more} {R4}") for tag, mean, more in (
        ("", "replicas", ""), ("_senders", "senders", ""), ("_senders_warm100", "senders", WARM),
        ("_senders_muon", "senders", MUON), ("_senders_warm100_muon", "senders", f"{WARM} {MUON}"))},  # Muon inside
    **{f"{v}_muon": _dp(v, MUON) for v in (DDP, ZERO1, ACCO)},  # Muon inside; zero1_muon − ddp_muon: its noise floor
    "snoo_h10": _dp(DDP, SNOO), "snoo_h10_muon": _dp(DDP, f"{SNOO} {MUON}"),
    "streaming_h10_avg_topk3_int2_senders_muon": _topk(0.03, mean="senders", more=MUON),
    "streaming_h10_avg_muon": _dp(DDP, f"{BF16} {MUON}"),  # uncompressed (bf16): what the compression costs Muon
}  # fmt: skip
RANKS = {name: 4 for name in VARIANTS if name.endswith("_r4")}  # a variant's ranks where not 2
CPU_FLAVORS = ("debug", "tiny", "36M")  # GPT-Neo flavors 1,000 updates of which fit a 2-core machine


def train(
    variant: str, lr: float, seed: int, updates: int, folder: Path, fresh: bool, flavor: str, extra=(), batch: int = 16
):
    """One run's records (kept ones when complete); `extra`: a tuning grid point's overrides after the variant's;
    `batch`: the global batch, in sequences, that runs the tokens of `updates` updates of 16."""
    done = records(folder)
    if done and not fresh and done[-1].get("step") == -(-updates * 16 // batch) and "val_loss" in done[-1]:
        return done
    args = [*recipe(updates, lr, seed, flavor=flavor, batch=batch), *QUIET, *VARIANTS[variant], *extra]
    args += ["--training.num_threads", "1", "--job.dump_folder", str(folder), "--job.overwrite", "true"]
    started, log = time.perf_counter(), folder.parent / f"{folder.name}.log"  # (with_suffix cuts at the lr's dot)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        env = {**os.environ, "NPROC": str(RANKS.get(variant, 2))}
        proc = subprocess.run(["./run_train.sh", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode:
        sys.exit(f"token-efficiency: {variant} lr {lr:g} seed {seed} failed; see {log}")
    done = records(folder)
    print(f"[token-efficiency] {variant} lr {lr:g} seed {seed}: val {done[-1]['val_loss']:.4f} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)  # fmt: skip
    return done


def tuning_grid(
    variant: str, lr: float, lr_multiples: list[float], outer: list[str], clips: list[str], batches: list[int] = ()
) -> list:
    """(label, lr, extra overrides, global batch) per grid point: each lr multiple, clipping norm and batch; a DiLoCo
    variant's also each outer step ("LR:MOMENTUM")."""
    diloco = "--parallelism.replicas" in VARIANTS[variant]
    points = []
    outer, clips = (outer or [None]) if diloco else [None], clips or [None]
    for m, o, c, b in itertools.product(lr_multiples, outer, clips, batches or [variant_batch(variant)]):
        label, extra = f"lr×{m:g}", []
        if o is not None:
            olr, momentum = o.split(":")
            label += f" outer {olr}:{momentum}"
            extra += ["--diloco.outer_lr", olr, "--diloco.outer_momentum", momentum]
        if c is not None:
            label += f" clip {c}"
            extra += ["--training.max_norm", c]
        points.append((label + (f" batch {b}" if batches else ""), lr * m, tuple(extra), b))
    return points


def tune(variant: str, lr: float, seeds: list[int], args, runs: Path, prefix: str) -> dict:
    """The grid point of `variant` with the lowest mean final validation loss over the tuning `seeds`."""
    scores = []
    grid = tuning_grid(variant, lr, args.tune_lrs, args.tune_outer, args.tune_clip, args.tune_batch)
    for label, point_lr, extra, batch in grid:
        tag = "".join(f"_{x}" for x in extra[1::2]) + batch_tag(variant, batch)  # the grid point's values
        finals = [
            train(variant, point_lr, seed, args.updates, runs / f"{prefix}tune_u{args.updates}_lr{point_lr:g}_{variant}"
                  f"{tag}_s{seed}", args.fresh, args.flavor, extra, batch)[-1]["val_loss"]
            for seed in seeds
        ]  # fmt: skip
        scores.append({"label": label, "lr": point_lr, "extra": list(extra), "batch": batch,
                       "mean_val_loss": statistics.fmean(finals), "val_loss": finals})  # fmt: skip
    best = min(scores, key=lambda s: s["mean_val_loss"])
    return {**best, "grid": scores}


def variant_flag(variant: str, flag: str, default: int) -> int:
    args = VARIANTS[variant]
    return int(args[args.index(flag) + 1]) if flag in args else default


def variant_batch(variant: str) -> int:
    """The global batch a variant sets (the recipe's 16 where it sets none): its warm-up and evaluations follow."""
    return variant_flag(variant, "--training.global_batch_size", 16)


def batch_unit(variant: str) -> int:
    """The sequences a variant's global batch must be a multiple of: its ranks × its micro-batch."""
    return RANKS.get(variant, 2) * variant_flag(variant, "--training.local_batch_size", 4)


def batch_tag(variant: str, batch: int) -> str:
    """A run folder's mark of a tuned batch other than the variant's own (whose runs keep their names)."""
    return "" if batch == variant_batch(variant) else f"_b{batch}"


def sets_already(variant: str, extra) -> bool:
    """Whether `variant` itself makes every override of `extra` (flag, value pairs): the same runs as without it."""
    made = set(zip(VARIANTS[variant], VARIANTS[variant][1:]))
    return all(pair in made for pair in zip(extra[::2], extra[1::2]))


def updates_to_target(target: float, finals: dict[int, float]) -> tuple[float | None, bool]:
    """(updates to `target`, is_upper_bound) from final losses at several budgets (updates -> loss): linear between
    the first two that bracket it; the smallest budget and True if it reaches it; (None, False) if none does."""
    points = sorted(finals.items())
    if points[0][1] <= target:
        return float(points[0][0]), True
    for (n0, l0), (n1, l1) in zip(points, points[1:]):
        if l1 <= target < l0:
            return n0 + (n1 - n0) * (l0 - target) / (l0 - l1), False
    return None, False


def budget_multiples(parser: argparse.ArgumentParser, text: str, flag="--budgets", of="--updates") -> list[float]:
    """--budgets (or --levels, --tune-lrs): comma-separated positive multiples of `of`, or one line."""
    try:
        multiples = [float(x) for x in text.split(",")]
    except ValueError:
        parser.error(f"{flag} takes comma-separated multiples of {of} (e.g. 1,1.25,1.5), got {text!r}")
    if not all(math.isfinite(m) and m > 0 for m in multiples):
        parser.error(f"{flag} must be positive multiples of {of}, got {text!r}")
    return multiples


def budget_rows(by_budget: dict, ddp_finals: list[float], updates: int) -> dict:
    """Per seed: the updates this variant needs for DDP's final loss of the same seed, as a share of DDP's."""
    found = [updates_to_target(t, {n: vals[i] for n, vals in by_budget.items()}) for i, t in enumerate(ddp_finals)]
    ratios = [None if needed is None else needed / updates for needed, _ in found]
    reached = [r for r in ratios if r is not None]
    every = len(reached) == len(ratios)
    return {"budgets": {str(n): vals for n, vals in sorted(by_budget.items())}, "tokens_to_target_ratio": ratios,
            "ratio_is_upper_bound": [bound for _, bound in found],
            "mean_tokens_to_target_ratio": statistics.fmean(reached) if every else None,
            "sd_tokens_to_target_ratio": statistics.stdev(reached) if every and len(reached) > 1 else None}  # fmt: skip


def level_rows(by_budget: dict, ddp_by_budget: dict[int, list[float]], levels: list[int]) -> dict:
    """Per target level (DDP's budget): budget_rows against DDP's losses there, the mean target and the ratio's 95%
    interval (where every seed reached it)."""
    out = {}
    for n in levels:
        row = budget_rows(by_budget, ddp_by_budget[n], n)
        reached = row["tokens_to_target_ratio"]
        half = mean_ci(reached)[1] if all(r is not None for r in reached) else None
        out[str(n)] = row | {"target": statistics.fmean(ddp_by_budget[n]), "ci95_tokens_to_target_ratio": half}
    return out


def summarize(runs: dict[tuple[float, str], list[list[dict]]]) -> dict:
    """Per lr and variant, from each seed's records of the base run: final val losses and along the run (mean, sd
    over seeds), and the paired gaps to DDP (%) with mean, sd and 95% interval."""
    curves = {key: [[r["val_loss"] for r in recs if "val_loss" in r] for recs in seeds] for key, seeds in runs.items()}
    out = {}
    for (lr, v), seeds in runs.items():
        finals, cols, last = [c[-1] for c in curves[(lr, v)]], list(zip(*curves[(lr, v)])), seeds[0][-1]
        along = {"tokens": [r["tokens"] for r in seeds[0] if "val_loss" in r],
                 "tokens_per_update": last["tokens"] / last["step"], "mean": [statistics.fmean(c) for c in cols],
                 "sd": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in cols]}  # fmt: skip
        row = out.setdefault(f"{lr:g}", {})[v] = {"val_loss": finals, "mean_val_loss": statistics.fmean(finals),
                                                  "val_loss_along_run": along}  # fmt: skip
        if v == DDP:
            continue
        gaps = [100.0 * (x / y - 1.0) for x, y in zip(finals, out[f"{lr:g}"][DDP]["val_loss"])]  # % over DDP's
        row |= {"gap_pct": gaps, "mean_gap_pct": statistics.fmean(gaps), "ci95_gap_pct": mean_ci(gaps)[1],
                "sd_gap_pct": statistics.stdev(gaps) if len(gaps) > 1 else float("nan")}  # fmt: skip
    return out


def noise_floors(summary: dict) -> list[str]:
    """ZeRO-1 against DDP with the same optimizer other than AdamW (ddp_muon): the same mathematics (the table has
    zero1 against ddp)."""
    lines = []
    for lr, rows in summary.items():
        for z, d in ((v, DDP + v.removeprefix(ZERO1)) for v in rows if v.startswith(ZERO1)):
            if d in rows and d != DDP:
                gaps = [100 * (a / b - 1) for a, b in zip(rows[z]["val_loss"], rows[d]["val_loss"], strict=True)]
                mean, half = mean_ci(gaps)
                lines += ["", f"Noise floor at lr {lr}: {z} against {d}, {mean:+.3f} ± {half:.3f}% (95% interval); per "
                          f"seed {', '.join(f'{g:+.3f}' for g in gaps)}."]  # fmt: skip
    return lines


def markdown(summary: dict, meta: dict) -> str:
    lines = ["# Token efficiency: validation loss at equal tokens vs DDP, paired by seed", "",
             f"{meta['date']}, {meta['machine']}; {meta.get('model', 'GPT-Neo debug')}, {meta['updates']} updates, "
             f"seeds {meta['seeds']}.", f"Command: `{meta['command']}`", "",
             "| lr | variant | mean val loss | gap vs ddp, mean ± sd (%) | 95% interval of the mean (%) "
             "| per seed (%) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for lr, rows in summary.items():
        for v, r in rows.items():
            if v == DDP:
                lines.append(f"| {lr} | ddp | {r['mean_val_loss']:.4f} | | | |")
                continue
            m, half = r["mean_gap_pct"], r["ci95_gap_pct"]
            interval = "" if math.isnan(half) else f"{m - half:+.2f} to {m + half:+.2f}"
            lines.append(f"| {lr} | {v} | {r['mean_val_loss']:.4f} | {m:+.2f} ± {r['sd_gap_pct']:.2f} | {interval} | "
                         f"{', '.join(f'{x:+.2f}' for x in r['gap_pct'])} |")  # fmt: skip
    lines += noise_floors(summary)
    if meta.get("tuned"):
        lines += ["", "## Tuned settings", "",
                  f"Each variant (DDP too) ran its grid on seeds {meta['tune_seeds']}, kept apart from the reported "
                  "ones, and is reported at its point of lowest mean final validation loss there.", "",
                  "| lr | variant | chosen | mean val loss on the tuning seeds | grid (mean val loss) |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for lr, rows in meta["tuned"].items():
            for v, t in rows.items():
                grid = "; ".join(f"{g['label']}: {g['mean_val_loss']:.4f}" for g in t["grid"])
                chosen = f"{t['label']} | {t['mean_val_loss']:.4f} | {grid}"
                if v == ZERO1 and t is rows.get(DDP):
                    chosen = "DDP's (the noise floor: the same mathematics at the same settings) | |"
                lines.append(f"| {lr} | {v} | {chosen} |")
    budgeted = [(lr, v, row) for lr, rows in summary.items() for v, row in rows.items() if "budgets" in row]
    if budgeted:
        lines += ["", "## Tokens to DDP's final loss", "",
                  f"Each variant also ran budgets of {', '.join(map(str, meta['budgets']))} updates, each with its own "
                  "cosine; the updates it needs for the final validation loss of DDP's run with the same seed are "
                  "interpolated between the two budgets that bracket it, as a multiple of DDP's (≤: the smallest "
                  "budget already reaches it; —: no budget does).", "",
                  "| lr | variant | tokens to target × DDP's, mean ± sd | per seed |", "|---|---|---|---|"]  # fmt: skip
        for lr, v, row in budgeted:
            each = ", ".join("—" if r is None else ("≤" if b else "") + f"{r:.3f}"
                             for r, b in zip(row["tokens_to_target_ratio"], row["ratio_is_upper_bound"]))  # fmt: skip
            mean = row["mean_tokens_to_target_ratio"]
            spread = "—" if mean is None else f"{mean:.3f} ± {row['sd_tokens_to_target_ratio'] or 0:.3f}"
            lines.append(f"| {lr} | {v} | {spread} | {each} |")
    leveled = [(lr, v, row) for lr, v, row in budgeted if len(row.get("levels", {})) > 1]
    if leveled:
        levels = list(leveled[0][2]["levels"])
        lines += ["", "## Tokens to several loss levels", "",
                  "Each level is the final validation loss of DDP's run of that many updates (its own cosine; same "
                  "seed); a variant's tokens to it, as a multiple of that run's, mean and 95% interval over the seeds "
                  "(≤: a bound; —: a seed not reached within the budgets).", "",
                  "| lr | variant | " + " | ".join(f"DDP's loss at {n} updates" for n in levels) + " |",
                  "|---|---|" + "---:|" * len(levels)]  # fmt: skip
        for lr, v, row in leveled:
            cells = [(f"{'≤' if any(x['ratio_is_upper_bound']) else ''}{x['mean_tokens_to_target_ratio']:.3f} ± "
                      f"{x['ci95_tokens_to_target_ratio']:.3f} (target {x['target']:.4f})")
                     if x["ci95_tokens_to_target_ratio"] is not None else "—"
                     for x in (row["levels"][n] for n in levels)]  # fmt: skip
            lines.append(f"| {lr} | {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, out: Path) -> None:
    """Per lr: the validation loss against tokens (mean ± sd over the seeds; each budget's final losses as points)."""
    drawn = common.panels(len(summary))
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (lr, rows) in zip(axes, summary.items()):
        for v, row in rows.items():
            along = row["val_loss_along_run"]
            (line,) = ax.plot(along["tokens"], along["mean"], label=v)
            low, high = zip(*((m - d, m + d) for m, d in zip(along["mean"], along["sd"])))
            ax.fill_between(along["tokens"], low, high, color=line.get_color(), alpha=0.2)
            for n, vals in (row.get("budgets") or row.get("levels_val_loss") or {}).items():
                ax.errorbar(int(n) * common.TOKENS_PER_UPDATE, statistics.fmean(vals), fmt="o", ms=3,
                            yerr=statistics.stdev(vals) if len(vals) > 1 else 0.0, color=line.get_color())  # fmt: skip
        start = len(along["tokens"]) * 2 // 5  # the last 60% of the run, where the gaps are small against the loss
        bottoms = [min(r["val_loss_along_run"]["mean"]) for r in rows.values()]
        bottoms += [min(vals) for r in rows.values() for vals in (r.get("budgets") or {}).values()]
        ax.set_ylim(min(bottoms) - 0.1, max(r["val_loss_along_run"]["mean"][start] for r in rows.values()) + 0.05)
        ax.set(title=f"lr {lr}: loss against tokens (mean ± sd over seeds)", xlabel="tokens", ylabel="validation loss")
        ax.legend(fontsize=7)
    common.save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    tune_seeds, budgets, levels, lrs, seeds, variants = _checked(parser, args)
    out = ROOT / args.out
    prefix = "" if args.flavor == "debug" else f"{args.flavor}_"  # the debug model's runs and results keep their names
    name = args.name or f"{prefix}token_efficiency"
    runs, by_budget, tuned = {}, {}, {}  # (lr, variant) -> each seed's records of the base run; -> {budget: finals}
    for lr in lrs:
        for v in variants:  # DDP first: the others are paired with it
            point = {"lr": lr, "extra": [], "batch": variant_batch(v)}
            if tune_seeds and v == ZERO1 and DDP in tuned.get(f"{lr:g}", {}):  # the noise floor: DDP's mathematics
                point = tuned[f"{lr:g}"][v] = tuned[f"{lr:g}"][DDP]  # at DDP's settings, so not tuned apart
            elif tune_seeds:
                point = tuned.setdefault(f"{lr:g}", {})[v] = tune(v, lr, tune_seeds, args, out / args.runs, prefix)
            untuned = point["lr"] == lr and sets_already(v, point["extra"])  # the runs without tuning: their folders
            tag = "" if untuned else f"_at{point['lr']:g}" + "".join(f"_{x}" for x in point["extra"][1::2])
            tag += batch_tag(v, point["batch"])
            for seed in seeds:  # one run at a time: the machine's two cores are the two ranks
                for n in budgets if v != DDP else levels:
                    folder = out / args.runs / f"{prefix}u{n}_lr{lr:g}_{v}{tag}_s{seed}"
                    records_ = train(
                        v, point["lr"], seed, n, folder, args.fresh, args.flavor, tuple(point["extra"]), point["batch"]
                    )
                    by_budget.setdefault((lr, v), {}).setdefault(n, []).append(records_[-1]["val_loss"])
                base = out / args.runs / f"{prefix}u{args.updates}_lr{lr:g}_{v}{tag}_s{seed}"
                runs.setdefault((lr, v), []).append(records(base))
    summary = summarize(runs)
    for lr in lrs if len(budgets) > 1 else ():
        rows = summary[f"{lr:g}"]
        for v in variants[1:]:
            rows[v] |= budget_rows(by_budget[(lr, v)], rows[DDP]["val_loss"], args.updates)
            if len(levels) > 1:
                rows[v]["levels"] = level_rows(by_budget[(lr, v)], by_budget[(lr, DDP)], levels)
        if len(levels) > 1:
            rows[DDP]["levels_val_loss"] = {str(n): by_budget[(lr, DDP)][n] for n in levels}
    tuning = {"tune_seeds": tune_seeds, "tuned": tuned} if tune_seeds else {}
    meta = common.meta("token-efficiency", argv, updates=args.updates, model=f"GPT-Neo {args.flavor}", seeds=seeds,
                       budgets=budgets, levels=levels, **tuning)  # fmt: skip
    data = {"meta": meta, "summary": summary}
    common.write_report(out, name, data, markdown(summary, meta), lambda path: plot(summary, path))


def _parser():
    name_help = "the results' file name (token_efficiency; <flavor>_token_efficiency)"
    parser = common.parser("token-efficiency", __doc__, None, help=name_help)
    parser.add_argument("--updates", type=int, default=1000)
    parser.add_argument("--lrs", default="3e-3", help="comma-separated peak learning rates")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--variants", default="ddp,zero1,acco", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results exist")
    parser.add_argument("--runs", default="token_efficiency_runs", help="the folder under --out that keeps the runs")
    parser.add_argument("--flavor", default="debug", choices=CPU_FLAVORS, help="the GPT-Neo flavor trained")
    parser.add_argument("--budgets", default="1", help="multiples of --updates every variant but ddp also runs")
    parser.add_argument("--levels", default="1", help="multiples of --updates ddp runs: each final loss a target")
    parser.add_argument("--tune-seeds", default="", help="tune every variant (DDP too) on these seeds first, kept "
                        "apart from --seeds, and report each at its best grid point")  # fmt: skip
    parser.add_argument("--tune-lrs", default="0.5,1,2", help="the tuning grid: multiples of each --lrs")
    parser.add_argument("--tune-outer", default="1:0,0.7:0.9", help="DiLoCo variants' tuning grid: outer lr:momentum")
    parser.add_argument("--tune-clip", default="", help="every variant's tuning grid: --training.max_norm values")
    parser.add_argument("--tune-batch", default="", help="every variant's tuning grid: global batches in sequences "
                        "(multiples of 8; 16 is the recipe's), each run for the same tokens")  # fmt: skip
    return parser


def _checked(parser, args):
    """The arguments checked and parsed: (tune seeds, budgets, levels, lrs, seeds, variants); --tune-* in place."""
    tune_seeds = [int(x) for x in args.tune_seeds.split(",") if x]
    args.tune_lrs = budget_multiples(parser, args.tune_lrs, "--tune-lrs", "--lrs")
    args.tune_outer = [x for x in args.tune_outer.split(",") if x]
    args.tune_clip = [x for x in args.tune_clip.split(",") if x]
    if not re.fullmatch(r"([0-9]+(,[0-9]+)*)?", args.tune_batch) or any(
        int(b) < 8 or int(b) % 8 or 16 * args.updates % int(b) for b in args.tune_batch.split(",") if b
    ):
        parser.error(
            f"--tune-batch takes multiples of 8 that divide 16 × --updates (e.g. 8,16), got {args.tune_batch!r}"
        )
    args.tune_batch = [int(b) for b in args.tune_batch.split(",") if b]
    if any(x.count(":") != 1 for x in args.tune_outer):
        parser.error(f"--tune-outer takes comma-separated LR:MOMENTUM pairs (e.g. 1:0,0.7:0.9), got {args.tune_outer}")
    numbers = [x for pair in args.tune_outer for x in pair.split(":")] + args.tune_clip
    if not all(re.fullmatch(r"[0-9]*\.?[0-9]+(e-?[0-9]+)?", x) for x in numbers):
        parser.error(f"--tune-outer and --tune-clip take non-negative numbers (e.g. 1:0 and 1,2), got {numbers}")
    scaled = lambda text, flag: sorted({round(args.updates * m) for m in budget_multiples(parser, text, flag)}
                                       | {args.updates})  # fmt: skip
    budgets, levels = scaled(args.budgets, "--budgets"), scaled(args.levels, "--levels")
    if len(levels) > 1 and len(budgets) == 1:
        parser.error("--levels needs --budgets: a variant's tokens to each level are interpolated between its budgets "
                     "(e.g. --budgets 0.75,1,1.25 --levels 0.75,1)")  # fmt: skip
    lrs, seeds = [float(x) for x in args.lrs.split(",")], [int(x) for x in args.seeds.split(",")]
    if set(tune_seeds) & set(seeds):
        parser.error(f"--tune-seeds and --seeds share {sorted(set(tune_seeds) & set(seeds))}: keep them apart")
    variants = [DDP, *(v for v in args.variants.split(",") if v != DDP)]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.tune_batch and any(variant_batch(v) != 16 for v in variants):
        parser.error("--tune-batch tunes the recipe's batch: leave out the variants that set their own (_b8)")
    split = next(((v, b) for v in variants for b in args.tune_batch if b % batch_unit(v)), None)
    if split:
        parser.error(f"--tune-batch {split[1]}: {split[0]} splits its batch into micro-batches over its ranks in "
                     f"multiples of {batch_unit(split[0])} sequences; give batches that are")  # fmt: skip
    return tune_seeds, budgets, levels, lrs, seeds, variants
