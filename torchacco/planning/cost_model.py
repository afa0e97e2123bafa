"""A cost model for the data-parallel strategies: time per update, and time to a target loss.

`torchacco/planning/predict.py` is its command line; the benchmarks in `benchmarks/` check it against measured runs.

Inputs: the model (parameters P, FLOPs per token), tokens per micro-batch and micro-batches per update (k), the achieved
FLOP/s of one rank, the inter-node bandwidth B and latency L per link, the ranks (N nodes × G per node, W = N·G), the
sharded optimizer's speed, and one rank slower by a factor. Per update, with c the compute time of one micro-batch and S
the bytes of one gradient (or parameter) buffer on the wire:

  one reduce-scatter or all-gather  V = (N-1)/N · 8S/B + (N-1)·L + (G-1)/G · 8S/B_intra   (hierarchical ring)
  as measured for a backend         V_rs = f_rs·V, V_ag = f_ag·V, V_ar = f_ar·2V  (f = 1 for NCCL and
                                    torchacco's gloo rings; gloo's own reduce-scatter is ~2)
  the sharded job                   M = V_rs + P/W / opt_rate + V_ag

The formula follows the strategy's traits (`communication`, `overlapped`, `periods_per_update`), one function per
communication kind (`FORMULAS`), so a new strategy is modelled by the traits it shares. Synchronous strategies run at
the slowest rank's pace, or balanced ([parallelism] balance_batches) at the makespan of the update's k·W micro-batches
split by speed. DiLoCo: `predict_diloco`.

Time to a target loss = the tokens a strategy needs for it / its tokens per second: DDP's tokens times the strategy's
ratio measured in `token_efficiency.json`, beside it (`python -m benchmarks efficiency-table` writes it; `token_source`
and `diloco_token_source` say which entry covers a row; none: no time, never advised). The ratios were measured on a
small model: at another scale they are an extrapolation, which `predict` states. A bandwidth/latency model: it ignores
CPU contention between the communication thread and compute, congestion, and kernels' own time.
"""

import dataclasses
import functools
import json
import math
import re
from pathlib import Path

import torch

from torchacco.config import DiLoCo as DiLoCoConfig
from torchacco.device import PEAK_BF16_FLOPS
from torchacco.errors import UserError
from torchacco.parallel import registry
from torchacco.parallel.balance import split_by_speed
from torchacco.parallel.diloco import DiLoCo, fragment_of
from torchacco.parallel.diloco.wire import WIRE_BYTES, bytes_per_element  # noqa: F401 (predict reads WIRE_BYTES)
from torchacco.parallel.strategy import Traits
from torchacco.spec import get_model_spec

REFERENCE = registry.default_name()  # DDP: the strategy whose tokens to its loss every measured ratio divides

# The variants modelled beside each strategy's plain self, which the benchmarks run too: label (its strategy's name
# first) -> (the extra `--section.key VALUE` arguments that select it, the cost model's mode).
VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
    "ddp_balanced": (("--parallelism.balance_batches", "true"), "balanced"),
    "zero1_balanced": (("--parallelism.balance_batches", "true"), "balanced"),
    "acco_bf16_estimate": (("--acco.estimate_comm", "bf16"), "bf16_estimate"),
    "acco_balanced": (("--acco.mode", "balanced"), "balanced"),
    "acco_adaptive": (("--acco.mode", "adaptive"), "adaptive"),  # capped at max_growth (default 2)
    "acco_adaptive_uncapped": (("--acco.mode", "adaptive", "--acco.max_growth", "0"), "adaptive_uncapped"),
    # 7 of every 8 micro-batches at θ̃: level with DDP per token at its best lr (docs/acco.md); needs 8 per rank
    "acco_share875": (("--acco.estimate_share", "0.875"), "share875"),
}
ESTIMATE_SHARES = {"share875": 0.875}  # an estimating strategy's mode -> the share of an update computed at θ̃


def variants() -> dict[str, tuple[type, str]]:
    """label -> (registered strategy class, mode): each strategy's plain self ('deterministic'), then its `VARIANTS`."""
    out = {}
    for name, cls in registry.strategies().items():
        out[name] = (cls, "deterministic")
        out |= {label: (cls, mode) for label, (_, mode) in VARIANTS.items() if _strategy_of(label) == name}
    return out


def variant_arguments(label: str) -> list[str]:
    """The trainer arguments that select a modelled strategy (`variants()`'s label)."""
    extra = VARIANTS[label][0] if label in VARIANTS else ()
    return ["--parallelism.data_parallel", variants()[label][0].name, *extra]


def _strategy_of(label: str) -> str | None:
    """The registered strategy a variant's label starts with (the longest name that fits)."""
    return max((n for n in registry.names() if label.startswith(n + "_")), key=len, default=None)


# Per device: dense bf16 peak FLOP/s (device.py's), intra-node bandwidth (bits/s per GPU per direction), memory (GiB).
DEVICES = {
    name: {"flops": PEAK_BF16_FLOPS[name], **rest}
    for name, rest in {
        "H100": {"intra_bps": 3.6e12, "opt_rate": 1e11, "memory_gib": 79.6},
        "H200": {"intra_bps": 3.6e12, "opt_rate": 1.4e11, "memory_gib": 139.8},
        "A100": {"intra_bps": 2.4e12, "opt_rate": 6e10, "memory_gib": 79.2},
        "L40S": {"intra_bps": 2.5e11, "opt_rate": 2.5e10, "memory_gib": 44.5},
    }.items()
}
# Activation bytes per token, per block and per unit of width kept for backward, by [training]
# activation_checkpoint, in bf16 (Korthikanti et al. 2022 with a fused attention: 34 without recompute;
# torchtitan's op-level selective recompute keeps the matmul outputs, about two thirds; full recompute keeps
# each block's input, 2).
ACTIVATION_BYTES = {"none": 34.0, "selective": 22.0, "full": 2.0}
# Of those, what a tensor-parallel rank keeps over the whole sequence, undivided by tp (sequence parallelism splits
# the rest): selective keeps the row-wise wo and w2 matmuls' outputs, partial sums before their reduce-scatter;
# without recompute, the column-wise matmuls keep their all-gathered inputs (attention's and the MLP's); full keeps
# only the block's sequence-split input.
TP_WHOLE_SEQUENCE_BYTES = {"none": 4.0, "selective": 4.0, "full": 0.0}


@dataclasses.dataclass
class Workload:
    params: float  # trainable parameters P
    flops_per_token: float  # forward + backward
    tokens_per_micro_batch: float  # per rank: local_batch_size × seq_len
    micro_batches: int = 2  # per rank and update (ZeRO-1's accumulation k; ACCO runs k/2 per round)
    comm_bytes: float = 2.0  # bytes per element on the wire (bf16 2, fp32 4)
    activation_bytes: float = 0.0  # peak activations of one micro-batch on a rank (0: not counted)
    # DDP's gradient buckets ([parallelism] bucket_cap_mb): torch's default fills a small first one, whose all-reduce
    # starts early in the backward; a cap that is set makes every bucket that size
    bucket_bytes: float = 25 * 2**20
    first_bucket_bytes: float | None = 2**20  # None: bucket_bytes
    # [optimizer] name = "muon" (`optim.muon_workload`): the hidden matrices' elements, one step's Newton–Schulz
    # FLOPs, the largest matrix's elements
    muon_params: float = 0.0
    muon_flops: float = 0.0
    muon_largest: float = 0.0

    def __post_init__(self):
        if self.params <= 0 or self.flops_per_token <= 0 or self.tokens_per_micro_batch <= 0:
            raise ValueError("params, flops_per_token and tokens_per_micro_batch must be positive")
        if self.micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        if self.bucket_bytes <= 0 or (self.first_bucket_bytes is not None and self.first_bucket_bytes <= 0):
            raise ValueError("bucket_bytes and first_bucket_bytes must be positive")


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
    # about as much as an all-reduce (~2x); see `benchmarks/workers/collective_probe.py`.
    rs_factor: float = 1.0
    ag_factor: float = 1.0
    ar_factor: float = 1.0
    max_growth: float = 2.0  # adaptive ACCO: a rank's round runs at most this multiple of its micro-batches
    # False: a device without streams (CPU). FSDP2 then waits for each of its collectives where it issues them,
    # so they add to the compute; DDP's reducer and the sharded job's thread still run theirs beside it.
    streams: bool = True

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def micro_batch_s(self, work: Workload) -> float:
        if self.compute_s is not None:
            return self.compute_s
        return work.flops_per_token * work.tokens_per_micro_batch / self.flops


def hardware(link, nodes: int, gpus_per_node: int, **more) -> Hardware:
    """The Hardware of `nodes` × `gpus_per_node` GPUs that `link`, `add_cluster_arguments`' options, describe."""
    dev = DEVICES.get(link.device)
    if dev is None:
        raise UserError(f"unknown --device {link.device!r}; one of {', '.join(DEVICES)}")
    return Hardware(
        nodes=nodes, ranks_per_node=gpus_per_node, flops=dev["flops"] * link.mfu, intra_bps=dev["intra_bps"],
        bandwidth_bps=parse_rate(link.bandwidth), latency_s=link.latency_ms / 1000, opt_rate=dev["opt_rate"], **more,
    )  # fmt: skip


def add_cluster_arguments(parser) -> None:
    """The command-line options `hardware` reads, which predict and the dry run share."""
    parser.add_argument("--device", default="H100", help=f"the cost model's GPU: one of {', '.join(DEVICES)}")
    parser.add_argument("--mfu", type=float, default=0.4, help="the share of the device's bf16 peak achieved")
    parser.add_argument("--bandwidth", default="100gbit", help="inter-node link per node and direction")
    parser.add_argument("--latency-ms", type=float, default=0.01, help="one-way latency of the inter-node link")


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(rate: str | float | None) -> float | None:
    """'200mbit' / '1gbit' / '1.5Gbit' / 2e8 -> bits per second; None, '', 'none', 'unshaped' -> None."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise UserError(f"link rate must be positive, got {rate}")
        return float(rate)
    text = rate.strip().lower()
    if text in ("", "none", "unshaped", "inf"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps|b/s)?", text)
    if not m or float(m.group(1)) <= 0:
        raise UserError(f"cannot read link rate {rate!r}; write e.g. 50mbit, 1gbit, 10gbit or 'unshaped'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def format_rate(bps: float | None) -> str:
    """Bits per second as `parse_rate` reads them back (None or 0: 'unshaped')."""
    if not bps:
        return "unshaped"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bps >= scale:
            value = bps / scale
            return f"{value:g}{unit}" if value == round(value, 3) else f"{value:.3f}{unit}"
    return f"{bps:g}bit"


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


def buckets(total: float, cap: float, first: float | None = None) -> list[float]:
    """The bytes of each of DDP's gradient buckets, in the order the backward fills them."""
    head = [min(total, first)] if first else []
    rest = total - sum(head)
    return head + [cap] * int(rest // cap) + ([rest % cap] if rest % cap else [])


DDP_GRADIENT_BYTES = 4  # torchacco's DDP keeps fp32 weights and gradients (autocast computes in bf16)


def ddp_buckets(bucket_cap_mb: float) -> dict:
    """Workload's bucket fields for [parallelism] bucket_cap_mb (0: torch's default), in whole bytes as torch's."""
    return {} if not bucket_cap_mb else {"bucket_bytes": int(bucket_cap_mb * 2**20), "first_bucket_bytes": None}


@dataclasses.dataclass(frozen=True)
class _Update:
    """What every formula reads (V and M as in the module's docstring)."""

    work: Workload
    hw: Hardware
    traits: Traits
    mode: str
    times: list[float]  # each rank's seconds per micro-batch
    period: float  # the update's compute: k·c_slow, or balanced, the makespan of its k·W micro-batches
    V: float
    M: float  # the sharded job
    opt_shard: float  # P/W / opt_rate
    tokens: float  # per update

    @property
    def c_slow(self) -> float:
        return max(self.times)


def _all_reduce_in_backward(u: _Update) -> tuple[float, float, float, float]:
    """ddp: k·c + E + P / opt_rate, E the all-reduce's end past the last backward (⅔c): DDP's buckets fill at an even
    rate through it, and each is all-reduced once it is full and the one before is done. About max(0, V_ar − ⅔c) for
    many small buckets, V_ar for a model in one."""
    work, hw, backward_s = u.work, u.hw, 2 / 3 * u.c_slow
    total = work.params * DDP_GRADIENT_BYTES  # torch fills the buckets with the gradients' own bytes
    done = filled = 0.0
    for size in buckets(total, work.bucket_bytes, work.first_bucket_bytes):
        filled += size
        wire = size * work.comm_bytes / DDP_GRADIENT_BYTES
        done = max(done, backward_s * filled / total) + hw.ar_factor * 2 * collective_s(wire, hw)
    comm = max(0.0, done - backward_s) + work.params / hw.opt_rate
    return u.period + comm, comm, hw.ar_factor * 2 * u.V, u.tokens


def _per_micro_batch(u: _Update) -> tuple[float, float, float, float]:
    """fsdp: (k−1)·max(c, 2V_ag) + max(c, 2V_ag + V_rs) + P/W / opt_rate (prefetched all-gathers; the reduce-scatter
    only on the last micro-batch); without streams (CPU), where FSDP2 waits for each collective where it issues it,
    k·(c + 2V_ag) + V_rs + P/W / opt_rate.
    hsdp (inside a node): the same over the node's G ranks (v: the node's ring), plus the shards' all-reduce across
    nodes, A = 2·(N−1)/N · 8S/B (a gradient per node): (k−1)·max(c, 2v_ag) + max(c, 2v_ag + v_rs) + max(0, A − ⅔c)
    + P/G / opt_rate (without streams, A added whole)."""
    work, hw, k, c_slow, P = u.work, u.hw, u.work.micro_batches, u.c_slow, u.work.params
    ag, rs, inter, opt = hw.ag_factor * u.V, hw.rs_factor * u.V, 0.0, u.opt_shard
    if u.traits.shards_within_node:
        node = collective_s(P * work.comm_bytes, dataclasses.replace(hw, nodes=1))  # the node's ring
        ag, rs = hw.ag_factor * node, hw.rs_factor * node
        inter = hw.ar_factor * 2 * collective_s(P * work.comm_bytes, dataclasses.replace(hw, ranks_per_node=1))
        opt = P / hw.ranks_per_node / hw.opt_rate
    if hw.streams:  # hsdp's all-reduce across nodes hides under the last backward (as DDP's buckets)
        step = (k - 1) * max(c_slow, 2 * ag) + max(c_slow, 2 * ag + rs) + max(0.0, inter - 2 / 3 * c_slow)
    else:
        step = k * (c_slow + 2 * ag) + rs + inter
    step += opt
    return step, step - k * c_slow, k * 2 * ag + rs + inter, u.tokens


def _sharded_job(u: _Update) -> tuple[float, float, float, float]:
    """zero1 (synchronous): k·c + M. Overlapped: p rounds of max(k/p·c, M) (acco: p = 2; dpu, wp: p = 1); acco at
    estimate_share s: max(s·k·c, M) + max((1 − s)·k·c, M). Their modes: balanced splits each round's k/p·W micro-batches
    by speed (rounds of max(makespan, M)); adaptive keeps every rank computing during the job, up to max_growth × k/p
    micro-batches per round (the batch grows); a bf16 estimate halves the estimate round's bytes."""
    work, hw, mode, traits, times, M = u.work, u.hw, u.mode, u.traits, u.times, u.M
    if not traits.overlapped:
        return u.period + M, M, M, u.tokens
    k, c_slow, tokens = work.micro_batches, u.c_slow, u.tokens
    periods = traits.periods_per_update
    per_round = max(1, k // periods)
    jobs = [M] * periods
    share = ESTIMATE_SHARES.get(mode) if traits.estimates else None  # estimate_share: unequal rounds
    if mode == "bf16_estimate" and work.comm_bytes > 2:  # the estimate round's bytes halve
        jobs[0] = (hw.rs_factor * u.V + hw.ag_factor * u.V) * 2 / work.comm_bytes + u.opt_shard
    if mode == "balanced":
        split = split_by_speed(per_round * hw.world, times)
        compute = max(n * t for n, t in zip(split, times))
    else:
        compute = per_round * c_slow
    computes = [share * k * c_slow, (1 - share) * k * c_slow] if share else [compute] * periods
    rounds = [max(work_s, m) for work_s, m in zip(computes, jobs)]
    step, job = sum(rounds), sum(jobs)
    comm = sum(r - work_s for r, work_s in zip(rounds, computes))
    if mode.startswith("adaptive"):  # everyone computes while the job runs, up to the cap
        capped = hw.max_growth and mode != "adaptive_uncapped"
        cap = hw.max_growth * per_round if capped else math.inf
        done = [sum(min(cap, max(per_round, r / t)) for r in rounds) for t in times]
        tokens = sum(done) * work.tokens_per_micro_batch
        comm = sum(max(0.0, r - cap * min(times)) for r in rounds)  # a capped fast rank waits
    return step, comm, job, tokens


# A strategy's time per update by its `communication` trait: (step, exposed communication, job, tokens per update)
FORMULAS = {
    "all_reduce_in_backward": _all_reduce_in_backward,
    "per_micro_batch": _per_micro_batch,
    "sharded_job": _sharded_job,
}


def muon_seconds(work: Workload, hw: Hardware, traits: Traits, V: float) -> float:
    """Muon's seconds beyond AdamW's per optimizer step (docs/optimizers.md): Newton–Schulz on every matrix on every
    rank and, under fsdp and hsdp, the matrices' bf16 updates all-gathered over the shard group; in the sharded job,
    Newton–Schulz on a rank's slice's share and the bf16 pieces of the matrices that straddle its slice's edges, at
    most one matrix from the rank across a node boundary."""
    if not work.muon_params:
        return 0.0
    if traits.communication == "sharded_job":
        edge = 0.0 if hw.world == 1 else exchange_s(2 * work.muon_largest, hw)
        return work.muon_flops / hw.world / hw.flops + edge
    if traits.communication != "per_micro_batch":
        return work.muon_flops / hw.flops
    group = dataclasses.replace(hw, nodes=1) if traits.shards_within_node else hw
    return work.muon_flops / hw.flops + hw.ag_factor * collective_s(2 * work.muon_params, group)


def exchange_s(nbytes: float, hw: Hardware) -> float:
    """One point-to-point message of `nbytes` each way between neighbouring ranks, across nodes where there are
    several (the slowest pair)."""
    bps, latency = (hw.bandwidth_bps, hw.latency_s) if hw.nodes > 1 else (hw.intra_bps, 0.0)
    return (8 * nbytes / bps if bps else 0.0) + latency


def predict(work: Workload, hw: Hardware, strategy: str) -> dict:
    """Predicted time per update, tokens/s, exposed communication and overlap for one strategy."""
    known = variants()
    if strategy not in known:
        raise ValueError(f"unknown strategy {strategy!r}; one of {', '.join(known)}")
    cls, mode = known[strategy]
    traits, W, k = cls.traits, hw.world, work.micro_batches
    c = hw.micro_batch_s(work)
    times = [c * hw.slow_factor] + [c] * (W - 1)  # each rank's seconds per micro-batch, rank 0 the slow one
    V = collective_s(work.params * work.comm_bytes, hw)
    opt_shard = work.params / W / hw.opt_rate
    M = hw.rs_factor * V + opt_shard + hw.ag_factor * V  # reduce-scatter, sharded AdamW, all-gather
    muon = muon_seconds(work, hw, traits, V)
    M += muon if traits.communication == "sharded_job" else 0.0  # inside each job, beside the compute
    period = k * max(times)
    if mode == "balanced" and not traits.overlapped:  # DDP keeps at least one micro-batch on every rank
        minimum = 1 if traits.communication == "all_reduce_in_backward" else 0
        period = max(n * t for n, t in zip(split_by_speed(k * W, times, minimum), times))
    update = _Update(work, hw, traits, mode, times, period, V, M, opt_shard, W * k * work.tokens_per_micro_batch)
    step, comm, job, tokens = FORMULAS[traits.communication](update)
    if traits.communication != "sharded_job":  # after the backward, exposed
        step, comm, job = step + muon, comm + muon, job + muon
    overlap = 1.0 - comm / job if job > 0 else 1.0
    return {"strategy": strategy, "step_time_s": step, "tokens_per_update": tokens, "tokens_per_s": tokens / step,
            "exposed_comm_s": comm, "overlap": min(1.0, max(0.0, overlap)), "compute_s": c, "job_s": M}  # fmt: skip


def predict_diloco(
    work: Workload, hw: Hardware, inner: str, sync_every: int, fragments: int = 1, overlap_steps: int = 0,
    outer_dtype: str = "fp32", fragment_params: list[float] | None = None, topk: float = 0.0, balanced: bool = False,
) -> dict:  # fmt: skip
    """Time per update of DiLoCo (docs/diloco.md) with one replica per node and `inner` over each node's G ranks:
    t_in + Σ_f max(0, T_f − τ·t_in) / H, t_in the inner update's time on one node. T_f: fragment f's pseudo-gradient
    over the link, D_f = P_f elements × wire bytes (`fragment_params`, from `model_fragment_params`: the first holds
    the embedding; else P/F each); fp32 is an all-reduce, 2(N−1)/N · 8D_f/B, bf16, the integer codes and top-k messages
    are all-gathered, (N−1) · 8D_f/B, each at its probed factor. A sharded inner strategy's ranks send their shards;
    ddp's, whose ranks all hold all of θ, 1/G of it each, then all-gather the fp32 mean in the node. `balanced`
    ([diloco] balance_replicas): t_in is a fast node's, and the slow node's replica computes t_in / t_slow of its
    updates (the tokens per update shrink by that share of one replica's)."""
    cls, _ = variants()[inner]
    node = dataclasses.replace(hw, nodes=1)
    inside = predict(work, node, inner)
    t_in, share = inside["step_time_s"], 1.0
    if balanced and hw.slow_factor > 1:
        inside = predict(work, dataclasses.replace(node, slow_factor=1.0), inner)
        share = (hw.nodes - 1 + inside["step_time_s"] / t_in) / hw.nodes
        t_in = inside["step_time_s"]
    sizes = list(fragment_params) if fragment_params is not None else [work.params / fragments] * fragments
    if len(sizes) != fragments:
        raise ValueError(f"fragment_params has {len(sizes)} sizes for {fragments} fragments")
    n = hw.nodes
    all_reduce = outer_dtype == "fp32" and not topk
    hops, factor = (2 * (n - 1) / n, hw.ar_factor) if all_reduce else (n - 1, hw.ag_factor)
    wire = bytes_per_element(outer_dtype, topk)

    def transfer_s(params: float) -> float:
        if n == 1:
            return 0.0
        link = factor * hops * 8 * params * wire / hw.bandwidth_bps if hw.bandwidth_bps else 0.0
        gather = 0.0 if cls.traits.shards_theta else hw.ag_factor * collective_s(4.0 * params, node)
        return link + 2 * (n - 1) * hw.latency_s + gather

    transfers = [transfer_s(p) for p in sizes]
    exposed = sum(max(0.0, t - overlap_steps * t_in) for t in transfers) / sync_every
    step = t_in + exposed
    tokens = hw.world * work.micro_batches * work.tokens_per_micro_batch * share
    wire_label = "" if all_reduce else f", {outer_dtype}" + (f" top-k {topk:g}" if topk else "")
    return {"strategy": f"diloco_h{sync_every} ({inner} inside{wire_label})", "step_time_s": step,
            "tokens_per_update": tokens, "tokens_per_s": tokens / step,
            "exposed_comm_s": step - t_in + inside["exposed_comm_s"],
            "overlap": max(0.0, 1.0 - exposed * sync_every / sum(transfers)) if sum(transfers) else 1.0}  # fmt: skip


@functools.cache
def model_fragment_params(model: str, flavor: str, fragments: int, vocab_size: int | None = None) -> tuple[float, ...]:
    """The parameters of each of DiLoCo's fragments of a model folder's flavor, as the trainer splits it
    (`diloco.fragment_of`, on the meta device: nothing is allocated)."""
    spec = get_model_spec(model)
    with torch.device("meta"):
        return tuple(fragment_sizes(spec.model_cls(spec.args(flavor, vocab_size=vocab_size or None)), fragments))


def fragment_sizes(module: torch.nn.Module, fragments: int) -> list[float]:
    named = list(module.named_parameters())
    sizes = [0.0] * fragments
    for (_, p), f in zip(named, fragment_of(module, [name for name, _ in named], fragments)):
        sizes[f] += p.numel()
    return sizes


def layout_memory(cls, params: float, group: int, dtype, reduce_dtype, options=None, outer=None, largest=1.0):
    """A rank's persistent `MemoryParts` for `params` elements over `group` data-parallel ranks (`Strategy.memory`),
    plus DiLoCo's outer state for a [diloco] section `outer` (`largest`: the largest fragment's share of θ)."""
    memory = cls.memory(params, group, dtype, reduce_dtype, options)
    return memory if outer is None else memory + DiLoCo.outer_memory(params, cls, group, outer, largest)


def diloco_memory_bytes(
    work: Workload, hw: Hardware, inner: str, offload: bool = False, outer=None, largest: float = 1.0
) -> float:
    """The inner strategy's persistent bytes over a node's ranks plus DiLoCo's outer state of this rank's part of θ
    (`DiLoCo.outer_memory`; `outer`: the [diloco] section, else its defaults with `offload`)."""
    cls, _ = variants()[inner]
    outer = DiLoCoConfig(offload=offload) if outer is None else outer
    return layout_memory(cls, work.params, hw.ranks_per_node, torch.bfloat16, torch.float32, outer=outer,
                         largest=largest).total  # fmt: skip


TOKEN_EFFICIENCY = Path(__file__).with_name("token_efficiency.json")
# Cost-model modes that compute the plain strategy's update (a balanced mode splits the same batch by speed);
# a bf16 estimate or an adaptive batch changes the update itself.
PLAIN_UPDATE = ("deterministic", "balanced")
# [diloco] settings that say where the outer state lives or how a failure is survived, not what an outer step computes
NOT_THE_UPDATE = ("offload", "fault_tolerant", "lighthouse", "min_replicas", "join_timeout_s", "round_timeout_s")
TOPK_ONLY = ("error_decay", "topk_mean")  # settings of the residual and the sparse mean: nothing without topk
# The DiLoCo configurations predict advises: each a token_efficiency.json entry (with either optimizer), whose record
# holds the settings that were measured (`measured_diloco`), with its plain name. The recipes are checked against it.
MEASURED = {
    "streaming_h10_avg_topk3_int2_senders_warm100_muon_r4": "Streaming DiLoCo, top 3%, 2-bit, warm start",
    "streaming_h10_avg_topk3_int2_senders": "Streaming DiLoCo, top 3%, 2-bit",
    "streaming_h10_avg_topk1_int2_senders": "Streaming DiLoCo, top 1%, 2-bit",
    "streaming_h10_avg": "Streaming DiLoCo, bf16",
    "streaming_h10_pier_warm100_r4": "Streaming DiLoCo, bf16, warm start and Nesterov",
    "streaming_h10_avg_r4": "Streaming DiLoCo, bf16",
}


def measured_diloco(label: str) -> tuple[int, DiLoCoConfig]:
    """A `MEASURED` entry's replicas and [diloco] section, as it was measured."""
    record, names = _entries(None)[label]["diloco"], {f.name for f in dataclasses.fields(DiLoCoConfig)}
    return record["replicas"], DiLoCoConfig(**{k: v for k, v in record.items() if k in names})


@functools.cache
def token_table() -> dict:
    """The measured token-efficiency table shipped with torchacco (`benchmarks efficiency-table` writes it)."""
    return json.loads(TOKEN_EFFICIENCY.read_text(encoding="utf-8"))


def _entries(table: dict | None) -> dict[str, dict]:
    return (token_table() if table is None else table)["tokens_to_target"]


def _update(label: str) -> str:
    """The label whose update `label` computes: itself, or for a plain-update mode its strategy's (or the one whose
    update that strategy computes)."""
    if label not in variants():
        return label
    cls, mode = variants()[label]
    return (cls.traits.update_of or cls.name) if mode in PLAIN_UPDATE else label


def token_source(label: str, table: dict | None = None, optimizer: str = "adamw") -> str | None:
    """The measured entry whose tokens `label` needs with `optimizer`: its own, else (a plain-update mode) its
    strategy's, else that of the strategy whose update it computes; DDP with AdamW, the reference, is its own. An
    optimizer other than AdamW is its entries' suffix (ddp_muon). None: no measurement covers it."""
    entries = _entries(table).items()
    measured = {name for name, e in entries if "diloco" not in e and e.get("optimizer", "adamw") == optimizer}
    cls, mode = variants()[label]
    plain = (cls.name, cls.traits.update_of) if mode in PLAIN_UPDATE else ()
    suffix, reference = ("", {REFERENCE}) if optimizer == "adamw" else (f"_{optimizer}", set())
    return next((n + suffix for n in (label, *plain) if n and n + suffix in measured | reference), None)


def diloco_token_source(inner: str, replicas: int, outer, table: dict | None = None, optimizer="adamw") -> str | None:
    """The measured DiLoCo entry for `replicas` replicas with `inner` inside stepping `optimizer` and the outer step
    `outer` (a `torchacco.config.DiLoCo`): one with the same replicas, inner update, optimizer and [diloco] settings
    (but NOT_THE_UPDATE), or None. The ranks inside a replica are not matched: they change the inner update's
    floating-point order, not the update."""
    for name, entry in _entries(table).items():
        run = entry.get("diloco")
        if run and run["replicas"] == replicas and _update(run["inner"]) == _update(inner) and _same(outer, run):
            if entry.get("optimizer", "adamw") == optimizer:
                return name
    return None


def measured_outer_step(outer) -> str | None:
    """The `MEASURED` configuration whose outer step `outer` (a [diloco] section) runs, whatever its replicas and inner
    strategy; None: none."""
    return next((label for label in MEASURED if _same(outer, _entries(None)[label]["diloco"])), None)


def _same(outer, recorded: dict) -> bool:
    """Whether a [diloco] section runs an entry's recorded outer step (NOT_THE_UPDATE aside)."""
    settings, defaults = dataclasses.asdict(outer), dataclasses.asdict(type(outer)())
    ignored = NOT_THE_UPDATE + (() if outer.topk else TOPK_ONLY)
    recorded = {**defaults, **recorded}  # a setting an entry does not record (it predates it) had its default
    return all(settings[key] == recorded[key] for key in settings if key not in ignored)


def measured_entry(source: str, table: dict | None = None) -> dict:
    """A measured entry (`token_source`'s answer): mean, ci95, seeds and source; DDP's is 1 by definition."""
    if source == REFERENCE:
        return {"mean": 1.0, "ci95": 0.0, "seeds": None, "source": "the reference"}
    return _entries(table)[source]


def not_reached_note(source: str | None, table: dict | None = None) -> str | None:
    """For an entry that never reached DDP's loss: what the time-to-loss cell says instead of a time."""
    within = None if source is None else measured_entry(source, table).get("not_reached_within")
    return None if within is None else f"not reached in {within:g}× the tokens"


def predict_all(work: Workload, hw: Hardware) -> dict[str, dict]:
    """Every registered variant's prediction."""
    return {s: predict(work, hw, s) for s in variants()}


def memory_bytes(work: Workload, hw: Hardware, strategy: str) -> float:
    """Persistent bytes per rank: parameters, gradients, optimizer state and buffers, as the strategy class counts them
    (`Strategy.memory`, with its default options, bf16 compute and an fp32 reduction)."""
    cls, _ = variants()[strategy]
    sharded_over = hw.ranks_per_node if cls.traits.shards_within_node else hw.world
    return layout_memory(cls, work.params, sharded_over, torch.bfloat16, torch.float32).total


def model_workload(
    model: str, flavor: str, seq_len: int, local_batch: int, micro_batches: int, vocab_size: int | None = None,
    comm_bytes: float = 2.0, activation_checkpoint: str = "selective", loss_chunks: int = 8,
) -> Workload:  # fmt: skip
    """A Workload from a model folder's flavor (parameters, FLOPs per token and activations from its ModelArgs)."""
    args = get_model_spec(model).args(flavor, vocab_size=vocab_size or None)
    return Workload(
        params=float(args.num_params()),
        flops_per_token=float(args.flops_per_token(seq_len)),
        tokens_per_micro_batch=float(seq_len * local_batch),
        micro_batches=micro_batches,
        comm_bytes=comm_bytes,
        # the blocks' saved tensors plus one loss chunk's fp32 logits and their gradient
        activation_bytes=block_activation_bytes(args, seq_len * local_batch, activation_checkpoint)
        + loss_activation_bytes(args, seq_len * local_batch, loss_chunks),
    )


def block_activation_bytes(args, tokens: float, checkpoint: str, selective: str = "op", blocks=None, tp=1) -> float:
    """What `blocks` blocks (all the model's: None) keep for backward over `tokens` tokens on each of `tp`
    tensor-parallel ranks: 1/tp of it, but for the tensors kept over the whole sequence (TP_WHOLE_SEQUENCE_BYTES).
    [training] selective_checkpoint = k recomputes every k-th block whole and keeps all of the others'."""

    def per_block(table: dict) -> float:
        if checkpoint == "selective" and selective != "op":
            k = int(selective)
            return (table["full"] + (k - 1) * table["none"]) / k
        return table[checkpoint]

    whole = per_block(TP_WHOLE_SEQUENCE_BYTES) if tp > 1 else 0.0
    per_rank = (per_block(ACTIVATION_BYTES) - whole) / tp + whole
    return per_rank * tokens * args.dim * (args.n_layers if blocks is None else blocks)


def loss_activation_bytes(args, tokens: float, loss_chunks: int, vocab_split: int = 1) -> float:
    """One loss chunk's fp32 logits and their gradient (split by vocabulary `vocab_split` ways)."""
    return 2 * 4 * tokens * args.vocab_size / max(loss_chunks, 1) / vocab_split


def model_parallel_layout(
    work: Workload, hw: Hardware, tp: int, pp: int, local_params: float, pieces: int = 1, stages_per_rank: int = 1
) -> tuple[Workload, Hardware]:
    """The data-parallel problem of a run with tensor and pipeline parallelism, for `predict`: each (pp, tp)
    coordinate's ranks run the strategy over `local_params` (a rank's part of the model) on a ring of the dp ranks
    holding that part; a rank computes 1/(tp·pp) of the FLOPs, plus the pipeline's bubble over `pieces` micro-batches
    per step ((pp − 1) / (pieces · stages_per_rank) more). The dp ranks of a coordinate sit tp ranks apart, G/tp to a
    node; the tp·pp coordinates of a node share its link. The tensor- and pipeline-parallel traffic itself is not
    modelled (inside a node: NVLink)."""
    if tp * pp == 1:
        return work, hw
    g, dp = hw.ranks_per_node, hw.world // (tp * pp)
    per_node = max(1, min(dp, g // tp)) if g % tp == 0 else 1
    c = hw.micro_batch_s(work)
    bubble = 1 + (pp - 1) / (pieces * stages_per_rank)
    sharing = max(1, g // per_node)  # rings through one node's link at once
    ring = dataclasses.replace(
        hw, nodes=-(-dp // per_node), ranks_per_node=per_node, compute_s=c / (tp * pp) * bubble,
        bandwidth_bps=hw.bandwidth_bps / sharing if hw.bandwidth_bps else hw.bandwidth_bps,
    )  # fmt: skip
    return dataclasses.replace(work, params=local_params), ring


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else math.nan


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """The first column left-aligned, the others (numbers) right-aligned."""
    lines = ["| " + " | ".join(columns) + " |", "|---|" + "---:|" * (len(columns) - 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
