"""`python -m torchacco.predict`: which strategy reaches my loss soonest on a given cluster.

    python -m torchacco.predict --model llama3 --flavor 8B --nodes 4 --gpus-per-node 8 --bandwidth 100gbit
    python -m torchacco.predict --config train_configs/llama3_8b_acco.toml --nodes 4 --gpus-per-node 8

Prints, per strategy, the cost model's time per update, tokens/s, exposed communication, memory per GPU and time to a
target loss (`torchacco/cost_model.py` holds the model and its assumptions). The time to loss needs the strategy's loss
per token, measured in `torchacco/token_efficiency.json`; a strategy no measurement covers says "not measured" and is
never advised. With --config, the model, batch, activation checkpointing and loss chunks are the config's, and a first
row evaluates the config's own layout (its tensor and pipeline parallelism or replicas; memory from the dry run) beside
the pure data-parallel alternatives, which run the same global batch over every rank. It needs no GPU, no root and no
data: only the model's shape and the cluster's numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from torchacco import cost_model as cm
from torchacco import dry_run
from torchacco.config import Config, DiLoCo, Parallelism, load_config
from torchacco.errors import UserError, run_cli
from torchacco.parallel.acco import ACCO
from torchacco.parallel.ddp import DDP
from torchacco.parallel.registry import strategies, strategy_class
from torchacco.parallel.zero1 import ZeRO1
from torchacco.validate import check_diloco


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchacco.predict", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", default="", help="a training config: its model and layout (see above)")
    p.add_argument("--model", default="llama3")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    cm.add_cluster_arguments(p)
    p.add_argument("--flops", type=float, default=None, help="achieved FLOP/s per GPU (overrides device × MFU)")
    p.add_argument("--vocab-size", type=int, default=0, help="0: the flavor's")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2, help="per GPU and update (ZeRO-1's accumulation)")
    p.add_argument("--comm-bytes", type=float, help="bytes per element on the wire (default: --config's dtypes, as the "
                   "dry run; else bf16's 2)")  # fmt: skip
    p.add_argument("--bucket-cap-mb", type=float, default=Parallelism().bucket_cap_mb,
                   help="the gradient buckets of ddp, in MiB; 0: torch's")  # fmt: skip
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (default: the device's)")
    p.add_argument("--activation-checkpoint", default="selective", choices=tuple(cm.ACTIVATION_BYTES))
    p.add_argument("--loss-chunks", type=int, default=8, help="[training] loss_chunks (fp32 logits per chunk)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="one GPU this much slower")
    p.add_argument("--max-growth", type=float, default=2.0, help="adaptive ACCO's cap ([acco] max_growth)")
    p.add_argument("--updates-to-target", type=int, default=10000, help="DDP's updates to the target loss")
    # the DiLoCo rows' settings: those given here, else the --config's [diloco] (with replicas), else [diloco]'s
    # defaults but for the wire (bf16: what a slow link gets)
    p.add_argument("--sync-every", type=int, help="DiLoCo rows (one replica per node): H")
    p.add_argument("--fragments", type=int, help="DiLoCo rows: Streaming DiLoCo's fragments")
    p.add_argument("--overlap-steps", type=int, help="DiLoCo rows: τ")
    p.add_argument("--outer-dtype", choices=tuple(cm.WIRE_BYTES), help="DiLoCo rows: the wire")
    p.add_argument("--topk", type=float, help="DiLoCo rows: [diloco] topk (0: dense)")
    p.add_argument("--outer-lr", type=float, help="DiLoCo rows: the outer learning rate")
    p.add_argument("--outer-momentum", type=float, help="DiLoCo rows: its momentum")
    p.add_argument("--eager", action="store_true", default=None, help="DiLoCo rows: [diloco] eager (with τ)")
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
    return work, hw


def outer_step(args) -> DiLoCo:
    """The DiLoCo rows' [diloco] settings, checked as a run with one replica per node would be."""
    base = getattr(args, "config_diloco", None) or DiLoCo(outer_dtype="bf16")
    names = ("sync_every", "fragments", "overlap_steps", "outer_dtype", "outer_lr", "outer_momentum", "eager", "topk")
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    outer = dataclasses.replace(base, **given)
    cfg = Config(diloco=outer)
    cfg.parallelism.replicas = args.nodes
    check_diloco(cfg, strategy_class(cfg.parallelism.data_parallel))
    return outer


def rows(args, work: cm.Workload, hw: cm.Hardware) -> tuple[dict, dict, dict]:
    """Per row (every strategy, and with several nodes DiLoCo over each synchronous one): the prediction, the memory per
    GPU and the measured entry whose tokens it needs (None: not measured)."""
    preds = cm.predict_all(work, hw)
    mem = {s: cm.memory_bytes(work, hw, s) for s in preds}
    sources = {s: cm.token_source(s) for s in preds}
    if args.nodes > 1:  # DiLoCo, one replica per node, over each synchronous strategy inside it
        outer = outer_step(args)
        sizes = cm.model_fragment_params(args.model, args.flavor, outer.fragments, args.vocab_size or None)
        for label, cls in strategies().items():
            if not cls.traits.overlapped and not cls.traits.replicas_refused:
                row = cm.predict_diloco(work, hw, label, outer.sync_every, outer.fragments, outer.overlap_steps,
                                        outer.outer_dtype, sizes, outer.topk)  # fmt: skip
                preds[row["strategy"]] = row
                mem[row["strategy"]] = cm.diloco_memory_bytes(work, hw, label, outer=outer,
                                                               largest=max(sizes) / sum(sizes))  # fmt: skip
                sources[row["strategy"]] = cm.diloco_token_source(label, args.nodes, outer)
    return preds, mem, sources


def from_config(args):
    """With --config: the dry run of the config on the cluster (its validation: one line for a mistake), and `args` set
    from the config (the model, micro-batch, activation checkpointing, loss chunks)."""
    if not args.config:
        return None
    cfg = load_config(["--config", args.config])
    run = dry_run.plan(cfg, dry_run.Cluster(args.nodes, args.gpus_per_node))
    t, p = run.cfg.training, run.cfg.parallelism
    args.model, args.flavor, args.vocab_size = cfg.model.name, cfg.model.flavor, run.args.vocab_size
    # the DiLoCo rows' outer step; they model neither balanced replicas nor fault tolerance (the config's row does)
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


def config_row(run, work: cm.Workload, hw: cm.Hardware) -> tuple[str, dict, str | None]:
    """The config's own layout as a row (its label names the layout), its prediction and its measured entry."""
    label = dry_run.strategy_label(run.cfg)
    layout = {f"tp {run.tp}": run.tp > 1, f"pp {run.pp}": run.pp > 1, f"{run.replicas} replicas": run.replicas > 1}
    row = f"{label}, {' × '.join(part for part, on in layout.items() if on) or 'dp only'} (the config's)"
    work = dataclasses.replace(work, micro_batches=max(1, run.micro_batches))  # per rank of its dp ranks
    source = cm.diloco_token_source(label, run.replicas, run.cfg.diloco) if run.replicas > 1 else cm.token_source(label)
    return row, {**dry_run.layout_prediction(run, work, hw), "strategy": row}, source


def predict(args) -> None:
    """Print the table and the verdict."""
    run = from_config(args)
    work, hw = workload_and_hardware(args)
    work = dry_run.with_optimizer(work, run) if run is not None else work
    preds, mem, sources = rows(args, work, hw)
    capacity = (args.memory_gib or cm.DEVICES[args.device]["memory_gib"]) * 2**30
    fits = {s: mem[s] + work.activation_bytes <= capacity for s in preds}
    if run is not None:
        row, prediction, source = config_row(run, work, hw)
        preds, sources = {row: prediction, **preds}, {row: source, **sources}
        mem = {row: run.worst.memory.total, **mem}
        fits = {row: run.worst.peak <= capacity, **fits}
    ratios = {s: None if src is None else cm.measured_entry(src).get("mean") for s, src in sources.items()}
    notes = {s: cm.not_reached_note(src) for s, src in sources.items()}
    recipe = preds[DDP.name]["tokens_per_update"]
    ttl = cm.time_to_loss(preds, args.updates_to_target * recipe, ratios)
    z = preds[ZeRO1.name]
    print(
        f"{args.model} {args.flavor}: {work.params / 1e9:.2f}B params, {work.flops_per_token / 1e9:.1f} GFLOP/token; "
        f"{args.nodes} nodes × {args.gpus_per_node} {args.device} at {hw.flops / 1e12:.0f} TFLOP/s each"
        + (f" (one {args.slow_factor:g}× slower)" if args.slow_factor > 1 else "")
        + f"; inter-node {cm.format_rate(hw.bandwidth_bps)}, {args.latency_ms:g} ms; micro-batch "
        f"{args.local_batch} × {args.seq_len}, {args.micro_batches} per rank and update; compute "
        f"{z['compute_s']:.3f} s per micro-batch, sharded job {z['job_s']:.3f} s\n"
    )
    if not any(fits.values()):
        raise UserError(
            f"no strategy fits {capacity / 2**30:.0f} GiB per GPU with {work.activation_bytes / 2**30:.1f} GiB of "
            "activations per micro-batch; use more GPUs, --activation-checkpoint full, or a smaller --local-batch"
        )
    print(cm.format_table(preds, mem, ttl, fits, notes))
    print(
        f"Soonest to the loss, of those that fit in {capacity / 2**30:.0f} GiB per GPU (persistent state and "
        f"{work.activation_bytes / 2**30:.1f} GiB of activations) and whose loss per token is measured: "
        f"{verdict(preds, ttl, fits)}. ACCO costs {(mem[ACCO.name] - mem[ZeRO1.name]) / 2**30:.1f} GiB more per GPU "
        "than ZeRO-1 (its job's buffer: one fp32 parameter copy, as it sums bf16 gradients in fp32)."
    )
    if unmeasured := left_out(preds, ttl, fits, notes):
        print(unmeasured)
    print(assumptions(args, recipe, sources))


def _advisable(ttl: dict, fits: dict) -> list[str]:
    """The rows a verdict may name: they fit, and their loss per token is measured."""
    return [s for s in ttl if fits[s] and ttl[s] is not None]


def verdict(preds: dict, ttl: dict, fits: dict) -> str:
    """The soonest of the advisable rows, against the best synchronous baseline."""
    advisable = _advisable(ttl, fits)
    if not advisable:
        return "none"
    soonest = min(advisable, key=ttl.get)
    synchronous = [name for name, cls in strategies().items() if not cls.traits.overlapped]
    baseline = min((s for s in synchronous if s in advisable), key=ttl.get, default=None)
    if baseline is None:
        return f"{soonest} (no synchronous baseline fits)"
    if baseline == soonest:
        return f"{soonest}, the best synchronous baseline"
    return f"{soonest}, {ttl[baseline] / ttl[soonest]:.2f}× sooner than the best synchronous baseline, {baseline}"


def left_out(preds: dict, ttl: dict, fits: dict, notes: dict) -> str:
    """One line naming the rows that fit and process tokens faster than the verdict's but have no time to loss: their
    loss per token is not measured, or was measured not to reach DDP's ('' when there are none)."""
    advisable = _advisable(ttl, fits)
    pace = preds[min(advisable, key=ttl.get)]["tokens_per_s"] if advisable else 0.0
    faster = [s for s in preds if fits[s] and ttl[s] is None and preds[s]["tokens_per_s"] > pace]
    unreached = [s for s in faster if notes.get(s)]
    unmeasured = [s for s in faster if s not in unreached]
    parts = [f"with no measured loss per token: {', '.join(unmeasured)}"] if unmeasured else []
    parts += [f"{s}, measured: {notes[s]} DDP needs" for s in unreached]
    return f"Left out of that choice, faster in tokens/s: {'; '.join(parts)}." if parts else ""


def assumptions(args, recipe: float, sources: dict[str, str | None]) -> str:
    table = cm.token_table()
    used: dict[str, list[str]] = {}
    for row, source in sources.items():
        if source is not None:
            used.setdefault(source, []).append(row)
    ratios = "; ".join(f"{_ratio(source)} for {', '.join(names)}" for source, names in used.items())
    return (
        f"Assumptions: the loss is the one DDP reaches in {args.updates_to_target:,} updates of {recipe:,.0f} tokens. "
        "A strategy needs DDP's tokens times its ratio measured in torchacco/token_efficiency.json (the tokens to "
        f"reach DDP's final validation loss; {table['date']}, {table['machine']}; {table['model']}): {ratios}. "
        "That model is small: at this one's scale the ratios are an extrapolation. A row no measurement covers "
        "(another mode, DiLoCo with other replicas or outer-step settings) says 'not measured' and is never advised. "
        "Memory is persistent state (weights, gradients, optimizer; the column) plus one "
        f"micro-batch's activations ({args.activation_checkpoint} recompute, {args.loss_chunks} loss chunks: "
        "estimated from the model's shape); a strategy that exceeds the GPU's memory is marked and never advised. "
        "Communication is modelled by bandwidth and latency: no congestion, no CPU contention."
    )


def _ratio(source: str) -> str:
    """A measured ratio with its interval and where it comes from."""
    entry = cm.measured_entry(source)
    if entry["seeds"] is None:
        return f"1 (the reference, {source})"
    if "not_reached_within" in entry:
        return (
            f"not reached within {entry['not_reached_within']:g}× (in {entry['seeds']} of {entry['seeds']} seeds; "
            f"{entry['gap_pct']:+.1f}% at equal tokens, {source} in {entry['source']})"
        )
    at = f" at {entry['lr_multiple']:g}× the lr" if "lr_multiple" in entry else ""  # tuned apart from DDP's
    return (
        f"{entry['mean']:.3f} ± {entry['ci95']:.3f} (95% interval over {entry['seeds']} seeds, {source}{at} in "
        f"{entry['source']})"
    )


def main(argv=None) -> int:
    predict(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda: main(sys.argv[1:])))
