"""Time to target: the tokens a strategy needs for DDP's final loss (loopback) times its measured time per token
(the emulated cluster), against the best synchronous baseline, per setting.

    .venv/bin/python -m benchmarks.time_to_target --tokens diloco_budgets_lr3e-3 --speed speed_streaming \\
        --same-update zero1=ddp

The two parts are measured where each is cheap and precise: loss against tokens does not depend on the link
(`benchmarks/token_efficiency.py --budgets ...`: the tokens to DDP's final loss of the same seed, interpolated
between finished runs of several budgets), speed does not depend on the loss (`benchmarks/speed.py`: seconds per
update's tokens after warm-up). DDP needs 1× its tokens by definition. A strategy whose token side is not in the
table is shown with its speed only, unless --same-update says whose update it computes.
Writes bench_results/<--name>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from benchmarks.names import DDP
from benchmarks.speed import BASELINES
from benchmarks.stats import mean_ci
from benchmarks.sweeps.common import panels, save_figure, write_report
from benchmarks.token_efficiency import machine

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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.time_to_target", description=__doc__)
    parser.add_argument("--tokens", required=True, help="a token-efficiency result name run with --budgets")
    parser.add_argument("--speed", required=True, help="a speed result name (benchmarks.speed --name)")
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
    command = "python -m benchmarks.time_to_target " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "tokens": args.tokens,
            "speed": args.speed, "lr": lr, "command": command, "out": args.out}  # fmt: skip
    targets = {n: next(row["target"] for name, row in rows.items() if name != DDP)
               for n, rows in at_levels(tokens[lr]).items()}  # fmt: skip
    data = {"meta": meta, "settings": result, "levels": by_level, "targets": targets}
    write_report(out, args.name, data, markdown(result, meta) + levels_markdown(by_level, targets),
                 lambda path: plot(result, path))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
