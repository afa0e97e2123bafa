"""`./run_train.sh --config FILE --dry-run 4x8`: a run checked on the cluster it is for, before launching it.

    ./run_train.sh --config train_configs/llama3_8b_acco.toml --dry-run 4x8 [--dry-run-gpu-gib 80]
    torchacco dry-run --config FILE --dry-run NODESxGPUS [--section.key VALUE ...]

With no GPU, no data and no process started: the launcher's checks for that world size (a mistake is one line: exit 1),
the model on the meta device with its tensor and pipeline parallelism over a fake process group of that size, and per
rank (per pipeline stage when there are several) its memory by part, their peak against `--dry-run-gpu-gib` and the
cost model's time per update. `--dry-run` with no size takes [job] cluster. Exit 1 with one line when the peak does
not fit, so a job script can gate on it; `--dry-run-report-only` exits 0 either way (docs/performance.md says what it
counts).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from torchacco.blocks import block_list
from torchacco.build import model_args
from torchacco.config import Config, load_config, parse_overrides
from torchacco.device import DTYPES, Device, compute_dtype
from torchacco.errors import UserError
from torchacco.loss import TokenLoss
from torchacco.optim import muon_workload, optimizer_state_share
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.dims import ParallelDims, clear_dtensor_sharding_cache
from torchacco.parallel.hsdp import shard_degree
from torchacco.parallel.model_parallel import apply_model_parallel, local_numel
from torchacco.parallel.pipeline import layer_split, microbatches, stages_per_rank
from torchacco.parallel.registry import strategy_class
from torchacco.parallel.strategy import MemoryParts, UpdatePlan
from torchacco.planning import cost_model as cm
from torchacco.spec import get_model_spec
from torchacco.validate import validate

GIB = 2**30
# What a GPU needs beyond the counted peak: the CUDA context and NCCL's communicators and buffers (a fixed part),
# and the caching allocator's fragmentation (a share of the peak). Above TIGHT of the GPU's memory a run is "tight".
RESERVE_BYTES = 4 * GIB
RESERVE_SHARE = 0.05
TIGHT = 0.9


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def parse_cluster(text: str, where: str = "--dry-run") -> Cluster:
    """'4x8' -> 4 nodes of 8 GPUs."""
    m = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\d+)\s*", text or "")
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise UserError(f"{where} {text!r} is not NODESxGPUS; write the nodes and the GPUs per node, e.g. 4x8")
    return Cluster(int(m.group(1)), int(m.group(2)))


@dataclass
class RankMemory:
    """One kind of rank (a pipeline stage; every rank without pp): what it stores and its memory."""

    label: str
    rank: int  # the lowest rank of this kind
    ranks: int  # how many ranks are of this kind
    params: int  # parameter elements stored (local shards)
    memory: MemoryParts
    gathered: float  # what the strategy allocates only while computing (FSDP's gathered parameters)
    activations: float

    @property
    def peak(self) -> float:
        return self.memory.total + self.gathered + self.activations

    @property
    def needed(self) -> float:
        """The peak with the reserve beyond it (RESERVE_BYTES, RESERVE_SHARE)."""
        return self.peak * (1 + RESERVE_SHARE) + RESERVE_BYTES


def fits(needed: float, gpu_bytes: float) -> str:
    """yes: within TIGHT of the GPU's memory; tight: within all of it; no."""
    return "yes" if needed <= TIGHT * gpu_bytes else "tight" if needed <= gpu_bytes else "no"


@dataclass
class DryRun:
    cfg: Config
    cluster: Cluster
    dp: int
    tp: int
    pp: int
    replicas: int
    args: object  # the model's ModelArgs
    params: int  # the whole model's
    param_dtype: torch.dtype
    micro_batches: int  # per rank and update
    fragment_params: list[float]  # of each of DiLoCo's fragments (with replicas; else the whole model's)
    kinds: list[RankMemory]
    notes: list[str]

    @property
    def worst(self) -> RankMemory:
        return max(self.kinds, key=lambda k: k.peak)


def vocabulary(cfg: Config) -> tuple[int, str]:
    """The vocabulary a run would build the model with (0: the flavor's), and where it comes from."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "[model] vocab_size"
    if cfg.model.init_from:
        return 0, "the init_from folder's"
    if not cfg.tokenizer.path:
        return cfg.tokenizer.vocab_size, "the BPE trained on the data, [tokenizer] vocab_size"
    if Path(cfg.tokenizer.path).is_file():
        from torchacco.data.tokenizer import Tokenizer  # the trainer's reader, and its line for a file it cannot use

        return Tokenizer(cfg.tokenizer.path).vocab_size, f"the tokenizer's, {cfg.tokenizer.path}"
    return 0, f"the flavor's: a run takes its tokenizer's, {cfg.tokenizer.path}, which is not here"


def fake_store() -> dist.Store:
    """The store of torch's fake process group: torch keeps it in a private module, imported here alone
    (tests/test_dry_run.py fails when torch moves it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextlib.contextmanager
def launched_environment(local_world_size: int):
    """os.environ as a launched rank sees it, for the checks that read LOCAL_WORLD_SIZE; restored after."""
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


@contextlib.contextmanager
def fake_world(rank: int, world: int, shape: tuple[int, ...]):
    """A process group of `world` ranks that moves no data (torch's fake backend), seen from `rank`, and the run's mesh
    over it."""
    if dist.is_initialized():
        raise RuntimeError("a dry run builds its own fake process group: none may be initialised")
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world)
    try:
        clear_dtensor_sharding_cache()
        yield init_device_mesh("cpu", shape, mesh_dim_names=("replica", "pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def stage_params(cfg: Config, spec, args, cluster: Cluster, dp: int) -> list[tuple[int, int, int]]:
    """Per pipeline stage, the parameter elements a rank of it stores, those of them in its transformer blocks, and its
    blocks: read from the model built on the meta device with tensor and pipeline parallelism (tp·pp > 1) applied (as
    the trainer does) for the cluster's world size."""
    p = cfg.parallelism
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    counts = []
    for stage in range(pp):
        rank = stage * dp * tp  # replica 0, dp 0, tp 0 of the stage: tensor-parallel ranks hold equal shards
        with fake_world(rank, cluster.world, (p.replicas, pp, dp, tp)) as mesh:
            dims = ParallelDims(cluster.world, rank, rank % cluster.gpus_per_node, cluster.gpus_per_node, mesh)
            with torch.device("meta"):
                model = spec.model_cls(args)
            loss = TokenLoss(cfg.training.loss_chunks, tp > 1 and pp == 1 and p.loss_parallel)
            model, _ = apply_model_parallel(model, spec, p, cfg.model, cfg.training, dims, Device("cpu"), loss)
            counts.append(_counts(model))
    return counts


def _counts(model) -> tuple[int, int, int]:
    blocks = block_list(model)
    return local_numel(model), sum(local_numel(b) for b in blocks), len(blocks)


def activations(cfg: Config, args, stage: int) -> float:
    """One rank's activations at the peak of a micro-batch (`cost_model`'s estimate): its blocks' saved tensors for the
    micro-batches in flight on its stage (1F1B: pp − stage of the pieces; GPipe: all; interleaved counted as 1F1B), 1/tp
    of them on each tensor-parallel rank, and on the last stage one loss chunk's logits."""
    t, p = cfg.training, cfg.parallelism
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    pieces, v = (microbatches(p), stages_per_rank(p)) if pp > 1 else (1, 1)
    blocks = sum(len(stage_layers) for stage_layers in layer_split(args.n_layers, pp * v)[stage::pp])
    in_flight = pieces if p.pipeline_schedule == "gpipe" else min(pieces, pp - stage)
    piece = t.local_batch_size * t.seq_len / pieces
    kept = cm.block_activation_bytes(
        args, piece * in_flight, t.activation_checkpoint, t.selective_checkpoint, blocks=blocks, tp=tp
    )
    if stage + (v - 1) * pp != pp * v - 1:  # its last virtual stage is not the model's: no logits
        return kept
    split = tp if tp > 1 and pp == 1 and p.loss_parallel else 1  # the logits split by vocabulary, as in stage_params
    return kept + cm.loss_activation_bytes(args, piece, t.loss_chunks, split)


def plan(cfg: Config, cluster: Cluster) -> DryRun:
    """Validate `cfg` for the cluster (a UserError for a mistake) and count each kind of rank's memory."""
    notes = []
    if cfg.model.init_from and not (Path(cfg.model.init_from) / "config.json").is_file():
        notes.append(
            f"architecture: flavor {cfg.model.flavor}'s ([model] init_from = {cfg.model.init_from} is not here; "
            "a run takes the folder's)"
        )
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=""))
    vocab, source = vocabulary(cfg)
    if vocab and not cfg.model.vocab_size:  # the run's model takes this vocabulary: validate that one
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    with launched_environment(cluster.gpus_per_node):
        validate(cfg, cluster.world, cluster.gpus_per_node, here=False)
    spec = get_model_spec(cfg.model.name)
    args = model_args(spec, cfg.model)
    notes.insert(0, f"vocabulary {args.vocab_size:,}: {source}")
    p, t = cfg.parallelism, cfg.training
    tp, pp, replicas = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.replicas
    dp = cluster.world // (replicas * tp * pp)
    cls = strategy_class(p.data_parallel)
    options = cfg.options(cls.traits.options)
    # the ranks a rank's state is divided over: a node's shard group, or all the data-parallel ranks
    group = shard_degree(options, dp, cluster.gpus_per_node, tp, pp) if cls.traits.shards_within_node else dp
    dtype = compute_dtype(t.mixed_precision, Device("cpu" if t.device == "cpu" else "cuda"))  # a GPU cluster's
    with torch.device("meta"):
        whole = spec.model_cls(args)
    total = local_numel(whole)
    outer = cfg.diloco if has_outer_step(replicas, cfg.diloco) else None  # (one replica's: SNOO; no communication)
    fragments = cm.fragment_sizes(whole, cfg.diloco.fragments) if outer else [float(total)]
    largest = max(fragments) / total
    stages = stage_params(cfg, spec, args, cluster, dp) if tp * pp > 1 else [_counts(whole)]
    micro = UpdatePlan.from_config(t, cfg.optimizer, cfg.lr_schedule, dp, replicas=replicas).micro_batches
    kinds, state_share = [], optimizer_state_share(cfg.optimizer, whole)
    for stage, (numel, in_blocks, blocks) in enumerate(stages):
        memory = cm.layout_memory(cls, numel, group, dtype, DTYPES[p.reduce_dtype], options, outer, largest)
        memory = dataclasses.replace(memory, optimizer=memory.optimizer * state_share)  # against AdamW's two moments
        held = cls.accumulation_memory(p, numel, micro)  # (the sharded gradients form as the unsharded are freed)
        memory = dataclasses.replace(memory, gradients=max(memory.gradients, held))
        gathered = cls.gathered_memory(p, in_blocks / max(blocks, 1), numel - in_blocks, blocks, dtype, group)
        label = f"pp stage {stage}" if pp > 1 else "every rank"
        kinds.append(RankMemory(label, stage * dp * tp, cluster.world // pp, numel, memory, gathered,
                                activations(cfg, args, stage)))  # fmt: skip
    return DryRun(cfg, cluster, dp, tp, pp, replicas, args, total, dtype, micro, fragments, kinds, notes)


def strategy_label(cfg: Config) -> str:
    """The cost model's row for the configured strategy: its variant whose options the config sets, else itself."""
    chosen, matched = cfg.parallelism.data_parallel, 0
    for label, (cls, _) in cm.variants().items():
        extra = cm.variant_arguments(label)[2:]  # the variant's settings, past --parallelism.data_parallel NAME
        pairs = list(zip(extra[::2], extra[1::2]))
        sets_them = all(_setting(cfg, name) == value for name, value in pairs)
        if cls.name == cfg.parallelism.data_parallel and len(pairs) > matched and sets_them:
            chosen, matched = label, len(pairs)
    return chosen


def _setting(cfg: Config, option: str) -> str:
    section, _, name = option.removeprefix("--").partition(".")
    value = getattr(cfg.section(section), name)
    return str(value).lower() if isinstance(value, bool) else str(value)


def wire_bytes(param_dtype: torch.dtype, reduce_dtype: str) -> float:
    """Bytes per element on the wire: gradients reduced in [parallelism] reduce_dtype, parameters gathered in the
    compute dtype, half the traffic each."""
    return (param_dtype.itemsize + DTYPES[reduce_dtype].itemsize) / 2


def time_per_update(run: DryRun, link) -> dict:
    """The cost model's prediction for the run's layout on the cluster of `link` (`cm.add_cluster_arguments`), the whole
    model at the config's micro-batch with the worst rank's activations."""
    t, p = run.cfg.training, run.cfg.parallelism
    work = cm.Workload(
        params=float(run.params), flops_per_token=float(run.args.flops_per_token(t.seq_len)),
        tokens_per_micro_batch=float(t.local_batch_size * t.seq_len), micro_batches=max(1, run.micro_batches),
        comm_bytes=wire_bytes(run.param_dtype, p.reduce_dtype),
        activation_bytes=run.worst.activations, **cm.ddp_buckets(p.bucket_cap_mb),
    )  # fmt: skip
    work = with_optimizer(work, run)
    return layout_prediction(run, work, cm.hardware(link, run.cluster.nodes, run.cluster.gpus_per_node))


def with_optimizer(work: cm.Workload, run: DryRun) -> cm.Workload:
    """`work` with the configured optimizer's own costs (Muon's Newton–Schulz and gathers)."""
    with torch.device("meta"):
        whole = get_model_spec(run.cfg.model.name).model_cls(run.args)
    return dataclasses.replace(work, **muon_workload(run.cfg.optimizer, whole))


def layout_prediction(run: DryRun, work: cm.Workload, hw: cm.Hardware) -> dict:
    """The cost model's row for the run's own layout on `hw` (`predict`'s with tensor and pipeline parallelism, or
    `predict_diloco`'s with replicas)."""
    cfg = run.cfg
    label = strategy_label(cfg)
    if run.replicas > 1:
        d = cfg.diloco
        replicas = dataclasses.replace(hw, nodes=run.replicas, ranks_per_node=run.cluster.world // run.replicas)
        outer = (d.sync_every, d.fragments, d.overlap_steps, d.outer_dtype, run.fragment_params, d.topk)
        return cm.predict_diloco(work, replicas, label, *outer)

    local = max(k.params for k in run.kinds)  # the slowest coordinate's ring carries the largest part
    p = cfg.parallelism
    work, hw = cm.model_parallel_layout(work, hw, run.tp, run.pp, local, microbatches(p), stages_per_rank(p))
    return cm.predict(work, hw, label)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def report(run: DryRun, gpu_gib: float, prediction: dict, link, config: str) -> str:
    cfg, t, p, c = run.cfg, run.cfg.training, run.cfg.parallelism, run.cluster
    dtype = "bf16" if run.param_dtype == torch.bfloat16 else "fp32"
    label = strategy_label(cfg)
    strategy = p.data_parallel + (f" (the cost model's {label})" if label != p.data_parallel else "")
    if run.replicas > 1:
        strategy += f" inside each replica, DiLoCo's outer step across them{' (offloaded)' * cfg.diloco.offload}"
    elif has_outer_step(1, cfg.diloco):
        strategy += f", an outer step every {cfg.diloco.sync_every} updates (SNOO){' (offloaded)' * cfg.diloco.offload}"
    lines = [
        f"torchacco dry run: {config} on {c.nodes} node(s) × {c.gpus_per_node} GPUs = {c.world} ranks "
        "(meta device: no GPU, no data)",
        f"model {cfg.model.name} {cfg.model.flavor}: {_count(run.params)} parameters; " + "; ".join(run.notes),
        f"layout: dp {run.dp} × tp {run.tp} × pp {run.pp} × replicas {run.replicas}; {strategy}; {run.micro_batches} "
        f"micro-batches of {t.local_batch_size} × {t.seq_len} tokens per rank and update; {dtype} compute, "
        f"{p.reduce_dtype} reduction; activation_checkpoint {t.activation_checkpoint}, loss_chunks {t.loss_chunks}",
    ]
    parts = [f.name for f in dataclasses.fields(MemoryParts)]  # weights, gradients, master, optimizer, buffers
    columns = ["ranks", "params (its tp/pp part)", *parts, "gathered", "activations", "peak (GiB)"]
    rows = []
    for k in run.kinds:
        cells = [*dataclasses.astuple(k.memory), k.gathered, k.activations, k.peak]
        row = [f"{k.label} (rank {k.rank}, {k.ranks} ranks)", _count(k.params)]
        rows.append(row + [f"{x / GIB:.1f}" for x in cells])
    lines += ["", cm.markdown_table(columns, rows)]
    worst = run.worst
    lines += [
        "",
        f"fits in {gpu_gib:g} GiB: {fits(worst.needed, gpu_gib * GIB)} (peak {worst.peak / GIB:.1f} GiB on rank "
        f"{worst.rank}; {worst.needed / GIB:.1f} GiB, {worst.needed / (gpu_gib * GIB):.0%}, with the reserve)",
        f"time per update: {prediction['step_time_s']:.3g} s, {prediction['tokens_per_s']:,.0f} tokens/s, "
        f"{prediction['exposed_comm_s']:.3g} s of it exposed communication (cost model: {link.device} at "
        f"{link.mfu:.0%} MFU, {link.bandwidth} per node between nodes, {link.latency_ms:g} ms; tensor- and "
        "pipeline-parallel traffic not modelled)",
        "Memory: the strategy's own byte count of what it allocates (Strategy.memory) and one micro-batch's "
        "activations estimated from the model's shape; gathered: what a strategy allocates only while computing "
        "(Strategy.gathered_memory: FSDP's unsharded blocks, autocast's weights, ACCO's job staging); gradients: their "
        "most between micro-batches (FSDP's unsharded accumulator with accumulate_unsharded, DDP's first update's "
        f"beside its buckets). Reserve: {RESERVE_BYTES / GIB:g} GiB (the CUDA context, "
        f"NCCL's communicators) + {RESERVE_SHARE:.0%} of the peak (the allocator's fragmentation); tight: above "
        f"{TIGHT:.0%} of the GPU's memory; not counted: compile workspaces.",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="./run_train.sh --config FILE --dry-run NODESxGPUS",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--dry-run", nargs="?", const="", default="", metavar="NODESxGPUS")
    p.add_argument("--dry-run-gpu-gib", type=float, default=80.0, help="memory per GPU to fit in (GiB)")
    p.add_argument("--dry-run-report-only", action="store_true", help="exit 0 even when the config does not fit")
    cm.add_cluster_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)  # None: sys.argv[1:]
    cfg = load_config(rest)
    if not args.dry_run and not cfg.job.cluster:
        raise UserError("--dry-run needs the cluster's size, e.g. --dry-run 4x8 (nodes × GPUs per node)")
    cluster = parse_cluster(args.dry_run) if args.dry_run else parse_cluster(cfg.job.cluster, "[job] cluster =")
    if not args.dry_run_gpu_gib > 0:
        raise UserError(f"--dry-run-gpu-gib {args.dry_run_gpu_gib:g} must be positive (e.g. 80)")
    run = plan(cfg, cluster)
    prediction = time_per_update(run, args)
    print(report(run, args.dry_run_gpu_gib, prediction, args, parse_overrides(rest)[0] or "the default config"))
    worst = run.worst
    if fits(worst.needed, args.dry_run_gpu_gib * GIB) == "no" and not args.dry_run_report_only:
        raise UserError(
            f"does not fit: peak {worst.peak / GIB:.1f} GiB on rank {worst.rank}, {worst.needed / GIB:.1f} GiB with "
            f"the reserve > --dry-run-gpu-gib {args.dry_run_gpu_gib:g}; shard more (fsdp, hsdp, "
            "tensor_parallel_degree), set activation_checkpoint, or lower local_batch_size (--dry-run-report-only: "
            "exit 0 anyway)"
        )
    return 0
