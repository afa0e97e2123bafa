"""`python -m torchacco.predict`: which strategy reaches my loss soonest on a given cluster.

    python -m torchacco.predict --model llama3 --flavor 8B --nodes 4 --gpus-per-node 8 --bandwidth 100gbit

Prints, per strategy, the cost model's time per update, tokens/s, exposed communication, memory per
GPU and time to a target loss (`torchacco/cost_model.py` holds the model and its assumptions). It
needs no GPU, no root and no data: only the model's shape and the cluster's numbers.
"""

from __future__ import annotations

import argparse
import sys

from torchacco import cost_model as cm
from torchacco.errors import UserError, run_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torchacco.predict", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama3")
    p.add_argument("--flavor", default="8B")
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--bandwidth", default="100gbit", help="inter-node link per node and direction")
    p.add_argument("--latency-ms", type=float, default=0.01)
    p.add_argument("--device", default="H100", help=f"one of {', '.join(cm.DEVICES)}")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--flops", type=float, default=None, help="achieved FLOP/s per GPU (overrides device × MFU)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--local-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=2, help="per GPU and update (ZeRO-1's accumulation)")
    p.add_argument("--comm-bytes", type=float, default=2.0, help="bytes per element on the wire (bf16: 2)")
    p.add_argument("--memory-gib", type=float, default=None, help="memory per GPU (default: the device's)")
    p.add_argument("--activation-checkpoint", default="selective", choices=tuple(cm.ACTIVATION_BYTES))
    p.add_argument("--loss-chunks", type=int, default=8, help="[training] loss_chunks (fp32 logits per chunk)")
    p.add_argument("--slow-factor", type=float, default=1.0, help="one GPU this much slower")
    p.add_argument("--max-growth", type=float, default=2.0, help="adaptive ACCO's cap ([acco] max_growth)")
    p.add_argument("--updates-to-target", type=int, default=10000, help="DDP's updates to the target loss")
    p.add_argument("--noise-scale", type=float, default=0.0, help="gradient noise scale in tokens (0: the batch)")
    p.add_argument("--stale-penalty", type=float, default=1.3, help="dpu/wp: updates needed relative to DDP")
    p.add_argument("--sync-every", type=int, default=100, help="DiLoCo rows (one replica per node): H")
    p.add_argument("--fragments", type=int, default=1, help="DiLoCo rows: Streaming DiLoCo's fragments")
    p.add_argument("--overlap-steps", type=int, default=0, help="DiLoCo rows: τ")
    p.add_argument("--outer-dtype", default="bf16", choices=("fp32", "bf16", "int8"), help="DiLoCo rows: the wire")
    return p


def workload_and_hardware(args) -> tuple[cm.Workload, cm.Hardware]:
    """The cost model's inputs from the command line (one-line errors for unknown names and rates)."""
    dev = cm.DEVICES.get(args.device)
    if dev is None:
        raise UserError(f"unknown --device {args.device!r}; one of {', '.join(cm.DEVICES)} (or give --flops)")
    try:
        work = cm.model_workload(
            args.model, args.flavor, args.seq_len, args.local_batch, args.micro_batches, comm_bytes=args.comm_bytes,
            activation_checkpoint=args.activation_checkpoint, loss_chunks=args.loss_chunks,
        )  # fmt: skip
    except ValueError as e:
        raise UserError(str(e)) from None
    hw = cm.Hardware(
        nodes=args.nodes,
        ranks_per_node=args.gpus_per_node,
        flops=args.flops or dev["flops"] * args.mfu,
        bandwidth_bps=cm.parse_rate(args.bandwidth),
        latency_s=args.latency_ms / 1000,
        intra_bps=dev["intra_bps"],
        opt_rate=dev["opt_rate"],
        slow_factor=args.slow_factor,
    )
    hw.max_growth = args.max_growth
    return work, hw


def predict(args) -> dict:
    """Print the table and the verdict; returns the workload, hardware and predictions."""
    work, hw = workload_and_hardware(args)
    from torchacco.parallel.acco import ACCO
    from torchacco.parallel.ddp import DDP
    from torchacco.parallel.zero1 import ZeRO1

    preds = cm.predict_all(work, hw)
    mem = {s: cm.memory_bytes(work, hw, s) for s in preds}
    recipe = preds[DDP.name]["tokens_per_update"]
    noise = args.noise_scale or recipe
    ttl = cm.time_to_loss(preds, args.updates_to_target, noise, args.stale_penalty)
    if args.nodes > 1:  # DiLoCo, one replica per node, over each synchronous strategy inside it
        outer = (args.sync_every, args.fragments, args.overlap_steps, args.outer_dtype)
        for label, (cls, _) in cm.variants().items():
            if label == cls.name and not cls.overlapped and cls.supports_replicas:
                row = cm.predict_diloco(work, hw, label, *outer)
                preds[row["strategy"]] = row
                mem[row["strategy"]] = cm.diloco_memory_bytes(work, hw, label)
                ttl[row["strategy"]] = args.updates_to_target * row["step_time_s"]  # as many updates as DDP: assumed
    capacity = (args.memory_gib or cm.DEVICES[args.device]["memory_gib"]) * 2**30
    fits = {s: mem[s] + work.activation_bytes <= capacity for s in preds}
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
    print(cm.format_table(preds, mem, ttl, fits))
    soonest = min((s for s in ttl if fits[s]), key=ttl.get)
    synchronous = [label for label, (cls, mode) in cm.variants().items() if label == cls.name and not cls.overlapped]
    baseline = min((s for s in synchronous if fits[s]), key=ttl.get, default=None)
    against = f"{ttl[baseline] / ttl[soonest]:.2f}× sooner than the best baseline, {baseline}" if baseline else (
        "no synchronous baseline fits")  # fmt: skip
    print(
        f"Soonest to the loss of those that fit in {capacity / 2**30:.0f} GiB per GPU (persistent state and "
        f"{work.activation_bytes / 2**30:.1f} GiB of activations): {soonest} ({against}). ACCO costs "
        f"{(mem[ACCO.name] - mem[ZeRO1.name]) / 2**30:.1f} GiB more per GPU than ZeRO-1 (its "
        "job's buffer: one fp32 parameter copy, as it sums bf16 gradients in fp32)."
    )
    print(assumptions(args, recipe, preds["acco_adaptive"]["tokens_per_update"], noise))
    return {"workload": work.__dict__, "hardware": hw.__dict__, "predictions": preds}


def assumptions(args, recipe: float, adaptive_tokens: float, noise: float) -> str:
    return (
        f"Assumptions: the loss is the one DDP reaches in {args.updates_to_target:,} updates of {recipe:,.0f} tokens; "
        "fixed-batch strategies (ddp, zero1, fsdp, acco and its balanced and bf16-estimate modes) need as many "
        f"updates; dpu and wp {args.stale_penalty:g}× as many (stale gradients); adaptive ACCO's batch of "
        f"{adaptive_tokens:,.0f} tokens needs (1 + B_n/B')/(1 + B_n/B) of them with the "
        f"gradient noise scale B_n = {noise:,.0f} tokens (--noise-scale) and the lr scaled for the batch. DiLoCo rows "
        f"(H = {args.sync_every}, one replica per node) are assumed to need as many updates as DDP; at equal tokens "
        "their loss is higher by a gap that grows with H and with the replicas (docs/diloco.md has the measured "
        "one): check it for your model before trusting their time to loss. Memory is "
        "persistent state (weights, gradients, optimizer; the column) plus one micro-batch's activations "
        f"({args.activation_checkpoint} recompute, {args.loss_chunks} loss chunks: estimated from the model's "
        "shape); a strategy that exceeds the GPU's memory is marked and never advised. Communication is modelled by "
        "bandwidth and latency: no congestion, no CPU contention."
    )


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    predict(args)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(lambda: main(sys.argv[1:])))
