"""What the benchmarks share: the strategies' names, the yardstick's recipe, reading and writing results (JSON +
markdown + PNG), one interval."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
from pathlib import Path

import torch

from torchacco.parallel.registry import BUILT_IN
from torchacco.planning import cost_model as cm

ROOT = Path(__file__).resolve().parents[1]
DDP, ZERO1, FSDP, HSDP, ACCO, DPU, WP = BUILT_IN  # the registry's names, so that none is spelled twice
QUIET = ["--metrics.log_every", "1", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
         "--checkpoint.enable", "false", "--checkpoint.export_hf", "false", "--acco.drift_every", "1"]  # fmt: skip


def strategy_variants() -> dict[str, list[str]]:
    """label -> training arguments: every registered strategy's benchmark variants (its plain self first). Runs
    that steps end give an adaptive variant an unreachable token budget (it needs one)."""
    budget = ["--training.max_tokens", "1000000000000"]
    return {label: [*cm.variant_arguments(label), *budget * mode.startswith("adaptive")]
            for label, (_, mode) in cm.variants().items()}  # fmt: skip


NAMES = {DDP: "DDP", ZERO1: "ZeRO-1", FSDP: "FSDP", HSDP: "HSDP", ACCO: "ACCO", DPU: "DPU", WP: "weight prediction"}
PARTS = {"_avg": "", "_senders": "", "_r4": ", 4 replicas", "_zero1": ", ZeRO-1 inside", "_acco": ", ACCO inside",
         "_balanced": ", balanced", "_b8": ", 8 sequences", "_share875": ", estimate share 0.875"}  # fmt: skip


def plain_name(label: str) -> str:
    """A benchmark label as a reader names it: streaming_h10_avg_topk3_int2_senders -> 'Streaming DiLoCo, top 3%,
    2-bit' (H 10, fragments and averaging as docs/diloco.md recommends; another H is named)."""
    m = re.match(r"(streaming|diloco)_h(\d+)(?:_avg)?(?:_topk(\d+)_int(\d))?", label)
    if m:
        kind, h, k, bits = m.groups()
        name = ("Streaming DiLoCo" if kind == "streaming" else "DiLoCo") + (f" H {h}" if h != "10" else "")
        name += f", top {k}%, {bits}-bit" if k else ", bf16" if kind == "streaming" else ""
        name += ", Nesterov" * ("_avg" not in label) + ", mean over all" * bool(k and "_senders" not in label)
        rest = label[m.end() :]
    else:
        base = next((n for n in sorted(NAMES, key=len, reverse=True) if label.startswith(n)), None)
        name, rest = (NAMES[base], label[len(base) :]) if base else (label, "")
    for part, words in PARTS.items():
        rest = rest.replace(part, words)
    return name + re.sub(r"^_", ", ", rest).replace("_", " ")


def panel_title(setting: str, plan: str) -> str:
    """A setting's plot title from its cluster plan: its nodes and link rate (and a slower node)."""
    m = re.search(r"(\d+) nodes( of \d+ ranks)?.* links ([\d.]+)([mg])bit", plan)
    if not m:
        return f"setting {setting}"
    nodes, ranks, rate, unit = m.groups()
    slow = ", one node slower" if "cores" in plan else ""
    return f"{nodes} nodes{ranks or ''}, {float(rate):.3g} {unit.upper()}bit/s{slow} (setting {setting})"


TOKENS_PER_UPDATE = 16 * 128  # the recipe's update: 16 sequences of 128 tokens


def recipe(
    updates: int, lr: float, seed: int, extra: list[str] = (), flavor: str = "debug", batch: int = 16
) -> list[str]:
    """The yardstick's recipe on 2 ranks, as trainer arguments: GPT-Neo `flavor` (debug; a larger one to check a
    finding on), 1k BPE vocabulary, seq 128, 16 sequences per update, 5% warm-up then cosine, an evaluation of 4
    batches per rank every tenth of the run. `updates` counts updates of 16 sequences, so another global `batch` runs
    the same tokens (warm-up and evaluations at the same tokens) in 16 / batch times the updates."""
    per = lambda n: str(max(1, n * 16 // batch))  # n updates of 16 sequences in updates of `batch`
    return ["--config", "train_configs/default.toml", "--model.flavor", flavor, "--tokenizer.vocab_size", "1024",
            "--training.seq_len", "128", "--training.local_batch_size", "4", "--training.global_batch_size", str(batch),
            "--training.steps", per(10 * updates), "--training.max_tokens", str(updates * TOKENS_PER_UPDATE),
            "--lr_schedule.warmup_steps", per(max(1, updates // 20)), "--optimizer.lr", str(lr),
            "--eval.every", per(max(1, updates // 10)), "--eval.batches", "4", "--training.seed", str(seed),
            *extra]  # fmt: skip


# by degrees of freedom; a dof between two keys takes the smaller key's (wider) value; 1.96 from 30 on
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 25: 2.06}  # fmt: skip


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its two-sided 95% Student's t-interval (nan for one value)."""
    mean, n = statistics.fmean(values), len(values)
    if n < 2:
        return mean, float("nan")
    t = T95[max(d for d in T95 if d <= n - 1)] if n - 1 < 30 else 1.96
    return mean, t * statistics.stdev(values) / n**0.5


def machine() -> str:
    """Cores, CPU model and the SIMD level torch's kernels use: machines of one name but another level give other
    floating-point results, so runs compare (and reproduce) only within one level."""
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    simd = torch.backends.cpu.get_cpu_capability()
    return f"{os.cpu_count()}-core {model} ({simd}), CPU, {platform.system()}"


def meta(name: str, argv: list[str] | None, **more) -> dict:
    """A result's provenance: today, this machine, the command that made it (and `more`)."""
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "command": command(name, argv), **more}


def update_s(record: dict) -> float:
    """A logged update's own seconds (the trainer restarts its clock after each logged update)."""
    return record["tokens_per_update"] / record["tokens_per_s"]


def bare_parser(command: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m benchmarks {command}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip


def parser(command: str, doc: str, name: str | None = None, help: str = "the results' file names' stem"):
    """A command's parser with --out (the results' folder) and --name (their file names' stem)."""
    p = bare_parser(command, doc)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default=name, help=help)
    return p


def command(name: str, argv: list[str] | None) -> str:
    """The command line as a shell reads it back (an empty argument quoted, not lost)."""
    return f"python -m benchmarks {name} {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip()


def records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def trainers():
    """(pid, command line, environment, process state) of each torchacco.train process here (Linux's /proc): the
    command line as its bytes (arguments \\0-separated), the environment as a dict of bytes."""
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes() if p.name.isdigit() else b""
            if b"torchacco.train" in cmd:
                env = dict(x.split(b"=", 1) for x in (p / "environ").read_bytes().split(b"\0") if b"=" in x)
                yield int(p.name), cmd, env, (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # gone meanwhile
            pass


def write_report(out: Path, name: str, data: dict, table: str, draw=None) -> None:
    """A benchmark's outputs: <name>.json (the data), .md (the table, also printed) and .png (`draw(path)`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=float))
    (out / f"{name}.md").write_text(table)
    if draw is not None:
        draw(out / f"{name}.png")
    print(table, flush=True)


def panels(count: int, height: float = 3.5, width: float = 5.0):
    """A figure of `count` panels side by side: (figure, axes), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("torchacco: note: matplotlib is not installed, so no PNG plots were drawn (JSON and markdown were "
              "written); install it with: .venv/bin/pip install -e '.[bench]'", file=sys.stderr)  # fmt: skip
        return None
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig, path: Path) -> None:
    """Write `fig` as a PNG (`path`'s suffix becomes .png) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    plt.close(fig)


def bars(path: Path, panels_data: dict[str, list[tuple]], xlabel: str, line: float = 1.0, bar: float = 0.0):
    """One horizontal bar chart per panel title: (label, value, error bar) rows, a reference line at `line` and, given
    a `bar`, dotted lines at line ± bar (a value past them misses)."""
    drawn = panels(len(panels_data), height=3.2)
    if drawn is None:
        return
    fig, axes = drawn
    for ax, (title, rows) in zip(axes, panels_data.items()):
        ax.barh([r[0] for r in rows], [r[1] for r in rows], xerr=[r[2] for r in rows])
        ax.axvline(line, color="grey", lw=0.5)
        for x in (line - bar, line + bar) if bar else ():
            ax.axvline(x, color="grey", lw=0.7, ls=":")
        ax.set(title=title, xlabel=xlabel)
    save_figure(fig, path)
