"""Each rank's CPU per update on the emulated cluster, set against its compute: where a rank on a share of a core
spends it.

    sudo .venv/bin/python -m benchmarks.cpu_per_update --settings c --strategies zero1,zero1_balanced,ddp

For each setting and strategy, two runs as `benchmarks.speed` makes them, of --short and --long updates. A rank's CPU
time (every thread: compute, communication, the trainer's own work) of the long run less the short one's, over the
updates between, is its CPU per update (start-up cancels); its wall time per update is differenced the same way.
Its micro-batches per update times the compute of one micro-batch probed at its cores (as CPU: the probe's time ×
the cores; `bench_results/cost_model_probes.json`, `benchmarks.cost_model_check --probe`) is its compute; the rest
is what it spends beyond compute. Needs root and a quiet machine. Writes bench_results/<--name>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

from benchmarks.acco_reference import recipe
from benchmarks.cluster import ClusterError, run_training
from benchmarks.cost_model_check import cores_per_rank, seconds_per_token_at
from benchmarks.cost_model_probes import PROBES, compute_inputs, trainer_config
from benchmarks.names import DDP, ZERO1
from benchmarks.speed import STRATEGIES, plans
from benchmarks.sweeps.common import mean_lists, panels, save_figure, write_report
from benchmarks.token_efficiency import QUIET, machine
from torchacco.errors import UserError, run_cli

ROOT = Path(__file__).resolve().parents[1]


def probed_inputs(out: Path) -> dict:
    """The compute probes as the cost-model check reads them: seconds per token on one core and at each quota."""
    probes = json.loads((out / PROBES).read_text())
    params = 1.0  # unused here
    inputs = compute_inputs(probes["compute_per_update_s"], params)
    inputs["seconds_per_token_at_cores"] = {
        cores: compute_inputs(s, params)["seconds_per_token"]
        for cores, s in probes.get("compute_per_update_s_at_cores", {}).items()
    }
    return inputs


def per_rank(short: dict, long: dict, updates: int, cores: list[float], tokens: float, inputs: dict) -> list[dict]:
    """Each rank's CPU and wall time per update from two runs' reports, and its compute at its node's cores."""
    # the mean micro-batches per rank over the long run (a balanced split can change), where the records count every
    # rank (a DiLoCo replica's count only its own): else the compute is not set against
    counts = mean_lists([r.get("micro_batches_per_rank") for r in long["records"]])
    world = len(long["ranks"])
    micro_batches = counts if counts and len(counts) == world else None
    rows = []
    for a, b in zip(sorted(short["ranks"], key=lambda r: r["rank"]), sorted(long["ranks"], key=lambda r: r["rank"])):
        share = cores[b["node"]]
        cpu = (b["cpu_user_s"] + b["cpu_sys_s"] - a["cpu_user_s"] - a["cpu_sys_s"]) / updates
        wall = (b["wall_s"] - a["wall_s"]) / updates
        mb = None if micro_batches is None else micro_batches[b["rank"]]
        compute = None if mb is None else mb * seconds_per_token_at(share, inputs) * tokens * share
        rows.append({"rank": b["rank"], "node": b["node"], "cores": share, "micro_batches": mb, "cpu_s": cpu,
                     "wall_s": wall, "compute_cpu_s": compute,
                     "beyond_compute_s": None if compute is None else cpu - compute,
                     "cpu_share": cpu / wall if wall > 0 else None})  # fmt: skip
    return rows


def markdown(results: dict, meta: dict) -> str:
    lines = [
        "# Each rank's CPU per update on the emulated cluster, against its compute",
        "",
        f"{meta['date']}, {meta['machine']}. Command: `{meta['command']}`. Runs of {meta['short']} and {meta['long']} "
        "updates, differenced; compute from the probes in `cost_model_probes.json` (as CPU: the probed time at the "
        "rank's cores × those cores).",
    ]
    for setting, strategies in results.items():
        for name, rows in strategies.items():
            lines += ["", f"## {setting}, {name}", "",
                      "| rank | cores | micro-batches per update | CPU per update (ms) | of it compute, probed (ms) | "
                      "beyond compute (ms) | wall per update (ms) | CPU over wall |",
                      "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
            for r in rows:
                compute = "—" if r["compute_cpu_s"] is None else f"{1e3 * r['compute_cpu_s']:.1f}"
                beyond = "—" if r["beyond_compute_s"] is None else f"{1e3 * r['beyond_compute_s']:.1f}"
                share = "—" if r["cpu_share"] is None else f"{r['cpu_share']:.3f}"
                mb = "—" if r["micro_batches"] is None else f"{r['micro_batches']:g}"
                lines.append(f"| {r['rank']} | {r['cores']:g} | {mb} | {1e3 * r['cpu_s']:.1f} | "
                             f"{compute} | {beyond} | {1e3 * r['wall_s']:.1f} | {share} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cpu_per_update", description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="c")
    parser.add_argument("--strategies", default=f"{ZERO1},{ZERO1}_balanced,{DDP}")
    parser.add_argument("--short", type=int, default=8, help="updates of the short run")
    parser.add_argument("--long", type=int, default=38, help="updates of the long run")
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", default="cpu_per_update")
    args = parser.parse_args(argv)
    if not 0 < args.short < args.long:
        parser.error(f"--short {args.short} and --long {args.long}: need 0 < short < long (their difference is timed)")
    out = ROOT / args.out
    settings, names = args.settings.split(","), args.strategies.split(",")
    try:
        plan_of = plans(out)
    except (OSError, KeyError, ValueError) as e:
        parser.error(f"cannot read the settings' calibration in {out / 'time_to_loss.json'} ({e})")
    for setting in settings:
        if setting not in plan_of:
            parser.error(f"--settings: unknown setting {setting!r}; one of {', '.join(plan_of)}")
    for name in names:
        if name not in STRATEGIES:
            parser.error(f"--strategies: unknown strategy {name!r}; one of {', '.join(STRATEGIES)}")
    try:
        inputs = {**probed_inputs(out), "cores": os.cpu_count()}
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"cannot read the compute probes in {out / PROBES} ({e}): run python -m "
                     "benchmarks.cost_model_check --probe first (root, a quiet machine)")  # fmt: skip
    results = {}
    for setting in settings:
        plan, extra = plan_of[setting]
        cores = cores_per_rank(plan, inputs["cores"])
        for name in names:
            runs = []
            for updates in (args.short, args.long):
                train = [*recipe(updates, 1.5e-3, 0), *QUIET, *STRATEGIES[name], "--eval.every", "0"]
                train += ["--training.max_tokens", "0", "--training.steps", str(updates), *extra]
                try:
                    runs.append(
                        run_training(plan, train, out / "runs" / "cpu_per_update" / f"{setting}_{name}_{updates}")
                    )
                except ClusterError as e:
                    raise UserError(f"cpu_per_update: {setting} {name}, {updates} updates: {e}") from None
            if sorted(r["rank"] for r in runs[0]["ranks"]) != sorted(r["rank"] for r in runs[1]["ranks"]):
                raise UserError(f"cpu_per_update: {setting} {name}: the two runs' per-rank reports name different "
                                f"ranks; see {out / 'runs' / 'cpu_per_update'}")  # fmt: skip
            t = trainer_config([*STRATEGIES[name], *extra]).training  # the micro-batch as run
            tokens = t.local_batch_size * t.seq_len
            rows = per_rank(*runs, args.long - args.short, cores, tokens, inputs)
            results.setdefault(setting, {})[name] = rows
            print(f"[cpu] {setting} {name}: " + ", ".join(f"rank {r['rank']} {1e3 * r['cpu_s']:.1f} ms" for r in rows))
    command = "python -m benchmarks.cpu_per_update " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "short": args.short, "long": args.long,
            "command": command}  # fmt: skip
    write_report(out, args.name, {"meta": meta, "results": results}, markdown(results, meta),
                 lambda path: plot(results, path))  # fmt: skip
    return 0


def plot(results: dict, path: Path) -> None:
    runs = [(f"{setting} {name}", rows) for setting, strategies in results.items() for name, rows in strategies.items()]
    drawn = panels(len(runs))
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (title, rows) in zip(axes, runs):
        ranks = [str(r["rank"]) for r in rows]
        compute = [1e3 * (r["compute_cpu_s"] or 0.0) for r in rows]
        ax.bar(ranks, compute, label="compute (probed)")
        ax.bar(ranks, [1e3 * r["cpu_s"] - c for r, c in zip(rows, compute)], bottom=compute, label="beyond compute")
        ax.set(title=title, xlabel="rank", ylabel="CPU per update (ms)")
        ax.legend(fontsize=7)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(run_cli(main))
