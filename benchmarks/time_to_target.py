"""Time to target, the yardstick: the tokens a strategy needs for DDP's loss (loopback) times its measured time per
token (the emulated cluster), against the best synchronous baseline, per setting and loss level; and (--validate)
whole runs on the cluster against that product.

    sudo .venv/bin/python -m benchmarks time-to-target [--quick] [--resume] [--variants acco,streaming_h10_avg] \\
        [--settings a,b] [--strategies ddp,zero1,acco,streaming_h10_avg] [--validate a:acco]
    .venv/bin/python -m benchmarks time-to-target-table --tokens diloco_budgets_lr3e-3 --speed speed_streaming \\
        --same-update zero1=ddp   # the product alone, from saved token and speed results

1. Tokens (`benchmarks/token_efficiency.py`, loopback, 2 ranks): DDP at --levels, every variant at --budgets, each
   run with its own cosine; each DDP final loss is a target, and a variant's tokens to it are interpolated between
   its finished runs (loss against tokens does not depend on the link).
2. Speed (`benchmarks/speed.py`, the cluster): seconds per update of --strategies after warm-up, --repeats each
   (speed does not depend on the loss).
3. Their product (`main`, the time-to-target-table command): per setting, level and seed, how many times sooner than
   the best synchronous baseline each strategy reaches the target. DDP needs 1× its tokens by definition. A baseline
   that computes DDP's update (zero1, fsdp, hsdp, balanced or not) takes DDP's tokens; a balanced strategy its
   unbalanced self's (--same-update); a strategy whose token side is not in the table is shown with its speed only.
4. --validate setting:strategy,...: whole runs to DDP's loss on the cluster (`benchmarks/end_to_end.py`).

The settings' link rates follow this machine's compute (<out>/<name>_calibration.json, measured first). Without
--resume every run is done again; with it, the calibration and finished runs with the same arguments are kept, so a
call with more seeds, variants or strategies runs only what it adds. Writes <out>/<name>_{tokens,speed,end_to_end}.* and
<out>/<name>.{json,md,png}. Needs root and a quiet machine for the speed and validation parts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks import end_to_end, speed, token_efficiency
from benchmarks.acco_reference import recipe
from benchmarks.cluster import ClusterPlan, run_training
from benchmarks.names import ACCO, DDP, FSDP, HSDP, ZERO1
from benchmarks.speed import BASELINES
from benchmarks.stats import mean_ci
from benchmarks.sweeps.common import QUIET, panels, save_figure, write_report
from benchmarks.token_efficiency import machine
from torchacco import cost_model as cm
from torchacco.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def token_ratios(rows: dict) -> tuple[dict[str, list[float]], set[str]]:
    """Per variant, the per-seed tokens to DDP's final loss as a multiple of DDP's (DDP itself: 1), and the
    variants some of whose seeds reached the target at the smallest budget already (their ratio is a bound)."""
    out, bounds = {}, set()
    for name, row in rows.items():
        ratios = row.get("tokens_to_target_ratio")
        if name == DDP:
            out[name] = [1.0] * len(row["val_loss"])
        elif ratios and all(r is not None for r in ratios):
            out[name] = ratios
            if any(row.get("ratio_is_upper_bound", [])):
                bounds.add(name)
    return out, bounds


def at_levels(rows: dict) -> dict[str, dict]:
    """The token table's rows at each of its target levels (DDP's budgets, with --levels), keyed by DDP's updates;
    a variant measured without levels is left out of them. One level (the table's own rows) when it has none."""
    levels = next((list(row["levels"]) for row in rows.values() if "levels" in row), None)
    if not levels:
        return {}
    measured = {name: row for name, row in rows.items() if name == DDP or "levels" in row}
    return {n: {name: row if name == DDP else row["levels"][n] for name, row in measured.items()} for n in levels}


def combine(settings: dict, ratios: dict[str, list[float]]) -> dict:
    """Per setting and strategy: seconds per update's tokens, the tokens ratio, and how many times sooner than the
    best synchronous baseline it reaches the target, paired by seed (each seed's ratio over the mean speed)."""
    out = {}
    for setting, data in settings.items():
        speed = {name: row["mean"] for name, row in data["strategies"].items()}
        baselines = [n for n in speed if n.removesuffix("_balanced") in BASELINES and n in ratios]
        if not baselines:
            continue
        cost = {n: [r * speed[n] for r in ratios[n]] for n in speed if n in ratios}  # seconds per DDP's tokens
        best = min(baselines, key=lambda n: statistics.fmean(cost[n]))
        unpaired = [n for n in speed if n.removesuffix("_balanced") in BASELINES and n not in ratios]
        faster = [n for n in unpaired if speed[n] < speed[best]]  # a faster baseline whose tokens are not known
        rows = {}
        for name, s in speed.items():
            row = {"seconds_per_update": s, "speed_vs_best": speed[best] / s}
            if name in cost:
                sooner = [b / c for b, c in zip(cost[best], cost[name])]
                mean, half = mean_ci(sooner)
                ratio, ratio_half = mean_ci(ratios[name])
                row |= {"tokens_ratio": ratio, "tokens_ratio_ci95": ratio_half, "sooner_per_seed": sooner,
                        "sooner": mean, "sooner_ci95": half}  # fmt: skip
            rows[name] = row
        out[setting] = {"plan": data["plan"], "best_baseline": best, "strategies": rows, "faster_unpaired": faster}
    return out


def markdown(result: dict, meta: dict) -> str:
    lines = [
        "# Time to DDP's final loss: tokens needed (loopback) × time per token (emulated cluster)",
        "",
        f"{meta['date']}, {meta['machine']}. Tokens: `{meta.get('out', 'bench_results')}/{meta['tokens']}.md` (lr "
        f"{meta['lr']}); speed: `{meta.get('out', 'bench_results')}/{meta['speed']}.md`.",
        f"Command: `{meta['command']}`",
        "",
        "Sooner = the best synchronous baseline's time to the target over this strategy's, paired by seed, mean with "
        "its 95% interval. The target is DDP's final validation loss of the same seed.",
    ]
    for setting, rows in result.items():
        lines += [
            "",
            f"## Setting {setting}: {rows['plan']}",
            "",
            f"Best synchronous baseline to the target: {rows['best_baseline']}."
            + (
                f" **Faster per update but without a token side, so not compared: {', '.join(rows['faster_unpaired'])}"
                " (give it one with --same-update).**"
                if rows.get("faster_unpaired")
                else ""
            ),
            "",
            "| strategy | s per update | tokens to target × DDP's (95% CI) | time to target, × sooner (95% CI) "
            "| per seed |",
            "|---|---:|---:|---:|---|",
        ]
        for name, row in rows["strategies"].items():
            if "tokens_ratio" not in row:
                why = "not reached within the budgets" if row.get("unreached") else "not measured"
                lines.append(f"| {name} | {row['seconds_per_update']:.4f} | {why} | — | |")
                continue
            per_seed = ", ".join(f"{x:.2f}" for x in row["sooner_per_seed"])
            label = f"{name} (tokens as {row['tokens_as']})" if "tokens_as" in row else name
            label += " (tokens ≤: a seed reached the target at the smallest budget)" if row.get("bound") else ""
            lines.append(
                f"| {label} | {row['seconds_per_update']:.4f} | {row['tokens_ratio']:.3f} ± "
                f"{row['tokens_ratio_ci95']:.3f} | **{row['sooner']:.2f}×** ± {row['sooner_ci95']:.2f} | {per_seed} |"
            )
    return "\n".join(lines) + "\n"


def levels_markdown(by_level: dict, targets: dict) -> str:
    """Per setting, how many times sooner than the best synchronous baseline each strategy reaches each target level
    (DDP's final loss at each of its budgets)."""
    if len(by_level) < 2:
        return ""
    levels = list(by_level)
    lines = [
        "",
        "## At several loss levels",
        "",
        "Each target is the final validation loss of DDP's run of that many updates (same seed), the mean over the "
        "seeds in brackets; × sooner than the best synchronous baseline to that target, paired by seed, with its 95% "
        "interval; the best baseline at each level in bold type (≥: a seed reached the target at its smallest "
        "budget; —: some seed not reached within the budgets).",
        "",
        "| setting | strategy | "
        + " | ".join(f"{n} updates ({targets[n]:.4f})" if targets.get(n) else f"{n} updates" for n in levels)
        + " |",
        "|---|---|" + "---:|" * len(levels),
    ]
    settings = dict.fromkeys(s for n in levels for s in by_level[n])
    for setting in settings:
        names = dict.fromkeys(name for n in levels for name in by_level[n].get(setting, {}).get("strategies", {}))
        for name in names:
            cells = []
            for n in levels:
                rows = by_level[n].get(setting)
                row = rows["strategies"].get(name, {}) if rows else {}
                if "sooner" not in row:
                    cells.append("—")
                    continue
                cell = f"{'≥ ' if row.get('bound') else ''}{row['sooner']:.2f}× ± {row['sooner_ci95']:.2f}"
                cells.append(f"**{cell}**" if name == rows["best_baseline"] else cell)
            lines.append(f"| {setting} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    drawn = panels(len(result), height=3.2)
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (setting, rows) in zip(axes, result.items()):
        named = [(n, r) for n, r in rows["strategies"].items() if "sooner" in r]
        ax.barh([n for n, _ in named], [r["sooner"] for _, r in named], xerr=[r["sooner_ci95"] for _, r in named])
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set(title=f"setting {setting}", xlabel=f"× sooner to DDP's final loss than {rows['best_baseline']}")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks time-to-target-table", description=__doc__)
    parser.add_argument("--tokens", required=True, help="a token-efficiency result name run with --budgets")
    parser.add_argument("--speed", required=True, help="a speed result name (benchmarks speed --name)")
    parser.add_argument("--lr", default="", help="the token table's learning rate (default: its only one)")
    parser.add_argument(
        "--same-update",
        default="",
        help="A=B,...: strategy A computes B's update (the same mathematics, e.g. zero1=ddp), so it needs B's "
        "tokens; such rows say so",
    )
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", default="time_to_target")
    args = parser.parse_args(argv)
    out = ROOT / args.out
    try:
        tokens = json.loads((out / f"{args.tokens}.json").read_text())["summary"]
        settings = json.loads((out / f"{args.speed}.json").read_text())["settings"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        parser.error(f"cannot read the results: {e}")
    try:
        lr = f"{float(args.lr):g}" if args.lr else next(iter(tokens))
    except ValueError:
        parser.error(f"--lr {args.lr!r} is not a number")
    if lr not in tokens:
        parser.error(f"no lr {lr} in {args.tokens}; it has {', '.join(tokens)}")
    ratios, bounds = token_ratios(tokens[lr])
    levels = {n: token_ratios(rows) for n, rows in at_levels(tokens[lr]).items()}
    pairs = [pair for pair in args.same_update.split(",") if pair]
    if any(pair.count("=") != 1 for pair in pairs):
        parser.error(f"--same-update takes A=B pairs separated by commas, got {args.same_update!r}")
    aliases = dict(pair.split("=") for pair in pairs)
    missing = sorted(b for b in aliases.values() if b not in tokens[lr])
    if missing:
        parser.error(f"--same-update names {', '.join(missing)}, whose tokens {args.tokens} does not hold")
    ratios |= {a: ratios[b] for a, b in aliases.items() if b in ratios}  # (a seed that never reached: no ratio)
    result = combine(settings, ratios)
    by_level = {}
    for n, (level_ratios, level_bounds) in levels.items():
        level_ratios |= {a: level_ratios[b] for a, b in aliases.items() if b in level_ratios}
        by_level[n] = combine(settings, level_ratios)
        for rows in by_level[n].values():
            for name, row in rows["strategies"].items():
                row["bound"] = aliases.get(name, name) in level_bounds
    for rows in result.values():
        for a, b in aliases.items():
            if a in rows["strategies"]:
                rows["strategies"][a]["tokens_as"] = b
        for name in rows["strategies"]:
            rows["strategies"][name]["bound"] = aliases.get(name, name) in bounds
            rows["strategies"][name]["unreached"] = aliases.get(name, name) in set(tokens[lr]) - set(ratios)
    command = "python -m benchmarks time-to-target-table " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "tokens": args.tokens,
            "speed": args.speed, "lr": lr, "command": command, "out": args.out}  # fmt: skip
    targets = {n: next(row["target"] for name, row in rows.items() if name != DDP)
               for n, rows in at_levels(tokens[lr]).items()}  # fmt: skip
    data = {"meta": meta, "settings": result, "levels": by_level, "targets": targets}
    write_report(out, args.name, data, markdown(result, meta) + levels_markdown(by_level, targets),
                 lambda path: plot(result, path))  # fmt: skip
    return 0


# the whole benchmark: the parts in turn ----------------------------------------------------------

SAME_AS_DDP = (ZERO1, FSDP, HSDP, f"{DDP}_one_bucket")  # DDP's update: its tokens (their floor is measured apart)
VARIANTS = ACCO  # the default token side besides DDP, and the strategies timed: what fits 90 minutes on 2 cores
STRATEGIES = ",".join((DDP, ZERO1, ACCO))
QUICK = dict(updates=60, seeds="0,1", budgets="0.5,1,1.5", levels="0.5,1", variants=ACCO, settings="a",
             strategies=f"{DDP},{ACCO}", speed_updates=30, repeats=1, validate="")  # fmt: skip


def timing_dependent(strategy: str) -> bool:
    """Mixed replicas: how many inner updates a replica runs depends on its speed, so its loss per token does too."""
    return "--diloco.balance_replicas" in speed.STRATEGIES.get(strategy, [])


def token_variant(strategy: str) -> str:
    """The token-efficiency variant whose update a speed strategy computes: balanced batches do not change it, nor
    ZeRO-1 in place of DDP (inside DiLoCo's replicas too)."""
    if timing_dependent(strategy):
        return strategy
    plain = strategy.removesuffix("_balanced")
    if plain in SAME_AS_DDP:
        return DDP
    inner = plain.removesuffix(f"_{ZERO1}")
    return inner if inner != plain and inner in token_efficiency.VARIANTS else plain


def calibrate(folder: Path, timeout: float) -> dict:
    """Compute per update of ZeRO-1 on 2 unshaped nodes of one rank (the recipe, 30 updates, the first 5 left out),
    and the link rate at which its job takes as long."""
    train = recipe(160, 3e-3, 0, [*QUIET, "--training.max_tokens", "0", "--training.steps", "30", "--eval.every", "0",
                                  "--parallelism.data_parallel", ZERO1])  # fmt: skip
    kept = run_training(ClusterPlan(nodes=2, rate_bps=None), train, folder, timeout_s=timeout)["records"][5:]
    compute = sorted(speed.compute_s(r) for r in kept)
    c = compute[len(compute) // 2]
    params = cm.model_workload("gpt_neo", "debug", 128, 4, 2, vocab_size=1024).params
    # ZeRO-1's job moves (W-1)/W of the fp32 buffer per rank twice (reduce-scatter, all-gather) per update.
    bits = 2 * 0.5 * 8 * 4 * params
    return {"compute_per_update_s": c, "params": params, "balance_bps": bits / c}


def ensure_calibration(path: Path, resume: bool, timeout: float) -> None:
    """The settings' link rates follow ZeRO-1's compute on this machine (setting a: its job as long as its compute):
    measured anew unless `resume` finds it, so that a resumed call keeps the settings its runs were timed on."""
    if resume:
        try:
            if "balance_bps" in json.loads(path.read_text())["calibration"]:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, or damaged: measured again
    calibration = calibrate(path.parent / "runs" / "calibrate", timeout)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"calibration": calibration}, indent=1))


def check(args) -> tuple[list[str], list[str]]:
    """The token variants and speed strategies, or one line naming what is wrong (before any run)."""
    variants = [v for v in args.variants.split(",") if v and v != DDP]
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [v for v in variants if v not in token_efficiency.VARIANTS]
    unknown += [s for s in strategies if s not in speed.STRATEGIES]
    if unknown:
        raise UserError(f"unknown variant or strategy {unknown[0]!r}; variants: {', '.join(token_efficiency.VARIANTS)}"
                        f"; strategies: {', '.join(speed.STRATEGIES)}")  # fmt: skip
    if DDP not in strategies:
        raise UserError("the targets are DDP's losses: keep ddp in --strategies")
    timed = [s for s in strategies if timing_dependent(s)]
    if timed:
        raise UserError(f"{timed[0]}'s loss per token depends on the run's timing, so loopback cannot measure it: "
                        "leave it out of --strategies; run it whole with python -m benchmarks end-to-end")  # fmt: skip
    for s in strategies:
        update = token_variant(s)
        if update not in token_efficiency.VARIANTS:
            raise UserError(f"--strategies {s}: no token-efficiency variant computes its update; leave it out")
        if update not in (DDP, *variants):
            raise UserError(f"--strategies {s} computes {update}'s update, which --variants does not measure; "
                            "add it to --variants")  # fmt: skip
    settings = [s for s in args.settings.split(",") if s]
    wrong = [s for s in settings if s not in speed.PER_SETTING]
    if wrong or not settings:
        raise UserError(f"--settings {args.settings!r}: choose from {', '.join(speed.PER_SETTING)}")
    short = [s for s in strategies if args.speed_updates <= speed.warmup_of(s)]
    if short:
        warmup = speed.warmup_of(short[0])
        raise UserError(f"--speed-updates {args.speed_updates} leaves no timed update for {short[0]} (its first "
                        f"{warmup} are warm-up); use at least {warmup + 1}")  # fmt: skip
    try:
        [int(x) for x in args.seeds.split(",")], float(args.lr)
    except ValueError:
        raise UserError(f"--seeds takes integers separated by commas and --lr one number; got {args.seeds!r} and "
                        f"{args.lr!r}") from None  # fmt: skip
    for pair in (p for p in args.validate.split(",") if p):
        setting, _, name = pair.partition(":")
        if setting not in settings or name not in strategies or token_variant(name) not in (name, DDP):
            raise UserError(f"--validate {pair}: give setting:strategy with a setting of --settings and a strategy of "
                            "--strategies that computes its own update or DDP's")  # fmt: skip
    return variants, strategies


def time_to_target_sweep(args) -> dict:
    """The four parts in turn (--quick: the command line has put QUICK's values in `args`)."""
    variants, strategies = check(args)
    out, name, started = Path(args.out), args.name, time.perf_counter()
    fresh = [] if args.resume else ["--fresh"]
    ensure_calibration(token_efficiency.ROOT / out / f"{name}_calibration.json", args.resume, args.timeout)
    token_efficiency.main([
        "--updates", str(args.updates), "--lrs", args.lr, "--seeds", args.seeds,
        "--variants", ",".join([DDP, *variants]), "--budgets", args.budgets, "--levels", args.levels,
        "--out", args.out, "--name", f"{name}_tokens", "--runs", f"{name}_runs", *fresh,
    ])  # fmt: skip
    tokens_done = time.perf_counter()
    speed.main([
        "--updates", str(args.speed_updates), "--repeats", str(args.repeats), "--settings", args.settings,
        "--strategies", ",".join(strategies), "--out", args.out, "--name", f"{name}_speed",
        "--calibration", f"{name}_calibration", *(["--resume"] if args.resume else []),
    ])  # fmt: skip
    same = ",".join(f"{s}={token_variant(s)}" for s in strategies if token_variant(s) != s)
    main([
        "--tokens", f"{name}_tokens", "--speed", f"{name}_speed", "--out", args.out, "--name", name,
        *(["--same-update", same] if same else []),
    ])  # fmt: skip
    if args.validate:
        end_to_end.main([
            "--pairs", args.validate, "--seeds", args.seeds.split(",")[0], "--tokens", f"{name}_tokens",
            "--speed", f"{name}_speed", "--out", args.out, "--name", f"{name}_end_to_end",
            "--calibration", f"{name}_calibration", *fresh,
        ])  # fmt: skip
    minutes = {"tokens": (tokens_done - started) / 60, "total": (time.perf_counter() - started) / 60}
    print(f"[time-to-target] done in {minutes['total']:.1f} min (the token side {minutes['tokens']:.1f} min)")
    return minutes


if __name__ == "__main__":  # the old form: one line naming `python -m benchmarks <command>`
    from benchmarks.cli import moved

    raise SystemExit(moved(__spec__.name))
