"""Time to target from saved token-efficiency and speed results: per setting, level and seed, how many times sooner
than the best synchronous baseline each strategy reaches DDP's final loss (its tokens ratio × its seconds per update).

    .venv/bin/python -m benchmarks time-to-target-table --tokens diloco_budgets_lr3e-3 --speed speed_streaming \\
        --same-update zero1=ddp

DDP needs 1× its tokens by definition. A strategy that computes another's update (zero1, fsdp, hsdp: DDP's; a balanced
one: its unbalanced self's) takes that one's tokens with --same-update; one whose token side is not in the table is
shown with its speed only. Writes <out>/<--name>.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics

from benchmarks import common
from benchmarks.common import DDP, ROOT, mean_ci
from benchmarks.yardstick.speed import BASELINES


def token_ratios(rows: dict) -> tuple[dict[str, list[float]], set[str]]:
    """Per variant, the per-seed tokens to DDP's final loss as a multiple of DDP's (DDP: 1), and the variants whose
    ratio is a bound (a seed reached the target at the smallest budget)."""
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
    """The token table's rows at each target level (DDP's updates, with --levels); variants without levels left out."""
    levels = next((list(row["levels"]) for row in rows.values() if "levels" in row), None)
    measured = {name: row for name, row in rows.items() if name == DDP or "levels" in row}
    return {n: {name: row if name == DDP else row["levels"][n] for name, row in measured.items()} for n in levels or ()}


def combine(settings: dict, ratios: dict[str, list[float]]) -> dict:
    """Per setting and strategy: seconds per update, the tokens ratio, and how many times sooner than the best
    synchronous baseline it reaches the target, paired by seed."""
    out = {}
    for setting, data in settings.items():
        speed = {name: row["mean"] for name, row in data["strategies"].items()}
        baselines = [n for n in speed if n.removesuffix("_balanced") in BASELINES and n in ratios]
        if not baselines:
            continue
        cost = {n: [r * speed[n] for r in ratios[n]] for n in speed if n in ratios}  # seconds per DDP's tokens
        best = min(baselines, key=lambda n: statistics.fmean(cost[n]))
        unpaired = [n for n in speed if n.removesuffix("_balanced") in BASELINES and n not in ratios]
        rows = {}
        for name, s in speed.items():
            row = rows[name] = {"seconds_per_update": s, "speed_vs_best": speed[best] / s}
            if name in cost:
                sooner = [b / c for b, c in zip(cost[best], cost[name])]
                (mean, half), (ratio, ratio_half) = mean_ci(sooner), mean_ci(ratios[name])
                row |= {"tokens_ratio": ratio, "tokens_ratio_ci95": ratio_half, "sooner_per_seed": sooner,
                        "sooner": mean, "sooner_ci95": half}  # fmt: skip
        out[setting] = {"plan": data["plan"], "best_baseline": best, "strategies": rows,
                        "faster_unpaired": [n for n in unpaired if speed[n] < speed[best]]}  # fmt: skip
    return out


def merged(files: list[dict], parser) -> dict:
    """Several token tables as one, per lr: each variant's row from the first file that holds it. A seed's ratio is to
    DDP's run of its own file, so files pair by seed only when they ran as many."""
    out = {}
    for summary in files:
        for lr, rows in summary.items():
            for name, row in rows.items():
                out.setdefault(lr, {}).setdefault(name, row)
    for rows in out.values():
        if len({len(row["val_loss"]) for row in rows.values()}) > 1:
            parser.error("the --tokens files ran different numbers of seeds: give files of the same seeds")
    return out


def markdown(result: dict, meta: dict, by_level: dict, targets: dict) -> str:
    where = meta.get("out", "bench_results")
    files = ", ".join(f"`{where}/{name}.md`" for name in meta["tokens"].split(","))
    lines = ["# Time to DDP's final loss: tokens needed (loopback) × time per token (emulated cluster)", "",
             f"{meta['date']}, {meta['machine']}. Tokens: {files} (lr {meta['lr']}); speed: "
             f"`{where}/{meta['speed']}.md`.",
             f"Command: `{meta['command']}`", "",
             "Sooner = the best synchronous baseline's time to the target over this strategy's, paired by seed, mean "
             "with its 95% interval. The target is DDP's final validation loss of the same seed."]  # fmt: skip
    for setting, rows in result.items():
        unpaired = ", ".join(rows.get("faster_unpaired", []))
        note = (f" **Faster per update but without a token side, so not compared: {unpaired} (give it one with "
                "--same-update).**") if unpaired else ""  # fmt: skip
        lines += ["", f"## Setting {setting}: {rows['plan']}", "",
                  f"Best synchronous baseline to the target: {rows['best_baseline']}.{note}", "",
                  "| strategy | s per update | tokens to target × DDP's (95% CI) | time to target, × sooner (95% CI) "
                  "| per seed |", "|---|---:|---:|---:|---|"]  # fmt: skip
        for name, row in rows["strategies"].items():
            if "tokens_ratio" not in row:
                why = "not reached within the budgets" if row.get("unreached") else "not measured"
                lines.append(f"| {name} | {row['seconds_per_update']:.4f} | {why} | — | |")
                continue
            label = f"{name} (tokens as {row['tokens_as']})" if "tokens_as" in row else name
            label += " (tokens ≤: a seed reached the target at the smallest budget)" if row.get("bound") else ""
            lines.append(f"| {label} | {row['seconds_per_update']:.4f} | {row['tokens_ratio']:.3f} ± "
                         f"{row['tokens_ratio_ci95']:.3f} | **{row['sooner']:.2f}×** ± {row['sooner_ci95']:.2f} | "
                         + ", ".join(f"{x:.2f}" for x in row["sooner_per_seed"]) + " |")  # fmt: skip
    if len(by_level) < 2:
        return "\n".join(lines) + "\n"
    levels = list(by_level)
    lines += ["", "## At several loss levels", "",
              "Each target is the final validation loss of DDP's run of that many updates (same seed), the mean over "
              "the seeds in brackets; × sooner than the best synchronous baseline to that target, paired by seed, "
              "with its 95% interval; the best baseline at each level in bold type (≥: a seed reached the target at "
              "its smallest budget; —: some seed not reached within the budgets).", "",
              "| setting | strategy | " + " | ".join(f"{n} updates ({targets[n]:.4f})" if targets.get(n)
                                                      else f"{n} updates" for n in levels) + " |",
              "|---|---|" + "---:|" * len(levels)]  # fmt: skip
    for setting in dict.fromkeys(s for n in levels for s in by_level[n]):
        for name in dict.fromkeys(x for n in levels for x in by_level[n].get(setting, {}).get("strategies", {})):
            cells = []
            for n in levels:
                rows = by_level[n].get(setting)
                row = rows["strategies"].get(name, {}) if rows else {}
                cell = f"{'≥ ' if row.get('bound') else ''}{row['sooner']:.2f}× ± {row['sooner_ci95']:.2f}" if (
                    "sooner" in row) else "—"  # fmt: skip
                cells.append(f"**{cell}**" if "sooner" in row and name == rows["best_baseline"] else cell)
            lines.append(f"| {setting} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser("time-to-target-table", __doc__, "time_to_target")
    parser.add_argument("--tokens", required=True, help="token-efficiency result names run with --budgets, comma-"
                        "separated: a variant's row comes from the first that holds it")  # fmt: skip
    parser.add_argument("--speed", required=True, help="a speed result name (benchmarks speed --name)")
    parser.add_argument("--lr", default="", help="the token table's learning rate (default: its only one)")
    parser.add_argument("--same-update", default="", help="A=B,...: strategy A computes B's update (the same "
                        "mathematics, e.g. zero1=ddp), so it needs B's tokens; such rows say so")  # fmt: skip
    args = parser.parse_args(argv)
    out = ROOT / args.out
    try:
        files = [json.loads((out / f"{name}.json").read_text())["summary"] for name in args.tokens.split(",")]
        settings = json.loads((out / f"{args.speed}.json").read_text())["settings"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        parser.error(f"cannot read the results: {e}")
    tokens = merged(files, parser)
    try:
        lr = f"{float(args.lr):g}" if args.lr else next(iter(tokens))
    except ValueError:
        parser.error(f"--lr {args.lr!r} is not a number")
    if lr not in tokens:
        parser.error(f"no lr {lr} in {args.tokens}; it has {', '.join(tokens)}")
    pairs = [pair for pair in args.same_update.split(",") if pair]
    if any(pair.count("=") != 1 for pair in pairs):
        parser.error(f"--same-update takes A=B pairs separated by commas, got {args.same_update!r}")
    aliases = dict(pair.split("=") for pair in pairs)
    missing = sorted(b for b in aliases.values() if b not in tokens[lr])
    if missing:
        parser.error(f"--same-update names {', '.join(missing)}, whose tokens {args.tokens} does not hold")

    def level(rows: dict, unreached: set = frozenset()) -> dict:
        ratios, bounds = token_ratios(rows)
        ratios |= {a: ratios[b] for a, b in aliases.items() if b in ratios}  # (a seed that never reached: no ratio)
        result = combine(settings, ratios)
        for table in result.values():
            for name, row in table["strategies"].items():
                row |= {"bound": aliases.get(name, name) in bounds}
                row |= {"tokens_as": aliases[name]} if name in aliases else {}
                row |= {"unreached": aliases.get(name, name) in unreached - set(ratios)} if unreached else {}
        return result

    result = level(tokens[lr], set(tokens[lr]))
    if not result:
        parser.error(f"no setting of {args.speed} has a synchronous baseline ({', '.join(BASELINES)}) whose tokens "
                     f"{args.tokens} holds: give it DDP's with --same-update (e.g. zero1=ddp)")  # fmt: skip
    levels = at_levels(tokens[lr])
    by_level = {n: level(rows) for n, rows in levels.items()}
    targets = {n: next(row["target"] for name, row in rows.items() if name != DDP) for n, rows in levels.items()}
    meta = common.meta("time-to-target-table", argv, tokens=args.tokens, speed=args.speed, lr=lr, out=args.out)
    data = {"meta": meta, "settings": result, "levels": by_level, "targets": targets}
    bars = {common.panel_title(s, rows["plan"]): [(common.plain_name(n), r["sooner"], r["sooner_ci95"])
                                                   for n, r in rows["strategies"].items() if "sooner" in r]
            for s, rows in result.items()}  # fmt: skip
    title = "× sooner to DDP's final loss than the best baseline"
    common.write_report(out, args.name, data, markdown(result, meta, by_level, targets),
                        lambda path: common.bars(path, bars, title))  # fmt: skip
    return 0
