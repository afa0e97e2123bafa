"""Time to loss: which strategy reaches a validation loss soonest on a slow or mixed cluster.

    sudo .venv/bin/python -m benchmarks time-to-loss [--quick] [--settings a,b,c] [--seeds 0,1,2] [--resume]

Settings (the emulated cluster of `benchmarks.cluster`):
  a  2 nodes at the link rate where ZeRO-1's exposed communication equals its compute (calibrated first);
  b  2 nodes at a third of that rate (communication about 3× compute);
  c  4 nodes at 1 Gbit/s, each capped at --cpu-per-node cores, one of them --slow-factor times slower.
Every strategy trains the same model on the same token budget with the same token-indexed schedule,
for each seed. The target is DDP's mean final validation loss; a run's time to it is interpolated
between evaluations on its training clock (evaluation excluded, as the trainer measures). The CPU
time of the machine's other processes is recorded per run, and a run that shared the machine with
other work is run again. Writes <out>/time_to_loss.{json,md} and time_to_loss_<setting>.png.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path

from benchmarks.cluster import ClusterPlan, format_rate, run_training
from benchmarks.names import ACCO, DDP, ZERO1
from benchmarks.sweeps.common import DEFAULT_MODEL, QUIET, load, pyplot_or_none, save_figure
from benchmarks.sweeps.heterogeneous import measure_cpu
from benchmarks.sweeps.ttl_analysis import summarize, training_seconds, val_curve
from benchmarks.sweeps.ttl_report import report
from benchmarks.sweeps.ttl_strategies import LONGER_BUDGET, strategies
from torchacco import cost_model as cm
from torchacco.errors import UserError

VOCAB = 1024


def model_args(args, nodes: int, local_batch: int) -> list[str]:
    """GPT-Neo debug with a 1k-token vocabulary: small enough for hundreds of updates per run on 2 cores."""
    tokens = args.updates * nodes * local_batch * 2 * args.seq_len  # 2 micro-batches per rank and update
    return [
        *DEFAULT_MODEL,
        *QUIET,
        "--model.flavor", "debug",
        "--tokenizer.vocab_size", str(VOCAB),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(local_batch),
        "--training.global_batch_size", str(2 * nodes * local_batch),
        "--training.steps", str(10 * args.updates),  # the token budget stops the run
        "--training.max_tokens", str(tokens),
        "--lr_schedule.warmup_steps", str(max(1, args.updates // 20)),
        "--optimizer.lr", "3e-3",
        "--eval.every", str(args.eval_every),
        "--eval.batches", "4",
    ]  # fmt: skip


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (from /proc/stat)."""
    fields = [float(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(plan: ClusterPlan, train: list[str], folder: Path, timeout: float) -> dict:
    """One training run, with the CPU time other processes took meanwhile."""
    busy, ours, started = _busy_cpu_seconds(), _children_cpu_seconds(), time.perf_counter()
    load_before = load()
    result = run_training(plan, train, folder, timeout_s=timeout)
    wall = time.perf_counter() - started
    other = (_busy_cpu_seconds() - busy) - (_children_cpu_seconds() - ours)
    return {
        "records": result["records"],
        "wall_s": wall,
        "load_before": load_before,
        "other_cpu_share": max(0.0, other) / (wall * os.cpu_count()),
    }


def strategy_args(name: str, base: list[str]) -> list[str]:
    if name in LONGER_BUDGET:
        strategy, factor = LONGER_BUDGET[name]
        tokens = int(base[base.index("--training.max_tokens") + 1])
        return [*base, *strategies()[strategy], "--training.max_tokens", str(int(tokens * factor))]  # the last wins
    return [*base, *strategies()[name]]


def run_strategy(plan, name, base, seed, folder, args) -> dict:
    train = [*strategy_args(name, base), "--training.seed", str(seed)]
    for attempt in range(args.retries + 1):
        run = run_once(plan, train, folder, args.timeout)
        run["attempt"] = attempt
        if run["other_cpu_share"] <= args.max_other_cpu:
            break
        print(f"    other work took {run['other_cpu_share']:.0%} of the CPU during the run: again", flush=True)
    curve = val_curve(run["records"])
    print(
        f"  {name:<24} seed {seed}: val {curve[-1]['val_loss']:.4f} after {curve[-1]['tokens']:,} tokens, "
        f"{training_seconds(run['records']):.1f} s training, {run['records'][-1]['step']} updates "
        f"(other work {run['other_cpu_share']:.0%})",
        flush=True,
    )
    return run


def calibrate(args, base: list[str]) -> dict:
    """Compute per update of ZeRO-1, unshaped, and the link rate at which its job takes as long."""
    plan = ClusterPlan(nodes=2, rate_bps=None)
    calib = [*base, "--training.max_tokens", "0", "--training.steps", "30", "--eval.every", "0"]
    run = run_once(plan, [*calib, *strategies()[ZERO1]], Path(args.out) / "runs" / "ttl" / "calibrate", args.timeout)
    kept = run["records"][5:]
    compute = sorted(r["tokens_per_update"] / r["tokens_per_s"] * (1 - r["share_sync"]) for r in kept)
    c = compute[len(compute) // 2]
    params = cm.model_workload("gpt_neo", "debug", args.seq_len, args.local_batch, 2, vocab_size=VOCAB).params
    # ZeRO-1's job moves (W-1)/W of the fp32 buffer per rank twice (reduce-scatter, all-gather) per update.
    bits = 2 * 0.5 * 8 * 4 * params
    return {"compute_per_update_s": c, "params": params, "balance_bps": bits / c}


def setting_plans(args, calibration: dict) -> dict[str, tuple[ClusterPlan, int]]:
    balance = calibration["balance_bps"]
    plans = {
        "a": (ClusterPlan(nodes=2, rate_bps=balance), args.local_batch),
        "b": (ClusterPlan(nodes=2, rate_bps=balance / 3), args.local_batch),
        "c": (
            ClusterPlan(
                nodes=4, rate_bps=1e9, slow_node=3, slow_factor=args.slow_factor, cpu_per_node=args.cpu_per_node
            ),
            max(1, args.local_batch // 2),
        ),
    }
    return {k: v for k, v in plans.items() if k in args.settings}


def time_to_loss(args) -> dict:
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    known = [*strategies(), *LONGER_BUDGET]
    unknown = [s for s in chosen if s not in known] + [s for s in args.settings if s not in "abc"]
    if unknown:
        raise UserError(
            f"unknown strategy or setting {unknown[0]!r}; strategies: {', '.join(known)}; settings: a, b, c"
        )
    if DDP not in chosen:
        raise UserError("the target loss is DDP's: keep ddp in --strategies")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    started = time.perf_counter()
    previous = _previous(out, seeds) if args.resume else {"settings": {}}
    calibration = previous.get("calibration") or calibrate(args, model_args(args, 2, args.local_batch))
    print(f"[time-to-loss] ZeRO-1 computes {calibration['compute_per_update_s']:.3f} s per update; balance rate "
          f"{format_rate(calibration['balance_bps'])}", flush=True)  # fmt: skip
    ran = [*previous.get("strategies", []), *(s for s in chosen if s not in previous.get("strategies", []))]
    results = {"calibration": calibration, "settings": previous["settings"], "strategies": ran, "seeds": seeds}
    for name, (plan, local_batch) in setting_plans(args, calibration).items():
        setting = results["settings"].get(name)
        todo = [s for s in chosen if setting is None or s not in setting["curves"]]
        if not todo:
            print(f"[time-to-loss] setting {name}: kept from {out / 'time_to_loss.json'}", flush=True)
            continue
        if setting is None:
            setting = results["settings"][name] = _new_setting(plan, local_batch)
        print(f"[time-to-loss] setting {name}: {setting['plan']}", flush=True)
        base = model_args(args, plan.nodes, local_batch)
        runs = {s: [] for s in todo}
        for seed in seeds:  # seeds outermost: a drift of the machine spreads over every strategy alike
            for s in todo:
                folder = out / "runs" / "ttl" / name / f"{s}_s{seed}"
                run = run_strategy(plan, s, base, seed, folder, args)
                runs[s].append(run.pop("records"))
                setting["runs"].setdefault(s, []).append(run)
        setting["curves"].update({s: [val_curve(r) for r in rs] for s, rs in runs.items()})
        setting["job_s"].update({s: _mean_job_seconds(rs) for s, rs in runs.items()})
        if ZERO1 in runs:
            setting["zero1_compute_per_update_s"] = _compute_per_update(runs[ZERO1])
        setting["summary"] = summarize(setting["curves"])
        _plot(setting, name, out)
        _save(results, out)
    results["elapsed_s"] = time.perf_counter() - started
    _save(results, out)
    return results


def _new_setting(plan: ClusterPlan, local_batch: int) -> dict:
    note = ""
    if plan.slow_node is not None:
        rates = measure_cpu(plan)
        note = f"; measured slowdown {max(rates) / min(rates):.2f}×"
    return {
        "plan": plan.describe() + note,
        "nodes": plan.nodes,
        "rate_bps": plan.rate_bps,
        "local_batch": local_batch,
        "runs": {},
        "curves": {},
        "job_s": {},
        "zero1_compute_per_update_s": math.nan,
    }


def _previous(out: Path, seeds: list[int]) -> dict:
    """A partial sweep's results, to finish it with the same calibration (the settings' link rates):
    the settings and strategies it holds are kept, the rest are run."""
    path = out / "time_to_loss.json"
    if not path.exists():
        raise UserError(f"--resume: {path} does not exist; run without --resume to start a sweep")
    try:
        previous = json.loads(path.read_text())
        settings = previous["settings"].values()
        curves = [setting["curves"] for setting in settings]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(
            f"--resume: {path} is not a time-to-loss sweep's results (damaged or from another benchmark); "
            "move it away or run without --resume"
        ) from None
    if previous.get("seeds") != seeds:
        raise UserError(f"--resume: {path} holds seeds {previous.get('seeds')}, not {seeds}; pass --seeds to match")
    for setting, setting_curves in zip(settings, curves):  # summarised anew: the analysis may have changed since
        setting["summary"] = summarize(setting_curves)
    return previous


def _compute_per_update(runs: list[list[dict]]) -> float:
    """Seconds of forward and backward per update (the step less the time after the last micro-batch)."""
    values = [r["tokens_per_update"] / r["tokens_per_s"] * (1 - r["share_sync"]) for rs in runs for r in rs[3:]]
    return sum(values) / len(values) if values else math.nan


def _mean_job_seconds(runs: list[list[dict]]) -> float:
    values = [r["job_s"] for records in runs for r in records[3:] if "job_s" in r]
    return sum(values) / len(values) if values else math.nan


def _save(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_loss.json").write_text(json.dumps(results, indent=1, default=float))
    (out / "time_to_loss.md").write_text(report(results))


def _plot(setting: dict, name: str, out: Path) -> None:
    plt = pyplot_or_none()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for s, curves in setting["curves"].items():
        n = min(len(c) for c in curves)
        for ax, key in zip(axes, ("wall_s", "tokens")):
            xs = [sum(c[j][key] for c in curves) / len(curves) for j in range(n)]
            ys = [sum(c[j]["val_loss"] for c in curves) / len(curves) for j in range(n)]
            ax.plot(xs, ys, label=s, linewidth=1.6 if s.startswith(ACCO) else 1.0)
    target = setting["summary"]["target_val_loss"]
    for ax, label in zip(axes, ("training wall-clock (s)", "tokens")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (mean over seeds)")
    axes[0].set_title(f"setting {name}: {setting['plan'][:70]}", fontsize=9)
    axes[1].legend(fontsize=7)
    save_figure(fig, out / f"time_to_loss_{name}")
