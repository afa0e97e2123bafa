"""Speed on the emulated cluster: time per update of each strategy per setting, from short runs after
warm-up, with repeats; with the loopback token-efficiency tables, the loss at equal tokens beside it.

    .venv/bin/python -m benchmarks speed [--updates 110] [--repeats 2] [--settings a,b,c]

The token-efficiency benchmark's recipe (GPT-Neo debug, 1k vocabulary, seq 128, 16 sequences per
update), on the time-to-target settings: (a) 2 nodes of one rank at the link rate where
ZeRO-1's exposed communication equals its compute, (b) a third of that rate, (c) 4 nodes at 1 Gbit/s
with 0.45 cores each, one at a quarter of that (micro-batches of one sequence, so a balanced split
has 4 per rank to move). DiLoCo runs one replica per node in (a) and (b). Speed does not depend on
the loss, so each run is short; loss at equal tokens does not depend on the link, so it is read from
`bench_results/*token_efficiency*.json` (benchmarks/token_efficiency.py, 1,000 updates, 5 seeds).
Needs root (network namespaces) and a quiet machine. Writes bench_results/speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
from pathlib import Path

from benchmarks.acco_reference import recipe
from benchmarks.cluster import ClusterPlan, run_training
from benchmarks.cluster.plan import CFS_PERIOD_US, CPU_PERIOD_HELP, ClusterError, period_us
from benchmarks.names import ACCO, DDP, FSDP, HSDP, ZERO1
from benchmarks.sweeps.common import panels, save_figure, write_report
from benchmarks.token_efficiency import QUIET, VARIANTS, machine

ROOT = Path(__file__).resolve().parents[1]
BASELINES = (DDP, ZERO1, FSDP, HSDP)
BALANCE = ["--parallelism.balance_batches", "true"]
STREAMING = "streaming_h10_avg"  # the DiLoCo variant with the least time to DDP's loss (docs/diloco.md)
STRATEGIES = {
    **{name: VARIANTS.get(name, ["--parallelism.data_parallel", name]) for name in (*BASELINES, ACCO)},
    **{name: VARIANTS[name] for name in ("diloco_h10", "diloco_h50", "streaming_h50", "diloco_h10_avg")},
    STREAMING: VARIANTS[STREAMING],
    # Streaming DiLoCo across nodes with ZeRO-1 or ACCO over each node's ranks (settings a2, b2)
    **{f"{STREAMING}_{inner}": [*VARIANTS[STREAMING], "--parallelism.data_parallel", inner] for inner in (ZERO1, ACCO)},
    # mixed replicas: a replica runs as many of a period's H inner updates as fit in the fastest one's time
    **{f"{v}_balanced": [*VARIANTS[v], "--diloco.balance_replicas", "true"] for v in ("diloco_h50", "diloco_h10_avg")},
    f"{DDP}_balanced": ["--parallelism.data_parallel", DDP, *BALANCE],
    # every gradient bucket 25 MiB (a set cap): this model's gradients in one bucket, all-reduced after the backward
    f"{DDP}_one_bucket": ["--parallelism.data_parallel", DDP, "--parallelism.bucket_cap_mb", "25"],
    f"{ZERO1}_balanced": ["--parallelism.data_parallel", ZERO1, *BALANCE],
    f"{ACCO}_balanced": ["--parallelism.data_parallel", ACCO, "--acco.mode", "balanced"],
}
PER_SETTING = {  # the strategies each setting runs by default
    "a": [DDP, ZERO1, FSDP, ACCO, "diloco_h10_avg", STREAMING],
    "b": [DDP, ZERO1, FSDP, ACCO, "diloco_h10_avg", STREAMING],
    "a2": [DDP, ZERO1, HSDP, ACCO, STREAMING, f"{STREAMING}_{ZERO1}", f"{STREAMING}_{ACCO}"],
    "b2": [DDP, ZERO1, HSDP, ACCO, STREAMING, f"{STREAMING}_{ZERO1}", f"{STREAMING}_{ACCO}"],
    "c": [
        DDP,
        f"{DDP}_balanced",
        ZERO1,
        f"{ZERO1}_balanced",
        ACCO,
        f"{ACCO}_balanced",
        "diloco_h50",
        "diloco_h50_balanced",
    ],
}
WARMUP = 10  # updates left out of the timing
TOKENS_PER_UPDATE = 16 * 128  # the recipe's global batch: an update of every strategy but mixed replicas


def seconds_per_token(records: list[dict], warmup: int = WARMUP) -> float:
    kept = records[warmup:]
    return sum(1 / r["tokens_per_s"] * r["tokens_per_update"] for r in kept) / sum(r["tokens_per_update"] for r in kept)


def seconds_per_update(records: list[dict], warmup: int = WARMUP) -> float:
    """Mean time of the updates after warm-up (each record's tokens over its rate: its own time, as the
    trainer restarts its clock after every logged update)."""
    kept = records[warmup:]
    return sum(r["tokens_per_update"] / r["tokens_per_s"] for r in kept) / len(kept)


def compute_s(record: dict) -> float:
    """A logged update's seconds before its sync: data, forward and backward (`share_sync` is the rest)."""
    return record["tokens_per_update"] / record["tokens_per_s"] * (1 - record["share_sync"])


def warmup_of(name: str) -> int:
    """The updates of a label's run left out of its timing: DiLoCo's from the second period on (mixed replicas run
    the first one unmeasured, as fixed H)."""
    return WARMUP + 50 if name.startswith(("diloco", "streaming")) else WARMUP


def timed_run(plan: ClusterPlan, train: list[str], folder: Path, resume: bool) -> list[dict]:
    """One speed run's records; with `resume`, those of a finished run with the same arguments on the same plan."""
    shape = {k: v for k, v in dataclasses.asdict(plan).items() if k not in ("prefix", "subnet")}  # names, per call
    kept, plan_text = folder / "speed_run.json", json.dumps(shape, sort_keys=True)
    if resume and kept.exists():
        saved = json.loads(kept.read_text())
        if saved.get("args") == train and saved.get("plan") == plan_text:
            return saved["records"]
    records = run_training(plan, train, folder)["records"]
    kept.write_text(json.dumps({"args": train, "plan": plan_text, "records": records}))
    return records


CALIBRATION_HELP = "the file under --out whose 'calibration' sets the link rates of settings a and b (without .json)"


def plans(out: Path, calibration: str = "time_to_loss") -> dict[str, tuple[ClusterPlan, list[str]]]:
    """The settings: setting -> (the cluster, the trainer arguments it adds). The link rates of a and b follow the
    calibration's balance rate (ZeRO-1's job as long as its compute), measured on the machine by the time-to-target
    benchmark (`time_to_loss`: the one saved by the former time-to-loss sweep)."""
    path = out / f"{calibration}.json"
    try:
        balance = json.loads(path.read_text())["calibration"]["balance_bps"]
    except (OSError, ValueError, KeyError, TypeError):
        raise ClusterError(f"no calibration in {path}: run `python -m benchmarks time-to-target` "
                           "first, which measures it") from None  # fmt: skip
    return {
        "a": (ClusterPlan(nodes=2, rate_bps=balance), []),
        "b": (ClusterPlan(nodes=2, rate_bps=balance / 3), []),
        # micro-batches of one sequence; 8 evaluation batches per rank read the recipe's 32 validation windows
        "c": (ClusterPlan(nodes=4, rate_bps=1e9, slow_node=3, slow_factor=4.0, cpu_per_node=0.45),
              ["--training.local_batch_size", "1", "--eval.batches", "8"]),
        # (a) and (b) with 2 ranks per node: the inner strategy's traffic stays on the node, the outer sync
        # crosses the shaped link; micro-batches of 2 so that ACCO's two periods fit 16 sequences on 4 ranks
        "a2": (ClusterPlan(nodes=2, ranks_per_node=2, rate_bps=balance), ["--training.local_batch_size", "2"]),
        "b2": (ClusterPlan(nodes=2, ranks_per_node=2, rate_bps=balance / 3), ["--training.local_batch_size", "2"]),
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks speed", description=__doc__)
    parser.add_argument("--updates", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", default="a,b")
    parser.add_argument("--strategies", default="", help=f"from {', '.join(STRATEGIES)}; default: per setting")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", default="speed", help="the results' file name (without suffix)")
    parser.add_argument(
        "--no-slow-start-after-idle",
        action="store_true",
        help="set net.ipv4.tcp_slow_start_after_idle = 0 on every node (Linux's default is 1)",
    )
    parser.add_argument("--cpu-period-ms", type=float, default=CFS_PERIOD_US / 1000, help=CPU_PERIOD_HELP)
    parser.add_argument("--resume", action="store_true", help="keep the runs a previous call finished with the same "
                        "arguments on the same cluster plan; run the rest")  # fmt: skip
    parser.add_argument("--calibration", default="time_to_loss", help=CALIBRATION_HELP)
    args = parser.parse_args(argv)
    out = ROOT / args.out
    try:
        plan_of = plans(out, args.calibration)
    except ClusterError as e:
        parser.error(str(e))
    for setting in args.settings.split(","):
        if setting not in plan_of:
            parser.error(f"--settings: unknown setting {setting!r}; one of {', '.join(plan_of)}")
        plan, extra = plan_of[setting]
        try:
            plan = dataclasses.replace(plan, tcp_slow_start_after_idle=not args.no_slow_start_after_idle,
                                       cpu_period_us=period_us(args.cpu_period_ms))  # fmt: skip
        except ClusterError as e:
            parser.error(f"setting {setting}: {e}")
        plan_of[setting] = plan, extra
        for name in args.strategies.split(",") if args.strategies else PER_SETTING[setting]:
            if name not in STRATEGIES:
                parser.error(f"--strategies: unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
            if args.updates <= warmup_of(name):
                parser.error(f"--updates {args.updates} leaves no timed update for {name} (its first "
                             f"{warmup_of(name)} are warm-up); use at least {warmup_of(name) + 1}")  # fmt: skip
    gaps = {}  # variant -> (gap %, lr): at DDP's best lr (3e-3) where measured over 5 seeds, else at 1.5e-3
    for lr_wanted in ("0.0015", "0.003"):
        for table in sorted(out.glob("*token_efficiency*.json")) + sorted(out.glob("diloco_budgets*.json")):
            data = json.loads(table.read_text())
            meta = data.get("meta", {})
            if meta.get("updates", 0) < 1000 or len(meta.get("seeds", [])) < 5:  # shorter runs, screens
                continue
            if meta.get("model", "GPT-Neo debug") != "GPT-Neo debug":  # the speed runs train the debug model
                continue
            rows = data.get("summary", {}).get(lr_wanted, {})
            gaps |= {name: (row["mean_gap_pct"], lr_wanted) for name, row in rows.items() if "mean_gap_pct" in row}
    results = {}
    for setting in args.settings.split(","):
        plan, extra = plan_of[setting]
        rows = results[setting] = {"plan": plan.describe(), "strategies": {}}
        for name in args.strategies.split(",") if args.strategies else PER_SETTING[setting]:
            times, token_times = [], []
            for repeat in range(args.repeats):
                train = [*recipe(args.updates, 1.5e-3, repeat), *QUIET, *STRATEGIES[name], "--eval.every", "0"]
                train += ["--training.max_tokens", "0", "--training.steps", str(args.updates), *extra]
                if "--diloco.balance_replicas" in STRATEGIES[name]:  # its clock is in tokens: the recipe's
                    train += ["--training.max_tokens", str(args.updates * TOKENS_PER_UPDATE)]
                records = timed_run(plan, train, out / "runs" / "speed" / f"{setting}_{name}_{repeat}", args.resume)
                warmup = warmup_of(name)
                times.append(seconds_per_update(records, warmup))
                token_times.append(seconds_per_token(records, warmup) * TOKENS_PER_UPDATE)
                print(f"[speed] {setting} {name} #{repeat}: {times[-1]:.4f} s per update", flush=True)
            # "mean": seconds per recipe update's tokens (16 × 128), the time per update of all but mixed replicas
            rows["strategies"][name] = {"seconds_per_update": times, "seconds_per_recipe_update": token_times,
                                        "mean": statistics.fmean(token_times)}  # fmt: skip
        ran = rows["strategies"]
        synchronous = [n for n in ran if n.removesuffix("_balanced") in BASELINES]  # balanced ones included
        best = min(synchronous, key=lambda n: ran[n]["mean"])
        rows["best_baseline"] = best
        for name, row in ran.items():
            row["speedup_vs_best_baseline"] = ran[best]["mean"] / row["mean"]
            plain = name.removesuffix("_balanced")
            row["speedup_vs_unbalanced"] = ran[plain]["mean"] / row["mean"] if plain != name and plain in ran else None
            # Balanced batches do not change the update; mixed replicas do (its gap is not measured yet)
            row["gap_pct"] = gaps.get(name if name.startswith("diloco") else plain)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(),
            "command": "python -m benchmarks speed " + " ".join(sys.argv[1:] if argv is None else argv)}  # fmt: skip
    data = {"meta": meta, "settings": results}
    write_report(out, args.name, data, markdown(results, meta), lambda path: plot(results, path))
    return 0


def markdown(results: dict, meta: dict) -> str:
    lines = [
        "# Speed on the emulated cluster: time per update, and the loss at equal tokens",
        "",
        f"{meta['date']}, {meta['machine']}; network namespaces, `tc tbf`, CPU quotas; one rank per node unless "
        "the setting says more.",
        f"Command: `{meta['command']}`. Loss gaps at equal tokens: `bench_results/*token_efficiency*.md` (loopback, "
        "1,000 updates, 5 seeds, paired with DDP at the lr named, 3e-3 where measured (DDP's best), else 1.5e-3; a "
        "balanced variant computes its strategy's update).",
        "",
    ]
    for setting, rows in results.items():
        lines += [
            f"## Setting {setting}: {rows['plan']}",
            "",
            f"Best synchronous baseline (balanced ones included): {rows['best_baseline']}.",
            "",
            "| strategy | s per update's tokens (repeats) | speed vs best baseline | vs its unbalanced self "
            "| val loss vs ddp at equal tokens (%) |",
            "|---|---|---:|---:|---:|",
        ]
        for name, row in rows["strategies"].items():
            each = ", ".join(f"{t:.4f}" for t in row.get("seconds_per_recipe_update", row["seconds_per_update"]))
            gap = "—" if row["gap_pct"] is None else f"{row['gap_pct'][0]:+.2f} (lr {float(row['gap_pct'][1]):g})"
            self_ = "" if row["speedup_vs_unbalanced"] is None else f"{row['speedup_vs_unbalanced']:.2f}×"
            lines.append(
                f"| {name} | {row['mean']:.4f} ({each}) | {row['speedup_vs_best_baseline']:.2f}× | {self_} | {gap} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    drawn = panels(len(results))
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (setting, rows) in zip(axes, results.items()):
        names = list(rows["strategies"])
        ax.barh(names, [rows["strategies"][n]["speedup_vs_best_baseline"] for n in names])
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set(title=f"setting {setting}", xlabel="updates per second vs the best baseline")
    save_figure(fig, path)


if __name__ == "__main__":  # the old form: one line naming `python -m benchmarks <command>`
    from benchmarks.cli import moved

    raise SystemExit(moved(__spec__.name))
