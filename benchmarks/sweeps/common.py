"""What the sweeps share: strategies, one measured point, saving, plotting, calibration."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from benchmarks.cluster import ClusterPlan, format_rate, probe_collectives, run_training, summarize
from torchacco import cost_model as cm
from torchacco.errors import UserError
from torchacco.parallel.registry import STRATEGIES
from torchacco.parallel.zero1 import ZeRO1


def strategy_variants() -> dict[str, list[str]]:
    """label -> training arguments: every registered strategy's benchmark variants (its plain self
    first). Steps, not tokens, end these sweeps' runs, so an adaptive variant gets an unreachable
    token budget (it needs one)."""
    variants = {}
    for cls in STRATEGIES.values():
        for label, (args, mode) in cls.benchmark_variants().items():
            budget = ["--training.max_tokens", "1000000000000"] if mode.startswith("adaptive") else []
            variants[label] = ["--parallelism.data_parallel", cls.name, *args, *budget]
    return variants


SYNCHRONOUS = tuple(name for name, cls in STRATEGIES.items() if not cls.overlapped)  # the baselines
QUIET = [
    "--metrics.log_every",
    "1",
    "--metrics.tensorboard",
    "false",
    "--metrics.progress_bar",
    "false",
    "--checkpoint.enable",
    "false",
    "--checkpoint.export_hf",
    "false",
]
DEFAULT_MODEL = ["--config", "train_configs/default.toml"]  # GPT-Neo tiny, 5.85M, seq 256, batch 4, global 16


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def strategies_arg(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = strategy_variants()
    bad = [s for s in names if s not in known]
    if bad:
        raise UserError(f"unknown strategy {bad[0]!r}; choose from {', '.join(known)}")
    return names


# one measured point ------------------------------------------------------------------------


def run_point(
    plan: ClusterPlan,
    strategy: str,
    extra: list[str],
    folder: Path,
    warmup: int,
    timeout: float,
    threads: int = 1,
    env: dict | None = None,
) -> dict:
    load_before = load()
    result = run_training(
        plan, [*extra, *strategy_variants()[strategy]], folder, timeout_s=timeout, threads=threads, env=env
    )
    records = result["records"]
    point = {
        "strategy": strategy,
        "rate": format_rate(plan.rate_bps),
        "rate_bps": plan.rate_bps,
        **summarize(records, min(warmup, len(records) - 1)),
        "wall_s": result["wall_s"],
        "load_before": load_before,
        "load_after": load(),
        "micro_batches_per_rank": mean_lists([r.get("micro_batches_per_rank") for r in records[warmup:]]),
        "tokens_per_update": statistics.mean(r["tokens_per_update"] for r in records[warmup:] or records),
        "peak_rss_gib_per_rank": [round(r["peak_rss_gib"], 4) for r in result["ranks"]],
        "records": records,
    }
    # compute-only time per update: what remains of the step once the exposed communication is removed
    point["compute_s"] = point["step_time_s"] - point["exposed_comm_s"]
    return point


def mean_lists(lists):
    lists = [x for x in lists if x]
    if not lists:
        return []
    return [round(statistics.mean(col), 2) for col in zip(*lists)]


def rate_label(bps):
    return format_rate(bps) if bps else "unshaped"


def save_results(out: Path, name: str, data: dict, table: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    base = out / f"cluster_{name}"
    base.with_suffix(".json").write_text(json.dumps(data, indent=2, default=float))
    base.with_suffix(".md").write_text(table)
    print(table, flush=True)
    return base


def write_report(out: Path, name: str, data: dict, table: str, draw) -> None:
    """A benchmark's outputs: <name>.json (the data), .md (the table, also printed) and .png (`draw(path)`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
    (out / f"{name}.md").write_text(table)
    draw(out / f"{name}.png")
    print(table)


def save_figure(fig, path: Path) -> None:
    """Write `fig` as a PNG (`path`'s suffix becomes .png) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def pyplot_or_none():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        print(
            "torchacco: note: matplotlib is not installed, so no PNG plots were drawn (JSON and markdown were "
            "written); install it with: .venv/bin/pip install -e '.[bench]'",
            file=sys.stderr,
        )
        return None


def panels(count: int, height: float = 3.5):
    """A figure of `count` panels side by side, 5 wide each: (figure, axes), or None without matplotlib.
    Draw, then `save_figure(figure, path)`."""
    plt = pyplot_or_none()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, count, figsize=(5 * count, height), squeeze=False)
    return fig, axes[0]


# throughput: strategy × link rate -----------------------------------------------------------


def calibrate(points: list[dict], work: cm.Workload, nodes: int) -> cm.Hardware:
    """Compute time per micro-batch from the fastest unshaped synchronous run (the least disturbed by the
    other jobs on this shared machine), the optimizer's speed from unshaped ZeRO-1's exposed time."""
    sync = [p for p in points if p["rate_bps"] is None and p["strategy"] in SYNCHRONOUS]
    c = min(p["compute_s"] for p in sync) / work.micro_batches
    ref = next(p for p in sync if p["strategy"] == ZeRO1.name)
    opt_s = max(1e-4, ref["exposed_comm_s"])  # unshaped: the job is (almost) all optimizer step
    return cm.Hardware(
        nodes=nodes,
        flops=work.flops_per_token * work.tokens_per_micro_batch / c,
        bandwidth_bps=None,
        compute_s=c,
        opt_rate=work.params / nodes / opt_s,
        streams=False,  # the emulation computes on CPU
    )


def collective_factors(plan: ClusterPlan, work: cm.Workload, folder: Path) -> dict:
    """Each gloo collective's measured time over its ring ideal at the plan's link rate (the cost model's f)."""
    probe = probe_collectives(plan, folder, int(work.params))
    ideal = cm.collective_s(probe["bytes"], cm.Hardware(nodes=plan.nodes, flops=1.0, bandwidth_bps=plan.rate_bps))
    return {
        "rs_factor": probe["reduce_scatter_s"] / ideal,
        "ag_factor": probe["all_gather_s"] / ideal,
        "ar_factor": probe["all_reduce_s"] / (2 * ideal),
        "probe": probe,
    }


def default_workload(micro_batches: int = 2, local_batch: int = 4, seq_len: int = 256, flavor: str = "tiny"):
    # the CPU trains in fp32: gradients and parameters travel as 4-byte floats
    return cm.model_workload("gpt_neo", flavor, seq_len, local_batch, micro_batches, vocab_size=10000, comm_bytes=4)
