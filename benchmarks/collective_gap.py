"""Does a collective take longer after compute than back to back? The sharded job's rings timed on the emulated
cluster three ways: right after a barrier (as `cost_model_check --probe` times them), after an idle period of
one update's compute, and after that long of matmuls on every rank (as in a training step).

    sudo .venv/bin/python -m benchmarks.collective_gap [--settings a,b] [--repeats 7]

Buffer: the recipe model's parameters, fp32 (`bench_results/time_to_loss.json`'s calibration); the gap is the
compute per update that `cost_model_check --probe` measured (`bench_results/cost_model_probes.json`). Each time
is the median over the repeats, and is given over the ring ideal ((W - 1)/W of the buffer per rank at the link
rate). Needs root and a quiet machine. Writes bench_results/<--name>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from benchmarks.cluster import probe_collectives
from benchmarks.speed import plans
from benchmarks.token_efficiency import machine

ROOT = Path(__file__).resolve().parents[1]
GAPS = ("none", "sleep", "compute")
RINGS = ("ring_reduce_scatter", "ring_all_gather")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collective_gap", description=__doc__)
    parser.add_argument("--settings", default="a,b")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_results")
    parser.add_argument("--name", default="collective_gap")
    args = parser.parse_args(argv)
    out = ROOT / args.out
    settings = plans(out)
    for name in args.settings.split(","):
        if name not in settings or settings[name][0].ranks_per_node != 1 or settings[name][0].rate_bps is None:
            parser.error(f"--settings: {name!r} is not a setting of one-rank nodes on shaped links (e.g. a, b)")
    params = int(json.loads((out / "time_to_loss.json").read_text())["calibration"]["params"])
    gap_s = json.loads((out / "cost_model_probes.json").read_text())["compute_per_update_s"]
    results = {}
    for name in args.settings.split(","):
        plan = settings[name][0]
        ideal_s = (plan.nodes - 1) / plan.nodes * params * 4 * 8 / plan.rate_bps
        results[name] = {"plan": plan.describe(), "ideal_s": ideal_s, "gaps": {}}
        for gap in GAPS:
            extra = ["--repeats", str(args.repeats), "--gap", gap, "--gap-s", str(gap_s), "--ops", ",".join(RINGS)]
            probed = probe_collectives(plan, out / "runs" / args.name / name / gap, params, extra=extra)
            results[name]["gaps"][gap] = {ring: probed[f"{ring}_s"] / ideal_s for ring in RINGS}
            print(f"[collective-gap] {name} {gap}: {results[name]['gaps'][gap]}", flush=True)
    command = "python -m benchmarks.collective_gap " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command.strip(),
            "params": params, "gap_s": gap_s, "repeats": args.repeats}  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "settings": results}, indent=2) + "\n")
    lines = [
        "# The sharded job's rings after a gap: time over the ring ideal (median)",
        "",
        f"{meta['date']}, {meta['machine']}; {params:,} fp32 parameters, gap {gap_s:.4f} s, {args.repeats} repeats.",
        f"Command: `{meta['command']}`",
        "",
        "| setting | ring ideal (s) | gap | reduce-scatter | all-gather |",
        "|---|---:|---|---:|---:|",
    ]
    for name, row in results.items():
        for gap, ratios in row["gaps"].items():
            rs, ag = (ratios[ring] for ring in RINGS)
            lines.append(f"| {name}: {row['plan']} | {row['ideal_s']:.4f} | {gap} | {rs:.2f} | {ag:.2f} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
