"""DiLoCo against the synchronous strategies on the emulated cluster: time per update, and with the
loopback token-efficiency table, time to equal tokens and the loss there.

    .venv/bin/python -m benchmarks.diloco_speed [--updates 110] [--repeats 2] [--settings a,b]

Two nodes of one rank each (DiLoCo: one replica per node, no traffic inside a replica), the
token-efficiency benchmark's recipe (GPT-Neo debug, 1k vocabulary, seq 128, 16 sequences per update),
the links of the time-to-loss sweep's settings: (a) where ZeRO-1's exposed communication equals its
compute, (b) a third of that. Speed does not depend on the loss, so each run is short; loss at equal
tokens does not depend on the link, so it is read from `bench_results/diloco_token_efficiency.json`
(benchmarks/token_efficiency.py, 1,000 updates, 5 seeds). Needs root (network namespaces) and a
quiet machine. Writes bench_results/diloco_speed.{json,md,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from benchmarks.acco_reference import recipe
from benchmarks.cluster import ClusterPlan, format_rate, run_training
from benchmarks.names import ACCO, DDP, FSDP, ZERO1
from benchmarks.token_efficiency import QUIET, VARIANTS, machine

ROOT = Path(__file__).resolve().parents[1]
BASELINES = (DDP, ZERO1, FSDP)
STRATEGIES = {**{name: VARIANTS.get(name, ["--parallelism.data_parallel", name]) for name in (*BASELINES, ACCO)},
              **{name: VARIANTS[name] for name in ("diloco_h10", "diloco_h50", "streaming_h50")}}  # fmt: skip
WARMUP = 10  # updates left out of the timing


def seconds_per_update(records: list[dict]) -> float:
    """Mean time of the updates after warm-up (each record's tokens over its rate: its own time, as the
    trainer restarts its clock after every logged update)."""
    kept = records[WARMUP:]
    return sum(r["tokens_per_update"] / r["tokens_per_s"] for r in kept) / len(kept)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.diloco_speed", description=__doc__)
    parser.add_argument("--updates", type=int, default=110)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--settings", default="a,b")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    out = ROOT / args.out
    balance = json.loads((out / "time_to_loss.json").read_text())["calibration"]["balance_bps"]
    rates = {"a": balance, "b": balance / 3}
    efficiency = out / "diloco_token_efficiency.json"
    gaps = json.loads(efficiency.read_text())["summary"] if efficiency.exists() else {}
    results = {}
    for setting in args.settings.split(","):
        plan = ClusterPlan(nodes=2, rate_bps=rates[setting])
        rows = results[setting] = {"rate": format_rate(rates[setting]), "strategies": {}}
        for name in args.strategies.split(","):
            times = []
            for repeat in range(args.repeats):
                train = [*recipe(args.updates, 1.5e-3, repeat), *QUIET, *STRATEGIES[name], "--eval.every", "0"]
                train += ["--training.max_tokens", "0", "--training.steps", str(args.updates)]
                run = run_training(plan, train, out / "runs" / "diloco_speed" / f"{setting}_{name}_{repeat}")
                times.append(seconds_per_update(run["records"]))
                print(f"[diloco-speed] {setting} {name} #{repeat}: {times[-1]:.4f} s per update", flush=True)
            rows["strategies"][name] = {"seconds_per_update": times, "mean": statistics.fmean(times)}
        best = min(BASELINES, key=lambda b: rows["strategies"].get(b, {"mean": float("inf")})["mean"])
        rows["best_baseline"] = best
        for name, row in rows["strategies"].items():
            row["speedup_vs_best_baseline"] = rows["strategies"][best]["mean"] / row["mean"]
            row["gap_pct"] = next((lr_rows[name]["mean_gap_pct"] for lr_rows in gaps.values() if name in lr_rows), None)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(),
            "command": "python -m benchmarks.diloco_speed " + " ".join(argv or sys.argv[1:])}  # fmt: skip
    (out / "diloco_speed.json").write_text(json.dumps({"meta": meta, "settings": results}, indent=1))
    (out / "diloco_speed.md").write_text(markdown(results, meta))
    plot(results, out / "diloco_speed.png")
    print(markdown(results, meta))
    return 0


def markdown(results: dict, meta: dict) -> str:
    lines = [
        "# DiLoCo on the emulated cluster: time per update, and the loss at equal tokens",
        "",
        f"{meta['date']}, {meta['machine']}, 2 nodes of one rank each (network namespaces, `tc tbf`).",
        f"Command: `{meta['command']}`. Loss gaps: `bench_results/diloco_token_efficiency.md` (loopback, 1,000 "
        "updates, 5 seeds, lr 1.5e-3, paired with DDP).",
        "",
    ]
    for setting, rows in results.items():
        lines += [
            f"## Setting {setting}: links {rows['rate']}",
            "",
            f"Best synchronous baseline: {rows['best_baseline']}.",
            "",
            "| strategy | s per update (repeats) | speed vs best baseline | val loss vs ddp at equal tokens (%) |",
            "|---|---|---:|---:|",
        ]
        for name, row in rows["strategies"].items():
            each = ", ".join(f"{t:.4f}" for t in row["seconds_per_update"])
            gap = "—" if row["gap_pct"] is None else f"{row['gap_pct']:+.2f}"
            lines.append(f"| {name} | {row['mean']:.4f} ({each}) | {row['speedup_vs_best_baseline']:.2f}× | {gap} |")
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (setting, rows) in zip(axes[0], results.items()):
        names = list(rows["strategies"])
        ax.barh(names, [rows["strategies"][n]["speedup_vs_best_baseline"] for n in names])
        ax.axvline(1.0, color="grey", lw=0.5)
        ax.set(title=f"setting {setting}: {rows['rate']}", xlabel="updates per second vs the best baseline")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
