"""What the per-update preemption agreement costs on the emulated cluster (needs root).

    sudo .venv/bin/python -m benchmarks.preemption_agreement [--rate-mbit 114]

Two nodes over a shaped link; each update is a sleep (the compute) and then the agreement, with the
link idle or busy with an all-reduce on another group (a DiLoCo outer step or an ACCO job in flight).
`sync` waits for the agreement's all-reduce at once; `async` (torchacco's) reads the one started at
the previous boundary. Writes bench_results/preemption_agreement.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from benchmarks.cluster.launch import run_nodes
from benchmarks.cluster.plan import ClusterPlan
from benchmarks.token_efficiency import machine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate-mbit", type=float, default=114.0, help="per link and direction")
    parser.add_argument("--updates", type=int, default=40)
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    folder = out / "runs" / "preemption_agreement"
    plan = ClusterPlan(nodes=2, rate_bps=args.rate_mbit * 1e6)
    probe = ["--updates", str(args.updates), "--compute-s", str(args.compute_s)]
    run_nodes(plan, "benchmarks.workers.agreement_probe", probe, folder, timeout_s=900, port=29455)
    raw = json.loads((folder / "agreement.json").read_text())
    when = datetime.date.today().isoformat()
    command = " ".join(["sudo .venv/bin/python -m benchmarks.preemption_agreement", *(argv or sys.argv[1:])])
    rows = {}
    for link in ("idle", "busy"):
        for mode in ("sync", "async"):
            costs = raw[f"{link}_{mode}_s"][1:]  # the first update has nothing to read yet
            rows[f"{link}_{mode}"] = {
                "median_ms": 1e3 * statistics.median(costs),
                "max_ms": 1e3 * max(costs),
                "mean_share_of_update": statistics.mean(costs) / (args.compute_s + statistics.mean(costs)),
            }
    report = {"date": when, "machine": machine(), "command": command, "rate_mbit": args.rate_mbit, "raw": raw,
              "rows": rows}  # fmt: skip
    (out / "preemption_agreement.json").write_text(json.dumps(report, indent=1))
    lines = [
        "# The preemption agreement's cost per update",
        "",
        f"{when}, {machine()}; 2 emulated nodes at {args.rate_mbit:g} Mbit/s; {args.updates} updates of "
        f"{args.compute_s * 1e3:g} ms compute; the busy link carries {raw['transfer_bytes'] / 1e6:g} MB all-reduces "
        f"on another group (busy throughout: {raw.get('busy_throughout')}).",
        f"Command: `{command}`",
        "",
        "| link | agreement | median ms | max ms | share of the update |",
        "|---|---|---|---|---|",
        *(
            f"| {k.split('_')[0]} | {k.split('_')[1]} | {r['median_ms']:.2f} | {r['max_ms']:.1f} | "
            f"{100 * r['mean_share_of_update']:.1f}% |"
            for k, r in rows.items()
        ),
    ]
    (out / "preemption_agreement.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
