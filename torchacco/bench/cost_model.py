"""A step-time cost model for the data-parallel strategies, and `--predict`.

    python -m torchacco.bench predict --model llama3 --flavor 8B --nodes 4 --gpus-per-node 8 \\
        --bandwidth 100gbit --device H100 --seq-len 8192 --local-batch 1 --micro-batches 4

Inputs: the model (parameters, FLOPs per token), tokens per micro-batch and micro-batches per
update (ZeRO-1's accumulation k), the achieved FLOP/s of one rank, the inter-node bandwidth B and
latency L per link, the ranks (N nodes × G per node) and the sharded optimizer's speed.

Per update, with c the compute time of one micro-batch (c_slow on the slowest rank), S the bytes of
one gradient (or parameter) buffer on the wire, and W = N·G ranks:

  one reduce-scatter or all-gather  V = (N-1)/N · 8S/B + (N-1)·L + (G-1)/G · 8S/B_intra   (hierarchical ring)
  as measured for a backend         V_rs = f_rs·V, V_ag = f_ag·V, V_ar = f_ar·2V  (f = 1 for NCCL; gloo's
                                    reduce-scatter is ~2: it moves an all-reduce's bytes)
  the sharded job                   M = V_rs + P/W / opt_rate + V_ag
  ddp      k·c + max(0, V_ar − ⅔c) + P / opt_rate      (all-reduce overlapped with the last backward)
  zero1    k·c + M                                      (the job after the last micro-batch)
  fsdp     k·max(c, 2V_ag + V_rs) + P/W / opt_rate      (2 all-gathers + 1 reduce-scatter per micro-batch, prefetched)
  acco     2·max(k/2·c, M)                              (deterministic: two rounds of k/2 micro-batches, a job each)
  acco adaptive   rounds of R = max(k/2·c_slow, M); rank i computes max(k/2, R/c_i) micro-batches per round
  dpu, wp  max(k·c, M)                                  (one job per update, beside the next period)

Every synchronous strategy runs at the slowest rank's pace (c = c_slow). This is a bandwidth/latency
model: it ignores CPU contention between the communication thread and compute (which matters on
the 2-core emulated cluster), congestion, and the collectives' own kernel time on GPUs.
"""

from __future__ import annotations

import dataclasses
import math

STRATEGIES = ("ddp", "zero1", "fsdp", "acco", "acco_adaptive", "dpu", "wp")

# Dense bf16 peak FLOP/s per device, and intra-node bandwidth (bits/s per GPU per direction).
DEVICES = {
    "H100": {"flops": 989e12, "intra_bps": 3.6e12, "opt_rate": 1e11},
    "H200": {"flops": 989e12, "intra_bps": 3.6e12, "opt_rate": 1.4e11},
    "A100": {"flops": 312e12, "intra_bps": 2.4e12, "opt_rate": 6e10},
    "L40S": {"flops": 362e12, "intra_bps": 2.5e11, "opt_rate": 2.5e10},
}


@dataclasses.dataclass
class Workload:
    params: float  # trainable parameters P
    flops_per_token: float  # forward + backward
    tokens_per_micro_batch: float  # per rank: local_batch_size × seq_len
    micro_batches: int = 2  # per rank and update (ZeRO-1's accumulation k; ACCO runs k/2 per round)
    comm_bytes: float = 2.0  # bytes per element on the wire (bf16 2, fp32 4)

    def __post_init__(self):
        if self.params <= 0 or self.flops_per_token <= 0 or self.tokens_per_micro_batch <= 0:
            raise ValueError("params, flops_per_token and tokens_per_micro_batch must be positive")
        if self.micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")


@dataclasses.dataclass
class Hardware:
    nodes: int
    flops: float  # achieved FLOP/s of one rank (peak × MFU)
    bandwidth_bps: float | None  # inter-node link per node and direction; None: free
    latency_s: float = 0.0  # one-way, per message
    ranks_per_node: int = 1
    intra_bps: float | None = None  # intra-node bandwidth per rank; None: free
    opt_rate: float = 1e11  # sharded AdamW elements per second per rank
    slow_factor: float = 1.0  # one rank computes this much slower
    compute_s: float | None = None  # measured compute time of one micro-batch (overrides flops)
    # Measured time of each collective over its ring ideal (1: NCCL-like). gloo's reduce-scatter moves
    # about as much as an all-reduce (~2x); see `collective_probe.py`.
    rs_factor: float = 1.0
    ag_factor: float = 1.0
    ar_factor: float = 1.0

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def collective_s(nbytes: float, hw: Hardware) -> float:
    """One ring reduce-scatter or all-gather of a buffer of `nbytes` over all ranks."""
    n, g = hw.nodes, hw.ranks_per_node
    t = 0.0
    if n > 1:
        if hw.bandwidth_bps is not None:
            t += (n - 1) / n * 8 * nbytes / hw.bandwidth_bps
        t += (n - 1) * hw.latency_s
    if g > 1 and hw.intra_bps is not None:
        t += (g - 1) / g * 8 * nbytes / hw.intra_bps
    return t


def predict(work: Workload, hw: Hardware, strategy: str) -> dict:
    """Predicted step (update) time, tokens/s, exposed communication and overlap for one strategy."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(STRATEGIES)}")
    W, P, k = hw.world, work.params, work.micro_batches
    c = hw.compute_s if hw.compute_s is not None else work.flops_per_token * work.tokens_per_micro_batch / hw.flops
    c_slow = c * hw.slow_factor
    V = collective_s(P * work.comm_bytes, hw)
    V_rs, V_ag, V_ar = hw.rs_factor * V, hw.ag_factor * V, hw.ar_factor * 2 * V
    opt_shard = P / W / hw.opt_rate
    M = V_rs + opt_shard + V_ag  # reduce-scatter, sharded AdamW, all-gather
    half = max(1, k // 2)
    tokens = W * k * work.tokens_per_micro_batch
    if strategy == "ddp":
        comm = max(0.0, V_ar - 2 / 3 * c_slow) + P / hw.opt_rate
        step, job = k * c_slow + comm, V_ar
    elif strategy == "zero1":
        step, comm, job = k * c_slow + M, M, M
    elif strategy == "fsdp":
        per_mb = 2 * V_ag + V_rs
        step = k * max(c_slow, per_mb) + opt_shard
        comm, job = step - k * c_slow, k * per_mb
    elif strategy == "acco":
        rnd = max(half * c_slow, M)
        step, comm, job = 2 * rnd, 2 * (rnd - half * c_slow), 2 * M
    elif strategy == "acco_adaptive":
        rnd = max(half * c_slow, M)
        per_rank = [max(half, rnd / (c_slow if i == 0 and hw.slow_factor > 1 else c)) for i in range(W)]
        tokens = 2 * sum(per_rank) * work.tokens_per_micro_batch
        step, comm, job = 2 * rnd, 0.0, 2 * M
    else:  # dpu, wp: one job per update beside a period of k micro-batches
        step = max(k * c_slow, M)
        comm, job = step - k * c_slow, M
    overlap = 1.0 - comm / job if job > 0 else 1.0
    return {
        "strategy": strategy,
        "step_time_s": step,
        "tokens_per_update": tokens,
        "tokens_per_s": tokens / step,
        "exposed_comm_s": comm,
        "overlap": min(1.0, max(0.0, overlap)),
        "compute_s": c,
        "job_s": M,
        "collective_s": V,
    }


def predict_all(work: Workload, hw: Hardware, strategies=STRATEGIES) -> dict[str, dict]:
    return {s: predict(work, hw, s) for s in strategies}


def memory_bytes(work: Workload, hw: Hardware, strategy: str, compute_bytes: float = 2.0) -> float:
    """Persistent bytes per rank: parameters, gradient accumulator, fp32 master + AdamW moments."""
    P, W = work.params, hw.world
    if strategy == "ddp":
        return P * (4 + 4 + 8)  # fp32 replica, grads, m and v (autocast keeps fp32 weights)
    if strategy == "fsdp":
        return P * (4 + 4 + 8) / W
    base = P * compute_bytes + P * 4 + P * 12 / W  # flat params, fp32 accumulator, sharded master/m/v
    if strategy in ("acco", "acco_adaptive", "dpu", "wp"):
        base += P * compute_bytes  # the job's communication buffer
    return base


def balance_bandwidth(work: Workload, hw: Hardware) -> float:
    """The link rate (bits/s) at which ZeRO-1's exposed communication equals its compute."""
    c = hw.compute_s if hw.compute_s is not None else work.flops_per_token * work.tokens_per_micro_batch / hw.flops
    compute = work.micro_batches * c * hw.slow_factor - work.params / hw.world / hw.opt_rate
    if compute <= 0 or hw.nodes < 2:
        raise ValueError("no balance point: the optimizer step alone outlasts the compute, or one node")
    bits = (hw.rs_factor + hw.ag_factor) * (hw.nodes - 1) / hw.nodes * 8 * work.params * work.comm_bytes
    latency = 2 * (hw.nodes - 1) * hw.latency_s
    if compute <= latency:
        raise ValueError("no balance point: latency alone outlasts the compute")
    return bits / (compute - latency)


def model_workload(
    model: str,
    flavor: str,
    seq_len: int,
    local_batch: int,
    micro_batches: int,
    vocab_size: int | None = None,
    comm_bytes: float = 2.0,
) -> Workload:
    """A Workload from a model folder's flavor (parameters and FLOPs per token from its ModelArgs)."""
    from torchacco.spec import get_model_spec

    spec = get_model_spec(model)
    if flavor not in spec.flavors:
        raise ValueError(f"model {model!r} has no flavor {flavor!r}; one of {', '.join(spec.flavors)}")
    args = spec.flavors[flavor]
    if vocab_size:
        args = dataclasses.replace(args, vocab_size=vocab_size)
    return Workload(
        params=float(args.num_params()),
        flops_per_token=float(args.flops_per_token(seq_len)),
        tokens_per_micro_batch=float(seq_len * local_batch),
        micro_batches=micro_batches,
        comm_bytes=comm_bytes,
    )


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def format_table(preds: dict[str, dict], memory: dict[str, float] | None = None) -> str:
    base = preds.get("zero1")
    head = "| strategy | step time (s) | tokens/s | exposed comm (s) | overlap | vs ZeRO-1 |"
    sep = "|---|---:|---:|---:|---:|---:|"
    if memory:
        head += " memory/rank (GiB) |"
        sep += "---:|"
    rows = [head, sep]
    for name, p in preds.items():
        ratio = f"{p['tokens_per_s'] / base['tokens_per_s']:.2f}×" if base else "-"
        row = (
            f"| {name} | {p['step_time_s']:.4g} | {p['tokens_per_s']:,.0f} | {p['exposed_comm_s']:.4g} | "
            f"{p['overlap']:.0%} | {ratio} |"
        )
        if memory:
            row += f" {memory[name] / 2**30:.1f} |"
        rows.append(row)
    return "\n".join(rows) + "\n"
