"""End-to-end check of time to target: whole runs on the emulated cluster against the product of its two parts.

    .venv/bin/python -m benchmarks end-to-end --pairs a:ddp,a:streaming_h10_avg --seeds 0 \\
        --tokens diloco_budgets_lr3e-3 --speed speed_streaming

Each (setting, strategy, seed) trains the --tokens table's recipe on the cluster: DDP its base budget, a strategy of
the table its budgets from the last that misses DDP's loss on loopback until one reaches it (one without a token side:
--budgets). Its time to target (training time, evaluation left out) is interpolated between the two runs that bracket
the target; the prediction is the tokens ratio × DDP's updates × the speed table's seconds per update. Needs root.
Writes <out>/<--name>.{json,md,png}.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks import common
from benchmarks.cluster import run_training
from benchmarks.common import DDP, QUIET, ROOT, recipe, update_s
from benchmarks.yardstick.speed import BASELINES, CALIBRATION_HELP, STRATEGIES, kept_run, plans
from benchmarks.yardstick.tokens import budget_multiples, updates_to_target

TOLERANCE = 0.10  # the decomposition's target: predicted time to target within 10% of measured


def training_seconds(records: list[dict]) -> float:
    """The run's training time, evaluation and checkpoints left out (every update logged)."""
    return sum(map(update_s, records))


def val_curve(records: list[dict]) -> list[dict]:
    """(step, tokens, training wall-clock, val_loss) at each evaluation (the wall-clock leaves evaluation out)."""
    out, wall, prev = [], 0.0, 0
    for r in records:
        wall, prev = wall + (r["tokens"] - prev) / r["tokens_per_s"], r["tokens"]
        if "val_loss" in r:
            out.append({"step": r["step"], "tokens": r["tokens"], "wall_s": wall, "val_loss": r["val_loss"]})
    return out


def measured_time_to_target(target: float, runs: dict[int, dict]) -> tuple[float | None, float | None]:
    """(seconds, updates) to `target` from runs of several budgets (updates -> {'loss', 'seconds'}), interpolated as
    the token side does."""
    needed, bound = updates_to_target(target, {n: r["loss"] for n, r in runs.items()})
    if needed is None:
        return None, None
    points = sorted(runs.items())
    if bound:
        return points[0][1]["seconds"], needed
    (n0, r0), (n1, r1) = next((p, q) for p, q in zip(points, points[1:]) if p[0] <= needed <= q[0])
    return r0["seconds"] + (r1["seconds"] - r0["seconds"]) * (needed - n0) / (n1 - n0), needed


def train_on_cluster(setting: str, name: str, seed: int, updates: int, lr: float, out: Path, fresh: bool = False,
                     calibration: str = "time_to_loss") -> dict:  # fmt: skip
    """One whole run (its summary is kept in its folder and reused unless `fresh`)."""
    plan, extra = plans(out, calibration)[setting]
    folder = out / "runs" / "end_to_end" / f"{setting}_{name}_u{updates}_s{seed}"
    args = [*recipe(updates, lr, seed), *QUIET, *STRATEGIES[name], *extra]

    def run() -> dict:
        done = run_training(plan, args, folder, timeout_s=3600)
        records = done["records"]
        print(f"[end_to_end] {setting} {name} {updates} updates seed {seed}: loss {records[-1]['val_loss']:.4f}, "
              f"{training_seconds(records):.1f} s training, {done['wall_s']:.1f} s wall", flush=True)  # fmt: skip
        return {"loss": records[-1]["val_loss"], "seconds": training_seconds(records), "wall_s": done["wall_s"],
                "updates": records[-1]["step"], "curve": val_curve(records)}  # fmt: skip

    return kept_run(plan, args, folder, "end_to_end.json", not fresh, run)


def validate(setting: str, name: str, seed: int, tokens: dict, speed: dict, base: int, lr: float, out: Path,
             budgets: list[int] = (), fresh: bool = False, calibration: str = "time_to_loss") -> dict:  # fmt: skip
    """One (setting, strategy, seed): its cluster runs, measured and predicted time to target, and how many times
    sooner than each synchronous baseline (DDP's tokens × its speed); one without a token side runs `budgets`."""
    index, rows = tokens["meta"]["seeds"].index(seed), tokens["summary"][f"{lr:g}"]
    target, ratio, finals = rows[DDP]["val_loss"][index], None, {}
    if name.removesuffix("_balanced") in BASELINES:  # DDP's update, in another floating-point order
        budgets, ratio, finals = [base], 1.0, {str(base): rows[DDP]["val_loss"]}
    elif name in rows:
        budgets = sorted(int(n) for n in rows[name]["budgets"])
        ratio, finals = rows[name]["tokens_to_target_ratio"][index], rows[name]["budgets"]
    loopback = {int(n): vals[index] for n, vals in finals.items()}
    # From the largest budget whose loopback run misses the target (the same numbers on the cluster), upwards
    start = max((n for n in budgets if n in loopback and loopback[n] > target), default=budgets[0])
    runs = {}
    for updates in (n for n in budgets if n >= start):
        runs[updates] = train_on_cluster(setting, name, seed, updates, lr, out, fresh, calibration)
        if runs[updates]["loss"] <= target:
            break
    seconds, needed = measured_time_to_target(target, runs)
    if ratio == 1.0:  # DDP's update needs DDP's tokens by definition; its loss differs only by floating-point order
        seconds, needed = runs[base]["seconds"], float(base)
    measured = speed["settings"][setting]["strategies"]
    per_update = measured.get(name, {}).get("mean")
    predicted = None if ratio is None or per_update is None else ratio * base * per_update
    baselines = {b: base * row["mean"] for b, row in measured.items() if b.removesuffix("_balanced") in BASELINES}
    return {"setting": setting, "strategy": name, "seed": seed, "target": target, "runs": runs,
            "loss_vs_loopback": {n: r["loss"] - loopback[n] for n, r in runs.items() if n in loopback},
            "measured_s": seconds, "measured_updates": needed, "predicted_s": predicted,
            "predicted_updates": None if ratio is None else ratio * base, "seconds_per_update": per_update,
            "error": None if seconds is None or predicted is None else predicted / seconds - 1,
            "sooner_than": {b: t / seconds for b, t in baselines.items()} if seconds else {}}  # fmt: skip


def against_runs(results: list[dict]) -> None:
    """Each row's times sooner than the whole runs of the baselines in the same setting and seed."""
    for r in results:
        same = [x for x in results if (x["setting"], x["seed"]) == (r["setting"], r["seed"]) and x["measured_s"]]
        runs = {x["strategy"]: x["measured_s"] for x in same if x["strategy"].removesuffix("_balanced") in BASELINES}
        r["sooner_than_runs"] = {b: t / r["measured_s"] for b, t in runs.items()} if r["measured_s"] else {}


def sooner(against: dict[str, float]) -> str:
    """The best baseline's and the best unbalanced baseline's times over this run's, with their names."""
    if not against:
        return "—"
    best = min(against, key=against.get)
    plain = min((b for b in against if not b.endswith("_balanced")), key=against.get, default=best)
    return f"{against[best]:.2f}× ({best})" + (f"; {against[plain]:.2f}× ({plain})" if plain != best else "")


def markdown(results: list[dict], meta: dict) -> str:
    lines = ["# Time to target, predicted from its two parts against whole runs on the emulated cluster", "",
             f"{meta['date']}, {meta['machine']}; network namespaces, `tc tbf`, CPU quotas. Tokens: "
             f"`bench_results/{meta['tokens']}.md` (loopback, lr {meta['lr']}); speed: "
             f"`bench_results/{meta['speed']}.md`.", f"Command: `{meta['command']}`", "",
             "Target: DDP's final validation loss of the same seed (loopback). Measured: the training time of the "
             "whole cluster runs (warm-up included, evaluation left out), interpolated between the budgets that "
             "bracket the target. Predicted: the loopback tokens ratio × DDP's updates × the short runs' seconds "
             f"per update. Met: |error| ≤ {TOLERANCE:.0%}. Loss vs loopback: the cluster run's final loss "
             "minus the loopback run's (same seed and budget).", "",
             "| setting | strategy | seed | updates to target, measured / predicted | time to target, measured (s) "
             "| predicted (s) | error | met | × sooner than the baseline's whole run | × sooner than the baselines' "
             "time from their speed (the best; the best unbalanced) | loss vs loopback | wall s per run |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|---|---|"]  # fmt: skip
    fmt = lambda x, f: "—" if x is None else format(x, f)
    for r in results:
        met = "—" if r["error"] is None else ("yes" if abs(r["error"]) <= TOLERANCE else "**no**")
        drift = ", ".join(f"{d:+.1e}" for d in r["loss_vs_loopback"].values()) or "—"
        runs = ", ".join(f"{x:.2f}× ({b})" for b, x in r.get("sooner_than_runs", {}).items()) or "—"
        lines.append(f"| {r['setting']} | {r['strategy']} | {r['seed']} | {fmt(r['measured_updates'], '.0f')} / "
                     f"{fmt(r['predicted_updates'], '.0f')} | {fmt(r['measured_s'], '.1f')} | "
                     f"{fmt(r['predicted_s'], '.1f')} | {fmt(r['error'], '+.1%')} | {met} | {runs} | "
                     f"{sooner(r['sooner_than'])} | {drift} | "
                     + ", ".join(f"{x['wall_s']:.0f}" for x in r["runs"].values()) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = common.parser("end-to-end", __doc__, "end_to_end")
    parser.add_argument("--pairs", required=True, help="setting:strategy,... (e.g. b:ddp,b:streaming_h10_avg)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--tokens", required=True, help="a token-efficiency result name run with --budgets")
    parser.add_argument("--speed", required=True, help="a speed result name (benchmarks speed --name)")
    parser.add_argument("--budgets", default="1.25,1.5", help="multiples of the table's updates that a strategy "
                        "without a token side runs (a timing-dependent one)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="rerun runs whose results are kept")
    parser.add_argument("--calibration", default="time_to_loss", help=CALIBRATION_HELP)
    args = parser.parse_args(argv)
    out = ROOT / args.out
    try:
        tokens = json.loads((out / f"{args.tokens}.json").read_text())
        speed = json.loads((out / f"{args.speed}.json").read_text())
        pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
        seeds = [int(s) for s in args.seeds.split(",")]
    except (OSError, json.JSONDecodeError, ValueError) as e:
        parser.error(f"cannot read the inputs: {e}")
    if len(tokens["summary"]) != 1:
        parser.error(f"{args.tokens} holds several lrs ({', '.join(tokens['summary'])}); give one with budgets")
    lr, base = float(next(iter(tokens["summary"]))), tokens["meta"]["updates"]
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in speed["settings"] or pair[1] not in STRATEGIES:
            parser.error(f"--pairs: {':'.join(pair)} is not setting:strategy with a setting {args.speed} measured "
                         f"and a strategy from {', '.join(STRATEGIES)}")  # fmt: skip
    rows = tokens["summary"][f"{lr:g}"]
    unbudgeted = [n for _, n in pairs if n in rows and n.removesuffix("_balanced") not in BASELINES and
                  "budgets" not in rows[n]]  # fmt: skip
    if unbudgeted:
        parser.error(f"{args.tokens} has no budgets for {', '.join(unbudgeted)}: rerun token-efficiency with "
                     "--budgets (e.g. 1,1.25,1.5)")  # fmt: skip
    budgets = sorted(round(m * base) for m in budget_multiples(parser, args.budgets))
    missing = [s for s in seeds if s not in tokens["meta"]["seeds"]]
    if missing:
        parser.error(f"--seeds {missing} are not in {args.tokens}")
    # a cluster that cannot be built or a run that fails is one line (ClusterError, through run_cli)
    results = [validate(s, n, seed, tokens, speed, base, lr, out, budgets, args.fresh, args.calibration)
               for seed in seeds for s, n in pairs]  # fmt: skip
    against_runs(results)
    shown = [r for r in results if r["error"] is not None]
    mae = statistics.fmean(abs(r["error"]) for r in shown) if shown else None
    meta = common.meta("end-to-end", argv, tokens=args.tokens, speed=args.speed, lr=f"{lr:g}", mean_abs_error=mae)
    bars = {"predicted over measured time to target − 1 (%)": [
        (f"{r['setting']} {r['strategy']} s{r['seed']}", 100 * r["error"], 0) for r in shown]}  # fmt: skip
    common.write_report(out, args.name, {"meta": meta, "results": results}, markdown(results, meta),
                        lambda path: common.bars(path, bars, "", 0.0, 100 * TOLERANCE))  # fmt: skip
    return 0
