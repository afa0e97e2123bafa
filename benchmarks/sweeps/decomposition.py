"""Time to target, whole: the token side on loopback, the speed on the emulated cluster, their product at several
loss levels, and (--validate) whole runs on the cluster against the product.

    sudo .venv/bin/python -m benchmarks time-to-target [--quick] [--resume] [--variants acco,streaming_h10_avg] \\
        [--settings a,b] [--strategies ddp,zero1,acco,streaming_h10_avg] [--validate a:acco]

1. Tokens (`benchmarks/token_efficiency.py`, loopback, 2 ranks): DDP at --levels, every variant at --budgets, each
   run with its own cosine; each DDP final loss is a target, and a variant's tokens to it are interpolated between
   its finished runs.
2. Speed (`benchmarks/speed.py`, the cluster): seconds per update of --strategies after warm-up, --repeats each.
3. Their product (`benchmarks/time_to_target.py`): per setting, level and seed, how many times sooner than the best
   synchronous baseline each strategy reaches the target. A baseline that computes DDP's update (zero1, fsdp, hsdp,
   balanced or not) takes DDP's tokens; a balanced strategy its unbalanced self's.
4. --validate setting:strategy,...: whole runs to DDP's loss on the cluster (`benchmarks/end_to_end.py`).

The settings' link rates follow this machine's compute (<out>/<name>_calibration.json, measured first). Without
--resume every run is done again; with it, the calibration and finished runs with the same arguments are kept, so a
call with more seeds, variants or strategies runs only what it adds. Writes <out>/<name>_{tokens,speed,end_to_end}.* and
<out>/<name>.{json,md,png}. Needs root and a quiet machine for the speed and validation parts.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import end_to_end, speed, time_to_target, token_efficiency
from benchmarks.names import ACCO, DDP, FSDP, HSDP, ZERO1
from benchmarks.sweeps.time_to_loss import calibrate, model_args
from torchacco.errors import UserError

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


def ensure_calibration(path: Path, resume: bool, timeout: float) -> None:
    """The settings' link rates follow ZeRO-1's compute on this machine (setting a: its job as long as its compute):
    measured anew unless `resume` finds it, so that a resumed call keeps the settings its runs were timed on."""
    if resume:
        try:
            if "balance_bps" in json.loads(path.read_text())["calibration"]:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none, or damaged: measured again
    args = SimpleNamespace(
        out=str(path.parent), timeout=timeout, updates=160, seq_len=128, local_batch=4, eval_every=16
    )
    calibration = calibrate(args, model_args(args, 2, args.local_batch))
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
                        "leave it out of --strategies; run it whole with python -m benchmarks.end_to_end")  # fmt: skip
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
    time_to_target.main([
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
