"""`python -m torchacco.bench ...`: the sweeps' command line, and `predict` (the cost model alone)."""

from __future__ import annotations

import argparse
import time

from torchacco.bench import cost_model as cm
from torchacco.bench import sweeps
from torchacco.bench.cluster import parse_rate, preflight
from torchacco.bench.sweeps.common import load, rate_label
from torchacco.bench.sweeps.convergence import convergence
from torchacco.bench.sweeps.heterogeneous import heterogeneous
from torchacco.bench.sweeps.memory import memory
from torchacco.bench.sweeps.throughput import throughput
from torchacco.bench.sweeps.time_to_loss import STRATEGIES as TTL_STRATEGIES
from torchacco.bench.sweeps.time_to_loss import time_to_loss
from torchacco.errors import UserError


def predict_cmd(args) -> dict:
    dev = cm.DEVICES.get(args.device)
    if dev is None:
        raise UserError(f"unknown --device {args.device!r}; one of {', '.join(cm.DEVICES)} (or give --flops)")
    try:
        work = cm.model_workload(
            args.model, args.flavor, args.seq_len, args.local_batch, args.micro_batches, comm_bytes=args.comm_bytes
        )
    except ValueError as e:
        raise UserError(str(e)) from None
    flops = args.flops or dev["flops"] * args.mfu
    bw = parse_rate(args.bandwidth)
    hw = cm.Hardware(
        nodes=args.nodes,
        ranks_per_node=args.gpus_per_node,
        flops=flops,
        bandwidth_bps=bw,
        latency_s=args.latency_ms / 1000,
        intra_bps=dev["intra_bps"],
        opt_rate=dev["opt_rate"],
        slow_factor=args.slow_factor,
    )
    hw.max_growth = args.max_growth
    preds = cm.predict_all(work, hw)
    mem = {s: cm.memory_bytes(work, hw, s) for s in preds}
    recipe = preds["ddp"]["tokens_per_update"]
    noise = args.noise_scale or recipe
    ttl = cm.time_to_loss(preds, args.updates_to_target, noise, args.stale_penalty)
    z = preds["zero1"]
    print(
        f"{args.model} {args.flavor}: {work.params / 1e9:.2f}B params, {work.flops_per_token / 1e9:.1f} GFLOP/token; "
        f"{args.nodes} nodes × {args.gpus_per_node} {args.device} at {flops / 1e12:.0f} TFLOP/s each"
        + (f" (one {args.slow_factor:g}× slower)" if args.slow_factor > 1 else "")
        + f"; inter-node {rate_label(bw)}, {args.latency_ms:g} ms; micro-batch {args.local_batch} × {args.seq_len}, "
        f"{args.micro_batches} per rank and update; compute {z['compute_s']:.3f} s per micro-batch, "
        f"sharded job {z['job_s']:.3f} s\n"
    )
    print(cm.format_table(preds, mem, ttl))
    soonest = min(ttl, key=ttl.get)
    baseline = min(("ddp", "zero1", "fsdp"), key=ttl.get)
    print(
        f"Soonest to the loss: {soonest} ({ttl[baseline] / ttl[soonest]:.2f}× sooner than the best baseline, "
        f"{baseline}). ACCO costs {(mem['acco'] - mem['zero1']) / 2**30:.1f} GiB more per GPU than ZeRO-1 (one "
        "bf16 parameter copy)."
    )
    print(
        f"Assumptions: the loss is the one DDP reaches in {args.updates_to_target:,} updates of {recipe:,.0f} tokens; "
        "fixed-batch strategies (ddp, zero1, fsdp, acco and its balanced and bf16-estimate modes) need as many "
        f"updates; dpu and wp {args.stale_penalty:g}× as many (stale gradients); adaptive ACCO's batch of "
        f"{preds['acco_adaptive']['tokens_per_update']:,.0f} tokens needs (1 + B_n/B')/(1 + B_n/B) of them with the "
        f"gradient noise scale B_n = {noise:,.0f} tokens (--noise-scale) and the lr scaled for the batch. Memory is "
        "persistent state only (weights, gradients, optimizer), no activations. Communication is modelled by "
        "bandwidth and latency: no congestion, no CPU contention."
    )
    return {"workload": work.__dict__, "hardware": hw.__dict__, "predictions": preds}


# CLI ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torchacco.bench",
        description=sweeps.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="sweep", required=True)

    def common(p, strategies, steps, nodes=2, warmup=2, timeout=600):
        p.add_argument("--out", default="bench_results")
        p.add_argument("--strategies", default=strategies)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--warmup", type=int, default=warmup, help="logged steps dropped from the averages")
        p.add_argument("--nodes", type=int, default=nodes)
        p.add_argument("--timeout", type=float, default=timeout, help="seconds per run")
        p.add_argument("--quick", action="store_true", help="a ~2-minute smoke version")

    p = sub.add_parser("throughput", help="strategy × link rate")
    common(p, "ddp,zero1,fsdp,acco,acco_adaptive,dpu", 6)
    p.add_argument("--rates", default="50mbit,1gbit", help="link rates besides unshaped and the computed balance rate")
    p.add_argument("--probe-rate", default="100mbit", help="link rate at which the gloo collectives are timed")
    p = sub.add_parser("heterogeneous", help="one node slower")
    common(p, "ddp,zero1,acco,acco_adaptive,dpu", 5, nodes=4, warmup=1)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--cpu-per-node", type=float, default=0.45, help="cores per node (quota); the slow node gets less")
    p.add_argument("--local-batch", type=int, default=2)
    p.add_argument("--uniform-reference", action="store_true", help="also run zero1/acco_adaptive with no slow node")
    p = sub.add_parser("convergence", help="validation loss vs tokens and wall-clock, seeds")
    common(p, "ddp,zero1,acco,dpu,wp", 50)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-batches", type=int, default=4)
    p = sub.add_parser("memory", help="peak memory per rank per strategy")
    common(p, "ddp,zero1,fsdp,acco,dpu,wp", 3, warmup=0)
    p.add_argument(
        "--precision",
        default="bf16",
        choices=("fp32", "bf16"),
        help="compute dtype (the target is stated for bf16; fp32 runs ~3× faster on CPU)",
    )
    p.add_argument(
        "--malloc",
        default="mmap",
        choices=("mmap", "default"),
        help="mmap: glibc returns freed tensor memory at once (RSS follows live memory)",
    )
    p = sub.add_parser("time-to-loss", help="the headline: time to a target validation loss per strategy")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--settings", default="a,b,c")
    p.add_argument("--strategies", default=",".join(TTL_STRATEGIES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--updates", type=int, default=160, help="DDP's updates: the token budget")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--local-batch", type=int, default=4, help="sequences per micro-batch (setting c: half)")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--slow-factor", type=float, default=4.0)
    p.add_argument("--cpu-per-node", type=float, default=0.45)
    p.add_argument("--retries", type=int, default=1, help="runs again when other work took CPU meanwhile")
    p.add_argument("--max-other-cpu", type=float, default=0.1, help="share of the machine's CPU other work may take")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--resume", action="store_true", help="keep the settings in <out>/time_to_loss.json, run the rest")
    p = sub.add_parser("all", help="throughput, heterogeneous, convergence and memory")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--quick", action="store_true")
    p = sub.add_parser("predict", help="the cost model for a real cluster")
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
    p.add_argument("--slow-factor", type=float, default=1.0, help="one GPU this much slower")
    p.add_argument("--max-growth", type=float, default=2.0, help="adaptive ACCO's cap ([acco] max_growth)")
    p.add_argument("--updates-to-target", type=int, default=10000, help="DDP's updates to the target loss")
    p.add_argument("--noise-scale", type=float, default=0.0, help="gradient noise scale in tokens (0: the batch)")
    p.add_argument("--stale-penalty", type=float, default=1.3, help="dpu/wp: updates needed relative to DDP")
    return parser


QUICK = {
    "throughput": dict(strategies="zero1,acco,acco_adaptive", steps=4, warmup=1, rates=""),
    "heterogeneous": dict(strategies="zero1,acco_adaptive", steps=3, warmup=1, nodes=2, cpu_per_node=0.9),
    "convergence": dict(strategies="zero1,acco", steps=10, seeds="0", eval_every=5, eval_batches=2),
    "memory": dict(strategies="zero1,acco", steps=2),
    "time-to-loss": dict(
        strategies="ddp,zero1,acco,acco_balanced", seeds="0", updates=30, eval_every=10, settings="a,c"
    ),
}
SWEEPS = {
    "throughput": throughput,
    "heterogeneous": heterogeneous,
    "convergence": convergence,
    "memory": memory,
    "time-to-loss": time_to_loss,
}


def run(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sweep == "predict":
        predict_cmd(args)
        return 0
    preflight(need_cgroup=args.sweep in ("heterogeneous", "all", "time-to-loss"))
    # `all`: the four sweeps of tokens/s, memory and convergence; time-to-loss is run on its own
    names = [n for n in SWEEPS if n != "time-to-loss"] if args.sweep == "all" else [args.sweep]
    started = time.perf_counter()
    for name in names:
        sub_args = parser.parse_args([name, "--out", args.out])
        if name == args.sweep:
            sub_args = args
        if args.quick:
            for key, value in QUICK[name].items():
                setattr(sub_args, key, value)
            if args.out == "bench_results":
                sub_args.out = "bench_results/quick"
        SWEEPS[name](sub_args)
    print(f"done in {time.perf_counter() - started:.0f} s (load {load()})")
    return 0
