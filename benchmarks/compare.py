"""Run training variants side by side and compare throughput as ratios.

    python -m benchmarks compare --config train_configs/default.toml --steps 30 \\
        --variant zero1 "--parallelism.data_parallel zero1" \\
        --variant acco  "--parallelism.data_parallel acco" \\
        --comm-delay-ms 100 --out bench_results/zero1_vs_acco

Each variant runs on --nproc processes as run_train.sh launches them, its first --warmup logged steps dropped;
--comm-delay-ms is workers/delayed_train.py's benchmark-only delay. Prints a table; writes <out>.json and <out>.md.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.cluster.launch import summarize
from benchmarks.common import ROOT, bare_parser, records, write_report

QUIET = ["--metrics.log_every", "1", "--metrics.progress_bar", "false", "--metrics.tensorboard", "false"]


def run_variant(config: str, overrides: list[str], steps: int, folder: Path, nproc: int, delay_ms: float) -> list[dict]:
    args = ["--config", config, "--training.steps", str(steps), *QUIET, "--eval.every", "0", "--job.dump_folder",
            str(folder), *overrides]  # fmt: skip
    env = {**os.environ, "TORCHACCO_BENCH_COMM_DELAY_MS": str(delay_ms)}
    subprocess.run([sys.executable, "-m", "torchacco.validate", *args], check=True, cwd=ROOT,
                   env={**env, "WORLD_SIZE": str(nproc)})  # fmt: skip
    cmd = [sys.executable, "-m", "torchacco.launch", "--standalone", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "-m", "benchmarks.workers.delayed_train", *args]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"variant failed: {' '.join(overrides)}")
    return records(folder)


def main(argv=None) -> int:
    parser = bare_parser("compare", __doc__)
    parser.add_argument("--config", default="train_configs/default.toml")
    parser.add_argument("--variant", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC", 2)))
    parser.add_argument("--comm-delay-ms", type=float, default=0.0,
                        help="BENCHMARK ONLY: artificial delay before each sharded-job collective")  # fmt: skip
    parser.add_argument("--out", default="bench_results/compare")
    args = parser.parse_args(argv)
    out, results = Path(args.out), {}
    for name, overrides in args.variant:
        started = time.perf_counter()
        folder = out.parent / "runs" / out.name / name
        logged = run_variant(args.config, shlex.split(overrides), args.steps, folder, args.nproc, args.comm_delay_ms)
        results[name] = {"overrides": overrides, **summarize(logged, args.warmup),
                         "wall_s": time.perf_counter() - started}  # fmt: skip
    base = next(iter(results.values()))
    for r in results.values():
        r["speedup_tokens_per_s"] = r["tokens_per_s"] / base["tokens_per_s"]
    table = (f"config `{args.config}`, {args.nproc} processes, {args.steps} steps ({args.warmup} dropped), "
             f"artificial per-collective delay {args.comm_delay_ms:g} ms (benchmark only)\n\n"
             "| variant | tokens/s | step time (s) | exposed comm (s) | overlap | final loss | tokens/s vs first |\n"
             "|---|---:|---:|---:|---:|---:|---:|\n") + "".join(
        f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.3f} | {r['exposed_comm_s']:.3f} | "
        f"{r['overlap']:.0%} | {r['final_loss']:.4f} | {r['speedup_tokens_per_s']:.2f}× |\n"
        for name, r in results.items())  # fmt: skip
    data = {"config": args.config, "nproc": args.nproc, "steps": args.steps, "comm_delay_ms": args.comm_delay_ms,
            "results": results}  # fmt: skip
    write_report(out.parent, out.name, data, table)
    return 0
