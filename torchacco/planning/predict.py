"""`torchacco predict`: which strategy reaches my loss soonest on a cluster, and the config that runs it.

    torchacco predict --model llama3 --flavor 8B --nodes 4 --gpus-per-node 8 --bandwidth 1gbit
    torchacco predict --config train_configs/llama3_8b_fsdp.toml --nodes 4 --write pick.toml

First the pick against the best synchronous strategy that fits, and the config lines that run it; then per row the
cost model's speed (`cost_model.py`), the measured tokens to DDP's loss (`token_efficiency.json`), the time to it and
the memory per GPU. Every strategy runs at its measured configuration, DiLoCo at each of `cost_model.MEASURED` (one
replica per node) with the soonest strategy inside; `--all` adds the rows that are not a choice. `--config` adds the
config's own layout as a row, the DiLoCo flags a row at their settings. No GPU needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch

from torchacco.config import DiLoCo, Optimizer, Parallelism, Training, load_config
from torchacco.errors import UserError
from torchacco.optim import muon_workload
from torchacco.parallel import diloco
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.registry import strategies, strategy_class
from torchacco.planning import cost_model as cm
from torchacco.planning import dry_run
from torchacco.spec import get_model_spec

DOCS = "docs/performance.md#before-launching-predict-and-the-dry-run"
OPTIMIZERS = {"adamw": "", "muon": " + Muon"}  # [optimizer] name: its rows' suffix, and their config lines
OPTIMIZER_LINES = {"adamw": [], "muon": [("optimizer", "name", "muon")]}
DILOCO_FLAGS = ("sync_every", "fragments", "overlap_steps", "outer_dtype", "topk", "topk_mean", "outer_lr",
                "outer_momentum", "eager")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    formatter = type("Formatter", (argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter), {})
    p = argparse.ArgumentParser(prog="torchacco predict", description=__doc__, formatter_class=formatter)
    p.add_argument("--config", default="", help="a training config: its model, batch and layout (see above)")
    p.add_argument("--write", default="", metavar="FILE", help="write the pick as a config (from --config's, if given)")
    p.add_argument("--all", action="store_true", help="also the rows that are not a choice (see above)")
    p.add_argument("--model", default="llama3", help="a model folder's name")
    p.add_argument("--flavor", default="8B", help="its flavor")
    p.add_argument("--nodes", type=int, default=4, help="nodes, joined by --bandwidth")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    cm.add_cluster_arguments(p)
    p.add_argument("--flops", type=float, default=None, help="achieved FLOP/s per GPU (overrides device × MFU)")
    p.add_argument("--calibration", default="", metavar="FILE", help="a calibration JSON of benchmarks: its "
                   "compute_per_update_s (one rank's) sets the compute")  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=0, help="0: the flavor's")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--local-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2, help="per GPU and update (ZeRO-1's accumulation)")
    p.add_argument("--comm-bytes", type=float, help="bytes per element on the wire (None: --config's dtypes, as the "
                   "dry run; else bf16's 2)")  # fmt: skip
    p.add_argument("--bucket-cap-mb", type=float, default=Parallelism().bucket_cap_mb,
                   help="the gradient buckets of ddp, in MiB; 0: torch's")  # fmt: skip
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (None: the device's)")
    p.add_argument("--activation-checkpoint", default="selective", choices=tuple(cm.ACTIVATION_BYTES),
                   help="[training] activation_checkpoint")  # fmt: skip
    p.add_argument("--loss-chunks", type=int, default=8, help="[training] loss_chunks (fp32 logits per chunk)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="one GPU this much slower")
    p.add_argument("--max-growth", type=float, default=2.0, help="adaptive ACCO's cap ([acco] max_growth)")
    p.add_argument("--updates-to-target", type=int, default=10000, help="DDP's updates to the target loss")
    p.add_argument("--optimizer", default="best", choices=("best", *OPTIMIZERS), help="best: each strategy with the "
                   "optimizer that reaches the loss sooner (the other's row with --all)")  # fmt: skip
    p.add_argument("--sync-every", type=int, help="a DiLoCo row (one replica per node, the rest of its settings "
                   "the --config's, else [diloco]'s defaults in bf16) with this H")  # fmt: skip
    p.add_argument("--fragments", type=int, help="a DiLoCo row: Streaming DiLoCo's fragments")
    p.add_argument("--overlap-steps", type=int, help="a DiLoCo row: τ")
    p.add_argument("--outer-dtype", choices=tuple(cm.WIRE_BYTES), help="a DiLoCo row: the wire")
    p.add_argument("--topk", type=float, help="a DiLoCo row: [diloco] topk (0: dense)")
    p.add_argument("--topk-mean", choices=("senders", "replicas"), help="a DiLoCo row: [diloco] topk_mean")
    p.add_argument("--outer-lr", type=float, help="a DiLoCo row: the outer learning rate")
    p.add_argument("--outer-momentum", type=float, help="a DiLoCo row: its momentum")
    p.add_argument("--eager", action="store_true", default=None, help="a DiLoCo row: [diloco] eager (with τ)")
    return p


def workload_and_hardware(args) -> tuple[cm.Workload, cm.Hardware]:
    """The cost model's inputs from the command line (one-line errors for unknown names and rates)."""
    try:
        work = cm.model_workload(
            args.model, args.flavor, args.seq_len, args.local_batch, args.micro_batches, args.vocab_size or None,
            comm_bytes=2.0 if args.comm_bytes is None else args.comm_bytes,
            activation_checkpoint=args.activation_checkpoint, loss_chunks=args.loss_chunks,
        )  # fmt: skip
        if not (math.isfinite(args.bucket_cap_mb) and args.bucket_cap_mb >= 0):
            raise ValueError(f"--bucket-cap-mb must be 0 (torch's default) or positive, got {args.bucket_cap_mb:g}")
        work = dataclasses.replace(work, **cm.ddp_buckets(args.bucket_cap_mb))
    except ValueError as e:
        raise UserError(str(e)) from None
    hw = cm.hardware(args, args.nodes, args.gpus_per_node, slow_factor=args.slow_factor, max_growth=args.max_growth)
    if args.flops:
        hw.flops = args.flops
    if args.calibration:
        hw.compute_s = calibrated_compute_s(args.calibration) / work.micro_batches
    return work, hw


def calibrated_compute_s(path: str) -> float:
    """A calibration's compute per update on one rank (`benchmarks` writes {"calibration": {...}})."""
    try:
        return float(json.loads(Path(path).read_text(encoding="utf-8"))["calibration"]["compute_per_update_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read compute_per_update_s from --calibration {path} ({e}); pass a benchmarks "
                        "calibration JSON or --flops") from None  # fmt: skip


@dataclasses.dataclass
class Row:
    pred: dict  # the cost model's prediction
    memory: float  # persistent bytes per GPU
    source: str | None  # the measured entry whose tokens ratio it takes
    settings: list  # (section, key, value): what runs it
    synchronous: bool = False
    choice: bool = True  # shown without --all
    extra_s: float = 0.0  # time beside its updates' (a warm start's synchronous updates)
    group: str = ""  # a DiLoCo configuration (its MEASURED label): of its inner strategies the soonest is shown


def sync_rows(args, work: cm.Workload, hw: cm.Hardware, optimizer: str) -> dict[str, Row]:
    """Every registered strategy and variant stepping `optimizer`; a choice where measured (balanced modes only with
    a slow GPU)."""
    out = {}
    for label, pred in cm.predict_all(work, hw).items():
        cls, mode = cm.variants()[label]
        extra = cm.variant_arguments(label)
        settings = [(*k.removeprefix("--").split("."), v) for k, v in zip(extra[::2], extra[1::2])]
        source = cm.token_source(label, optimizer=optimizer)
        measured = source is not None and "mean" in cm.measured_entry(source)
        choice = measured and (mode != "balanced" or args.slow_factor > 1)
        pred["strategy"], settings = label + OPTIMIZERS[optimizer], settings + OPTIMIZER_LINES[optimizer]
        row = Row(pred, cm.memory_bytes(work, hw, label), source, settings, not cls.traits.overlapped, choice)
        out[pred["strategy"]] = row
    return out


def optimizer_workload(args, work: cm.Workload, optimizer: str, run) -> cm.Workload:
    """`work` with `optimizer`'s own costs (Muon's Newton–Schulz and gathers; --config's ns_steps)."""
    cfg = dataclasses.replace(run.cfg.optimizer if run else Optimizer(), name=optimizer)
    with torch.device("meta"):
        spec = get_model_spec(args.model)
        model = spec.model_cls(spec.args(args.flavor, vocab_size=args.vocab_size or None))
    return dataclasses.replace(work, **muon_workload(cfg, model))


def diloco_rows(args, work: cm.Workload, hw: cm.Hardware, optimizer: str) -> dict[str, Row]:
    """DiLoCo, one replica per node, with each synchronous strategy inside that allows replicas: at each measured
    configuration for this many replicas (balanced replicas too with a slow GPU), and at the DiLoCo flags' settings
    (a choice where they were given)."""
    out: dict[str, Row] = {}
    if args.nodes < 2:
        return out
    asked = any(getattr(args, name) is not None for name in DILOCO_FLAGS) or getattr(args, "config_diloco", None)
    configs = {label: (name, measured) for label, name in cm.MEASURED.items()
               for replicas, measured in [cm.measured_diloco(label)] if replicas == args.nodes}  # fmt: skip
    configs["flags"] = (None, outer_step(args))
    for inner, cls in strategies().items():
        if cls.traits.overlapped or cls.traits.why_not_in_replicas:
            continue
        for label, (name, outer) in configs.items():
            for balanced in (False, True) if args.slow_factor > 1 and name else (False,):
                pred, largest = diloco_prediction(args, work, hw, inner, outer, balanced)
                source = cm.diloco_token_source(inner, args.nodes, outer, optimizer=optimizer)
                pred["strategy"] = f"{name} ({inner} inside{', balanced' * balanced})" if name else pred["strategy"]
                pred["strategy"] += OPTIMIZERS[optimizer]
                outer = dataclasses.replace(outer, balance_replicas=balanced)
                memory = cm.diloco_memory_bytes(work, hw, inner, outer=outer, largest=largest)
                settings = diloco_settings(inner, args.nodes, outer) + OPTIMIZER_LINES[optimizer]
                row = Row(pred, memory, source, settings, choice=bool(name or asked))
                if outer.warm_start:  # its updates are synchronous: an fp32 average after each
                    sync = diloco_prediction(args, work, hw, inner, DiLoCo(1, 1, 0, outer_dtype="fp32"), False)[0]
                    row.extra_s = outer.warm_start * max(0.0, sync["step_time_s"] - pred["step_time_s"])
                out[pred["strategy"]], row.group = row, label + "_balanced" * balanced + OPTIMIZERS[optimizer]
    return out


def diloco_prediction(args, work, hw, inner: str, outer: DiLoCo, balanced: bool) -> tuple[dict, float]:
    """predict_diloco of a [diloco] section, and its largest fragment's share of θ."""
    sizes = cm.model_fragment_params(args.model, args.flavor, outer.fragments, args.vocab_size or None)
    pred = cm.predict_diloco(work, hw, inner, outer.sync_every, outer.fragments, outer.overlap_steps,
                             outer.outer_dtype, sizes, outer.topk, balanced)  # fmt: skip
    return pred, max(sizes) / sum(sizes)


def diloco_settings(inner: str, replicas: int, outer: DiLoCo) -> list:
    """The config lines of a DiLoCo row: its inner strategy and replicas, and each [diloco] key off its default."""
    changed = [("diloco", k, v) for k, v in dataclasses.asdict(outer).items() if v != getattr(DiLoCo(), k)]
    return [("parallelism", "data_parallel", inner), ("parallelism", "replicas", replicas), *changed]


def outer_step(args) -> DiLoCo:
    """The flags' [diloco] settings, checked as a run with one replica per node would be."""
    base = getattr(args, "config_diloco", None) or DiLoCo(outer_dtype="bf16")
    given = {name: getattr(args, name) for name in DILOCO_FLAGS if getattr(args, name) is not None}
    outer = dataclasses.replace(base, **given)
    diloco.DiLoCo.check(
        strategy_class(Parallelism().data_parallel), None, outer, Parallelism(replicas=args.nodes), Training()
    )
    return outer


def from_config(args):
    """With --config: the dry run of the config on the cluster (its validation: one line for a mistake), and `args` set
    from the config (the model, micro-batch, activation checkpointing, loss chunks)."""
    if not args.config:
        return None
    cfg = load_config(["--config", args.config])
    run = dry_run.plan(cfg, dry_run.Cluster(args.nodes, args.gpus_per_node))
    t, p = run.cfg.training, run.cfg.parallelism
    args.model, args.flavor, args.vocab_size = cfg.model.name, cfg.model.flavor, run.args.vocab_size
    # the DiLoCo flags' row: the config's outer step, without balance or fault tolerance (the config's row has them)
    outer = dataclasses.replace(cfg.diloco, balance_replicas=False, fault_tolerant=False)
    args.config_diloco = outer if run.replicas > 1 else None
    # the alternatives run the config's global batch with every rank data-parallel: tp·pp times its dp ranks
    args.seq_len, args.local_batch = t.seq_len, t.local_batch_size
    args.micro_batches = max(1, run.micro_batches // (run.tp * run.pp))
    args.activation_checkpoint, args.loss_chunks = t.activation_checkpoint, t.loss_chunks
    args.bucket_cap_mb = p.bucket_cap_mb
    if args.comm_bytes is None:
        args.comm_bytes = dry_run.wire_bytes(run.param_dtype, p.reduce_dtype)
    return run


def config_row(run, work: cm.Workload, hw: cm.Hardware) -> tuple[str, Row]:
    """The config's own layout as a row (its label names the layout)."""
    label = dry_run.strategy_label(run.cfg)
    snoo = run.replicas == 1 and has_outer_step(1, run.cfg.diloco)  # its time is the inner strategy's, not its tokens
    layout = {f"tp {run.tp}": run.tp > 1, f"pp {run.pp}": run.pp > 1, f"{run.replicas} replicas": run.replicas > 1,
              f"SNOO H {run.cfg.diloco.sync_every}": snoo}  # fmt: skip
    name = f"{label}, {' × '.join(part for part, on in layout.items() if on) or 'dp only'} (the config's)"
    work = dataclasses.replace(work, micro_batches=max(1, run.micro_batches))  # per rank of its dp ranks
    outer = run.replicas > 1 or snoo
    optimizer = run.cfg.optimizer.name
    source = (cm.diloco_token_source(label, run.replicas, run.cfg.diloco, optimizer=optimizer) if outer
              else cm.token_source(label, optimizer=optimizer))  # fmt: skip
    pred = {**dry_run.layout_prediction(run, work, hw), "strategy": name}
    synchronous = not outer and not cm.variants()[label][0].traits.overlapped
    return name, Row(pred, run.worst.memory.total, source, [], synchronous)


def run_at_measured_lr(rows, lr: float) -> None:
    """A row whose tokens were measured at a multiple of the recipe's tuned lr runs at that multiple of `lr` (the
    config's, or the default's): its config lines set it."""
    for row in rows:
        multiple = cm.measured_entry(row.source).get("lr_multiple", 1) if row.source else 1
        row.settings = row.settings + [("optimizer", "lr", lr * multiple)] * (multiple != 1)


def reference(rows: dict[str, Row]) -> Row:
    """DDP's row (with the optimizer asked for): the tokens per update the loss is counted in."""
    return next(rows[cm.REFERENCE + suffix] for suffix in OPTIMIZERS.values() if cm.REFERENCE + suffix in rows)


def fits_with_reserve(peak: float, capacity: float) -> bool:
    """The dry run's verdict: a peak fits (yes or tight) once the reserve for the CUDA context and slack is added."""
    return dry_run.fits(peak * (1 + dry_run.RESERVE_SHARE) + dry_run.RESERVE_BYTES, capacity) != "no"


def evaluate(args):
    """Every row, with its time to the loss (None: not measured) and whether it fits; the workload and capacity."""
    run = from_config(args)
    work, hw = workload_and_hardware(args)
    rows = {}
    for optimizer in OPTIMIZERS if args.optimizer == "best" else (args.optimizer,):
        with_optimizer = optimizer_workload(args, work, optimizer, run)
        rows |= {**sync_rows(args, with_optimizer, hw, optimizer), **diloco_rows(args, with_optimizer, hw, optimizer)}
    run_at_measured_lr(rows.values(), (run.cfg.optimizer if run else Optimizer()).lr)
    capacity = (args.memory_gib or cm.DEVICES[args.device]["memory_gib"]) * 2**30
    fits = {name: fits_with_reserve(row.memory + work.activation_bytes, capacity) for name, row in rows.items()}
    if run is not None:
        name, row = config_row(run, dry_run.with_optimizer(work, run), hw)
        rows, fits = {name: row, **rows}, {name: fits_with_reserve(run.worst.peak, capacity), **fits}
    target = args.updates_to_target * reference(rows).pred["tokens_per_update"]
    ttl = {}
    for name, row in rows.items():
        ratio = None if row.source is None else cm.measured_entry(row.source).get("mean")
        ttl[name] = None if ratio is None else ratio * target / row.pred["tokens_per_s"] + row.extra_s
    return rows, ttl, fits, work, hw, capacity


def duration(seconds: float) -> str:
    """Seconds as minutes, hours or days."""
    if seconds < 3600:
        return f"{seconds / 60:.2g} min"
    return f"{seconds / 3600:.3g} h" if seconds < 48 * 3600 else f"{seconds / 86400:.3g} days"


def headline(rows: dict[str, Row], ttl: dict, best: str, baseline: str | None) -> str:
    """The pick against the best synchronous row, and the config lines that run it."""
    against = {None: " (no synchronous strategy fits)", best: ", the best synchronous strategy that fits"}.get(baseline)
    when = f"{duration(ttl[best])} to the loss"
    if against is None:
        against, when = f", {ttl[baseline] / ttl[best]:.2f}× sooner than the best synchronous strategy that fits " \
            f"({baseline})", f"{when} against {duration(ttl[baseline])}"  # fmt: skip
    lines = toml_lines(rows[best].settings)
    return f"Pick: {best}{against}: {when}." + (
        f"\nRun it (--write FILE writes a whole config):\n{lines}" * bool(lines)
    )


def overrides(settings: list) -> list[str]:
    return [f"--{s}.{k}={json.dumps(v) if isinstance(v, bool) else v}" for s, k, v in settings]


def toml_lines(settings: list) -> str:
    """A row's settings as config lines, typed as the config reads them."""
    cfg, lines = load_config(overrides(settings)), []
    for i, (section, key, _) in enumerate(settings):
        lines += [f"  [{section}]"] * (i == 0 or settings[i - 1][0] != section)
        lines.append(f"  {key} = {json.dumps(getattr(cfg.section(section), key))}")
    return "\n".join(lines)


def table(rows: dict[str, Row], ttl: dict, fits: dict, best: str | None, shown: list[str]) -> str:
    columns = ["strategy", "time per update (s)", "tokens/s", "tokens × DDP's", "time to loss", "vs pick", "GiB/GPU"]
    cells, batch = [], reference(rows).pred["tokens_per_update"]
    for name in shown:
        row, t = rows[name], ttl[name]
        when = duration(t) if t is not None else (cm.not_reached_note(row.source) or "not measured")
        versus = "does not fit" if not fits[name] else (f"{t / ttl[best]:.2f}×" if t is not None and best else "—")
        ratio = _ratio(row.source) if row.source else "—"
        grown = round(row.pred["tokens_per_update"] / batch, 6)  # past adaptive ACCO's default cap: a batch no run had
        speed = f"{row.pred['tokens_per_s']:,.0f}" if grown <= cm.Hardware.max_growth else f"— ({grown:.0f}× the batch)"
        cells.append([name, f"{row.pred['step_time_s']:.4g}", speed, ratio, when, versus, f"{row.memory / 2**30:.1f}"])
    return cm.markdown_table(columns, cells)


def _ratio(source: str) -> str:
    """A measured tokens ratio with its 95% interval (and the lr it was tuned to, if not DDP's)."""
    entry = cm.measured_entry(source)
    if "not_reached_within" in entry:
        return f"> {entry['not_reached_within']:g}"
    at = f" at {entry['lr_multiple']:g}× lr" if "lr_multiple" in entry else ""
    return f"{entry['mean']:.3f} ± {entry['ci95']:.3f}{at}" if entry["seeds"] else "1"


def assumptions(args, work: cm.Workload, recipe: float) -> str:
    measured = f"{cm.token_table()['date']}, GPT-Neo debug, torchacco/planning/{cm.TOKEN_EFFICIENCY.name}"
    return (
        f"Assumptions: the loss is DDP's after {args.updates_to_target:,} updates of {recipe:,.0f} tokens; a row needs "
        f"those tokens × its ratio measured to it ({measured}); ZeRO-1, FSDP and HSDP compute DDP's update (noise "
        "floor ±0.3%), so DDP's ratios hold for them, inside DiLoCo too, and balanced replicas take the plain ones.\n"
        "A ratio measured on a small model is the conservative side for a large one: the literature finds DiLoCo's gap "
        "to DDP shrinking with model size (Charles et al. 2025, arXiv 2503.09799).\n"
        f"Speed: bandwidth and latency, no congestion; memory: persistent state and one micro-batch's activations "
        f"({work.activation_bytes / 2**30:.1f} GiB, {args.activation_checkpoint} recompute). More: {DOCS}"
    )


def predict(args) -> None:
    """Print the pick, the table and the assumptions; write the pick's config with --write."""
    rows, ttl, fits, work, hw, capacity = evaluate(args)
    if not any(fits.values()):
        raise UserError(
            f"no strategy fits {capacity / 2**30:.0f} GiB per GPU with {work.activation_bytes / 2**30:.1f} GiB of "
            "activations per micro-batch; use more GPUs, --activation-checkpoint full, or a smaller --local-batch"
        )
    advisable = [name for name in rows if fits[name] and ttl[name] is not None]  # fits, and measured
    best = min(advisable, key=ttl.get, default=None)
    baseline = min((n for n in advisable if rows[n].synchronous), key=ttl.get, default=None)
    print(headline(rows, ttl, best, baseline) if best else "Pick: none (nothing measured fits).")
    slow = f", one GPU {args.slow_factor:g}× slower" * (args.slow_factor > 1)
    print(
        f"\n{args.model} {args.flavor}, {work.params / 1e9:.2f}B params; {args.nodes} nodes × {args.gpus_per_node} "
        f"{args.device} ({cm.format_rate(hw.bandwidth_bps)} between nodes{slow}); per GPU and update "
        f"{work.micro_batches} × {args.local_batch} × {args.seq_len} tokens; {capacity / 2**30:.0f} GiB\n"
    )
    shown = [n for n in rows if args.all or n == best or shown_by_default(n, rows, ttl, fits)]
    print(table(rows, ttl, fits, best, shown))
    if hidden := len(rows) - len(shown):
        print(f"{hidden} more rows (--all): unmeasured, not reaching DDP's loss, not fitting (a strategy's own row "
              "shows anyway), balanced with no slow GPU, or another strategy inside DiLoCo")  # fmt: skip
    print("\n" + assumptions(args, work, reference(rows).pred["tokens_per_update"]))
    if args.write and best:
        write_config(args, rows[best].settings, best)


def shown_by_default(name: str, rows: dict[str, Row], ttl: dict, fits: dict) -> bool:
    """A choice that fits (a registered strategy also where it does not), the soonest of its family: one strategy's
    rows, or one DiLoCo configuration's with any strategy inside, with either optimizer."""
    row = rows[name]
    if not row.choice or not (fits[name] or name in strategies()):
        return False
    family = [n for n, r in rows.items() if _family(n, r) == _family(name, row) and fits[n] and ttl[n] is not None]
    return not family or name == min(family, key=ttl.get)


def _family(name: str, row: Row) -> str:
    key = row.group or name
    return next((key.removesuffix(suffix) for suffix in OPTIMIZERS.values() if suffix and key.endswith(suffix)), key)


def write_config(args, settings: list, name: str) -> None:
    """The pick as a whole config: --config's (else the model, batch and cluster given here) with the pick's lines."""
    base = ["--config", args.config] if args.config else []
    if not args.config:
        batch = args.local_batch * args.micro_batches * args.nodes * args.gpus_per_node
        vocab = args.vocab_size or get_model_spec(args.model).args(args.flavor).vocab_size  # the model evaluated
        base += (
            f"--model.name={args.model} --model.flavor={args.flavor} --model.vocab_size={vocab} "
            f"--training.seq_len={args.seq_len} --training.local_batch_size={args.local_batch} "
            f"--training.global_batch_size={batch} --training.mixed_precision=bf16 --job.dump_folder=outputs/pick "
            f"--training.activation_checkpoint={args.activation_checkpoint} --job.cluster={args.nodes}x"
            f"{args.gpus_per_node} --training.loss_chunks={args.loss_chunks}"
        ).split() + [f"--tokenizer.vocab_size={args.vocab_size}"] * bool(args.vocab_size)
    cfg = load_config(base + overrides(settings))
    t = cfg.training
    if cfg.diloco.balance_replicas and not t.max_tokens:  # balanced replicas count tokens, not updates
        t.max_tokens = t.steps * t.global_batch_size * t.seq_len
    Path(args.write).write_text(f"# torchacco predict's pick: {name}\n{cfg.to_toml()}", encoding="utf-8")
    load_config(["--config", args.write])  # it loads as written
    print(f"\nWrote {args.write}: ./run_train.sh --config {args.write}")


def main(argv=None) -> int:
    predict(build_parser().parse_args(argv))
    return 0
