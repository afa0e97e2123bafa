"""Time to target, the yardstick: the tokens a strategy needs for DDP's loss (loopback, tokens.py) times its measured
time per update (the emulated cluster, speed.py), against the best synchronous baseline, per setting and loss level
(table.py); --validate adds whole runs on the cluster against that product (end_to_end.py). docs/performance.md
describes the method.

    sudo .venv/bin/python -m benchmarks time-to-target [--quick] [--resume] [--validate a:acco]

The settings' link rates follow this machine's compute (<out>/<name>_calibration.json, measured first); --resume keeps
the calibration and finished runs with the same arguments. Writes <out>/<name>_{tokens,speed,end_to_end}.* and
<out>/<name>.{json,md,png}. Needs root and a quiet machine for the speed and validation parts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks import common
from benchmarks.cluster import ClusterPlan, preflight, run_training
from benchmarks.common import ACCO, DDP, FSDP, HSDP, QUIET, ROOT, ZERO1, recipe
from benchmarks.yardstick import end_to_end, speed, table, tokens
from torchacco.errors import UserError
from torchacco.planning import cost_model as cm

SAME_AS_DDP = (ZERO1, FSDP, HSDP, f"{DDP}_one_bucket")  # DDP's update: its tokens (their floor is measured apart)
VARIANTS = ACCO  # the default token side besides DDP, and the strategies timed: what fits 90 minutes on 2 cores
STRATEGIES = ",".join((DDP, ZERO1, ACCO))
QUICK = dict(updates=60, seeds="0,1", budgets="0.5,1,1.5", levels="0.5,1", variants=ACCO, settings="a",
             strategies=f"{DDP},{ACCO}", speed_updates=30, repeats=1, validate="")  # fmt: skip


def timing_dependent(strategy: str) -> bool:
    """Mixed replicas: how many inner updates a replica runs depends on its speed, so its loss per token does too."""
    return "--diloco.balance_replicas" in speed.STRATEGIES.get(strategy, [])


def token_variant(strategy: str) -> str:
    """The token-efficiency variant whose update a speed strategy computes (balanced batches and ZeRO-1 for DDP, in
    DiLoCo's replicas too, change nothing)."""
    if timing_dependent(strategy):
        return strategy
    plain = strategy.removesuffix("_balanced")
    if plain in SAME_AS_DDP:
        return DDP
    inner = plain.removesuffix(f"_{ZERO1}")
    return inner if inner != plain and inner in tokens.VARIANTS else plain


def calibrate(folder: Path, timeout: float) -> dict:
    """ZeRO-1's compute per update on 2 unshaped one-rank nodes (median of 25), and the link rate at which its job
    takes as long."""
    train = recipe(160, 3e-3, 0, [*QUIET, "--training.max_tokens", "0", "--training.steps", "30", "--eval.every", "0",
                                  "--parallelism.data_parallel", ZERO1])  # fmt: skip
    kept = run_training(ClusterPlan(nodes=2, rate_bps=None), train, folder, timeout_s=timeout)["records"][5:]
    c = sorted(speed.compute_s(r) for r in kept)[len(kept) // 2]
    params = cm.model_workload("gpt_neo", "debug", 128, 4, 2, vocab_size=1024).params
    # ZeRO-1's job moves (W-1)/W of the fp32 buffer per rank twice (reduce-scatter, all-gather) per update.
    return {"compute_per_update_s": c, "params": params, "balance_bps": 2 * 0.5 * 8 * 4 * params / c}


def check(args) -> tuple[list[str], list[str]]:
    """The token variants and speed strategies, or one line naming what is wrong (before any run)."""
    variants = [v for v in args.variants.split(",") if v and v != DDP]
    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [v for v in variants if v not in tokens.VARIANTS] + [s for s in strategies if s not in speed.STRATEGIES]
    if unknown:
        raise UserError(f"unknown variant or strategy {unknown[0]!r}; variants: {', '.join(tokens.VARIANTS)}"
                        f"; strategies: {', '.join(speed.STRATEGIES)}")  # fmt: skip
    if DDP not in strategies:
        raise UserError("the targets are DDP's losses: keep ddp in --strategies")
    timed = [s for s in strategies if timing_dependent(s)]
    if timed:
        raise UserError(f"{timed[0]}'s loss per token depends on the run's timing, so loopback cannot measure it: "
                        "leave it out of --strategies; run it whole with python -m benchmarks end-to-end")  # fmt: skip
    for s in strategies:
        update = token_variant(s)
        if update not in tokens.VARIANTS:
            raise UserError(f"--strategies {s}: no token-efficiency variant computes its update; leave it out")
        if update not in (DDP, *variants):
            raise UserError(f"--strategies {s} computes {update}'s update, which --variants does not measure; "
                            "add it to --variants")  # fmt: skip
    settings = [s for s in args.settings.split(",") if s]
    if not settings or any(s not in speed.PER_SETTING for s in settings):
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


def time_to_target(args) -> dict:
    """The four parts in turn."""
    variants, strategies = check(args)
    name, started = args.name, time.perf_counter()
    fresh, resume = ([], ["--resume"]) if args.resume else (["--fresh"], [])
    path = ROOT / args.out / f"{name}_calibration.json"
    try:  # measured anew unless --resume finds it, so that a resumed call keeps the settings its runs were timed on
        kept = args.resume and "balance_bps" in json.loads(path.read_text())["calibration"]
    except (OSError, ValueError, KeyError, TypeError):
        kept = False
    if not kept:
        calibration = calibrate(path.parent / "runs" / "calibrate", args.timeout)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"calibration": calibration}, indent=1))
    out, tables = ["--out", args.out], ["--tokens", f"{name}_tokens", "--speed", f"{name}_speed"]
    tokens.main(["--updates", str(args.updates), "--lrs", args.lr, "--seeds", args.seeds, "--variants",
                 ",".join([DDP, *variants]), "--budgets", args.budgets, "--levels", args.levels, *out,
                 "--name", f"{name}_tokens", "--runs", f"{name}_runs", *fresh])  # fmt: skip
    tokens_done = time.perf_counter()
    speed.main(["--updates", str(args.speed_updates), "--repeats", str(args.repeats), "--settings", args.settings,
                "--strategies", ",".join(strategies), *out, "--name", f"{name}_speed",
                "--calibration", f"{name}_calibration", *resume])  # fmt: skip
    same = ",".join(f"{s}={token_variant(s)}" for s in strategies if token_variant(s) != s)
    table.main([*tables, *out, "--name", name, *(["--same-update", same] if same else [])])
    if args.validate:
        end_to_end.main(["--pairs", args.validate, "--seeds", args.seeds.split(",")[0], *tables, *out,
                         "--name", f"{name}_end_to_end", "--calibration", f"{name}_calibration", *fresh])  # fmt: skip
    minutes = {"tokens": (tokens_done - started) / 60, "total": (time.perf_counter() - started) / 60}
    print(f"[time-to-target] done in {minutes['total']:.1f} min (the token side {minutes['tokens']:.1f} min)")
    return minutes


def main(argv: list[str] | None = None) -> int:
    p = common.parser("time-to-target", __doc__, "time_to_target_all")
    p.add_argument("--updates", type=int, default=1000, help="DDP's base run: the token budget")
    p.add_argument("--lr", default="3e-3", help="the peak learning rate of every run (DDP's best at 1,000 updates)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--variants", default=VARIANTS, help="the token side's variants besides DDP (token-efficiency)")
    p.add_argument("--budgets", default="0.75,1,1.25", help="multiples of --updates each variant runs")
    p.add_argument("--levels", default="0.75,1", help="multiples of --updates DDP runs: its final losses are targets")
    p.add_argument("--settings", default="a,b")
    p.add_argument("--strategies", default=STRATEGIES, help="timed on the cluster (speed)")
    p.add_argument("--speed-updates", type=int, default=110, help="updates per speed run (the first 10 warm up)")
    p.add_argument("--repeats", type=int, default=2, help="speed runs per strategy and setting")
    p.add_argument("--validate", default="", help="setting:strategy,... run whole on the cluster to DDP's loss")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the calibration run")
    p.add_argument("--quick", action="store_true", help="a few-minute smoke version (bench_results/quick)")
    p.add_argument("--resume", action="store_true", help="keep finished runs with the same arguments; run the rest")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK, out="bench_results/quick" if args.out == "bench_results" else args.out)
    check(args)
    preflight(need_cgroup=True)
    time_to_target(args)
    return 0
