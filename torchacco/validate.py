"""Checks of a config that need no data and no process group, so mistakes surface before launch.

`torchacco validate --config FILE [overrides]` runs them alone. The launcher (`torchacco.launch`) runs them in
its own process before it starts any worker, so a bad key, type, path or batch size is one line on the terminal instead
of the same error from every rank; WORLD_SIZE is the number of processes to check for when run alone.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from pathlib import Path

import torch

from torchacco import fault_tolerance, run_folder, user_model
from torchacco.activation_checkpoint import check_activation_checkpoint
from torchacco.build import ModelKind, model_args
from torchacco.config import Config, DiLoCo, load_config
from torchacco.errors import UserError, run_cli
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.model_parallel import check_model_parallel
from torchacco.parallel.registry import strategies, strategy_class
from torchacco.parallel.strategy import Strategy, UpdatePlan
from torchacco.preemption import check_config as check_preemption
from torchacco.spec import get_model_spec


def validate(
    cfg: Config,
    world_size: int,
    local_world_size: int | None = None,
    model=None,
    own_data: bool = False,
    here: bool = True,
) -> ModelKind:
    """`model` and `own_data`: a model or datasets passed to train() replace the configured ones, whose checks are then
    skipped (the model's own are made instead). `here` = False skips what depends on this machine (the files the run
    reads, its devices): a dry run for a cluster. Returns whose model the run trains (decided here, where the model
    enters)."""
    kind = ModelKind.of(model, cfg.model)
    if kind.foreign:
        user_model.check(cfg, model)  # first: tp/pp is the model's limit, whatever the degrees and strategy
    dp_size = check_parallelism(cfg.parallelism, fault_tolerance.job_world(world_size, cfg))
    _check_folders_and_paths(cfg, here)
    _check_training(cfg, dp_size)
    if not kind.foreign:
        _check_model(cfg, model)
    if here:
        _check_data(cfg, own_data)
        _check_devices(cfg.training, local_world_size)
    return kind


def _check_folders_and_paths(cfg: Config, here: bool) -> None:
    for section, name in (("checkpoint", cfg.checkpoint.folder), ("profiling", cfg.profiling.folder)):
        folder = Path(name)
        if not name.strip() or folder.is_absolute() or ".." in folder.parts or folder == Path("."):
            raise UserError(
                f'[{section}] folder = {name!r} must name a folder inside the dump folder (e.g. "{section}"); to '
                f"keep it elsewhere, choose --job.dump_folder there"
            )
    check_preemption(cfg.preemption)
    if not here:
        return
    run_folder.check(cfg, Path(cfg.job.dump_folder))  # a different run's folder: refused before any worker starts
    _check_profiling(cfg.profiling, cfg.training.device)
    if cfg.checkpoint.load_path and not Path(cfg.checkpoint.load_path).is_dir():
        raise UserError(f"[checkpoint] load_path not found: {cfg.checkpoint.load_path} (a step-N checkpoint folder)")
    if cfg.model.init_from and not (Path(cfg.model.init_from) / "config.json").is_file():
        raise UserError(
            f"[model] init_from = {cfg.model.init_from} is not a Hugging Face folder with a config.json; "
            "point it at a folder exported by torchacco (<dump_folder>/hf) or downloaded from the Hub"
        )


def _check_training(cfg: Config, dp_size: int) -> None:
    t = cfg.training
    if cfg.metrics.log_every < 1:
        raise UserError(f"[metrics] log_every must be at least 1, got {cfg.metrics.log_every}")
    if cfg.eval.every and cfg.eval.batches < 1:
        raise UserError(f"[eval] batches must be at least 1 when evaluating, got {cfg.eval.batches}; or set every = 0")
    for key in ("seq_len", "local_batch_size", "steps", "collective_timeout_s", "max_skips_in_a_row", "loss_chunks"):
        if getattr(t, key) <= 0:
            raise UserError(f"[training] {key} must be positive, got {getattr(t, key)}")
    if t.global_batch_size < 0:
        batch = t.global_batch_size
        raise UserError(f"[training] global_batch_size must be 0 (no accumulation) or positive, got {batch}")
    UpdatePlan.from_config(t, cfg.optimizer, cfg.lr_schedule, dp_size, replicas=cfg.parallelism.replicas)
    o = cfg.optimizer
    if not 0 <= o.slow_beta < 1:
        raise UserError(f"[optimizer] slow_beta = {o.slow_beta:g} must be in [0, 1) (0: off), e.g. 0.99")
    if not 0 < o.slow_weight <= 1:
        raise UserError(
            f"[optimizer] slow_weight = {o.slow_weight:g} must be in (0, 1]; to step without the slow moment, set "
            "slow_beta = 0"
        )
    _check_muon(o, cfg.parallelism, cfg.emulation.virtual_compute)
    check_activation_checkpoint(t.activation_checkpoint, t.selective_checkpoint)
    _check_strategy(cfg, dp_size)
    _check_emulation(cfg)


def _check_muon(o, p, virtual_compute: bool) -> None:
    """What `[optimizer] name = "muon"` does not combine with, one line each."""
    if o.name != "muon":
        return
    if o.slow_beta:
        raise UserError(
            "[optimizer] slow_beta is AdamW's slow moment, not Muon's; with name = 'muon' set slow_beta = 0"
        )
    if not 0 <= o.muon_momentum < 1 or not 1 <= o.ns_steps < 100:
        raise UserError(f"[optimizer] muon_momentum must be in [0, 1) and ns_steps in [1, 99], got {o.muon_momentum:g}"
                        f" and {o.ns_steps}")  # fmt: skip
    if p.tensor_parallel_degree > 1 and strategy_class(p.data_parallel).traits.overlapped:
        # the job's thread would gather matrices over the tp group while the compute's forward uses it
        raise UserError(
            "[optimizer] name = 'muon' with tensor parallelism needs a synchronous data_parallel strategy, not "
            f"{p.data_parallel!r}; set tensor_parallel_degree = 1, another data_parallel, or name = 'adamw'"
        )
    if virtual_compute:
        raise UserError("[emulation] virtual_compute times AdamW only; with it, set [optimizer] name = 'adamw'")


def _check_emulation(cfg: Config) -> None:
    e, p = cfg.emulation, cfg.parallelism
    if not e.virtual_compute:
        return
    if e.forward_s <= 0 or e.backward_s <= 0 or e.optimizer_s_per_param < 0 or not 0 <= e.block_share <= 1:
        raise UserError(
            "[emulation] virtual_compute needs forward_s and backward_s > 0, optimizer_s_per_param >= 0 and "
            "block_share in [0, 1]; `torchacco calibrate --config FILE` measures them"
        )
    if e.slow_factor < 1 or not all(r.strip().isdigit() for r in e.slow_ranks.split(",") if r.strip()):
        raise UserError(
            f'[emulation] slow_ranks = {e.slow_ranks!r} must list ranks (e.g. "2,3") and slow_factor = '
            f"{e.slow_factor:g} be >= 1"
        )
    refused = {
        "an evaluation ([eval] every = 0)": cfg.eval.every,
        "compile ([model] compile = false)": cfg.model.compile,
        "tensor or pipeline parallelism (tp = pp = 1)": p.tensor_parallel_degree * p.pipeline_parallel_degree > 1,
    }
    for what, set_ in refused.items():
        if set_:
            raise UserError(f"[emulation] virtual_compute computes no losses and no model: it runs without {what}")


def _check_strategy(cfg: Config, dp_size: int) -> None:
    """The data-parallel strategy's traits against the config, then its own checks; a refusal lists the strategies that
    can."""
    p, cls = cfg.parallelism, strategy_class(cfg.parallelism.data_parallel)
    degrees = {"tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree}
    model_parallel = " × ".join(f"{n}={d}" for n, d in degrees.items() if d > 1)  # 'tp=2 × pp=2'; '' for none
    name = cls.name
    if model_parallel and not cls.traits.model_parallel:
        able = _able(lambda t: t.model_parallel)
        raise UserError(f"data_parallel = '{name}' with {model_parallel} is not supported; use one of {able}")
    if p.balance_batches and not cls.traits.balances:
        raise UserError(
            f"[parallelism] balance_batches = true with data_parallel = '{name}': its ranks must run the "
            f"same micro-batches (collectives inside forward and backward); use one of {_able(lambda t: t.balances)}, "
            "or balance_batches = false"
        )
    if p.balance_batches and model_parallel:
        raise UserError(
            f"[parallelism] balance_batches = true with {model_parallel} is not supported: tensor- and "
            "pipeline-parallel peers must run the same micro-batches; set balance_batches = false"
        )
    if reason := cls.check_config(cfg, dp_size, model_parallel):
        raise UserError(reason)
    check_diloco(cfg, cls)


def _able(test) -> str:
    """The registered strategies whose traits pass `test`, quoted."""
    return ", ".join(f"'{name}'" for name, cls in strategies().items() if test(cls.traits))


# The [diloco] keys an outer step over one replica (SNOO) reads: the schedule and the outer optimizer.
ONE_REPLICA = ("sync_every", "fragments", "sync_every_max", "outer_lr", "outer_momentum", "outer_momentum_warmup",
               "outer_momentum_decay", "offload")  # fmt: skip


def check_diloco(cfg: Config, inner: type[Strategy]) -> None:
    """The [diloco] and replica settings that cannot run, each as one line."""
    d, replicas, defaults = cfg.diloco, cfg.parallelism.replicas, DiLoCo()
    if not has_outer_step(replicas, d):
        return
    if replicas == 1:  # SNOO: the outer step of one replica, which exchanges nothing
        exchange = [f.name for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(defaults, f.name)]
        exchange = [name for name in exchange if name not in ONE_REPLICA]
        if exchange:
            raise UserError(
                f"[diloco] {', '.join(exchange)} set: they shape the exchange between replicas, and [parallelism] "
                "replicas = 1 has none (its outer step sends nothing); remove them, or set replicas to 2 or more"
            )
    elif inner.traits.why_not_in_replicas:
        raise UserError(
            f"data_parallel = '{inner.name}' cannot run inside DiLoCo's replicas "
            f"({inner.traits.why_not_in_replicas}); use one of {_able(lambda t: not t.why_not_in_replicas)}"
        )
    mode = getattr(cfg.options(inner.traits.options), "mode", "deterministic")
    if mode == "adaptive":
        raise UserError(
            "[acco] mode = 'adaptive' inside DiLoCo's replicas is not supported: each replica's batch would grow on "
            "its own, and the outer step's schedule counts equal updates; use mode = 'deterministic' or 'balanced'"
        )
    for name in ("sync_every", "fragments"):
        if getattr(d, name) < 1:
            raise UserError(f"[diloco] {name} must be at least 1, got {getattr(d, name)}")
    if d.sync_every % d.fragments:
        raise UserError(
            f"[diloco] sync_every = {d.sync_every} is not a multiple of fragments = {d.fragments} (one fragment "
            "syncs every sync_every / fragments updates); change either"
        )
    interval = d.sync_every // d.fragments
    if not 0 <= d.overlap_steps < interval:
        raise UserError(
            f"[diloco] overlap_steps = {d.overlap_steps} must be at least 0 and below sync_every / fragments = "
            f"{interval} (a fragment's all-reduce must arrive before the next one starts)"
        )
    if not 0.0 <= d.mixing <= 1.0:
        raise UserError(f"[diloco] mixing = {d.mixing:g} must be between 0 and 1")
    if d.eager and (not d.overlap_steps or d.mixing):
        raise UserError(
            "[diloco] eager continues from an estimated outer step while the all-reduce runs beside overlap_steps "
            "inner updates and keeps all of them (mixing does not apply): set overlap_steps >= 1 and mixing = 0"
        )
    if not 0.0 <= d.topk <= 1.0:
        raise UserError(f"[diloco] topk = {d.topk:g} is the fraction of the pseudo-gradient sent: use 0 (all) to 1")
    if not 0.0 <= d.error_decay <= 1.0:
        raise UserError(f"[diloco] error_decay = {d.error_decay:g} must be between 0 and 1")
    needs_topk = {"error_decay": "applies to what topk leaves unsent", "topk_mean": "averages what topk sends"}
    for name, what in needs_topk.items():
        if getattr(d, name) != getattr(defaults, name) and not d.topk:
            raise UserError(f"[diloco] {name} = {getattr(d, name)!r} {what}, and topk = 0 sends all; set topk")
    if d.outer_momentum_warmup < 0:
        raise UserError(f"[diloco] outer_momentum_warmup = {d.outer_momentum_warmup} must be 0 (none) or more")
    for name in ("outer_momentum_warmup", "outer_momentum_decay"):
        if getattr(d, name) and not d.outer_momentum:
            raise UserError(f"[diloco] {name} scales the outer momentum, and outer_momentum = 0 (plain averaging); set "
                            f"outer_momentum above 0 (e.g. 0.9), or leave {name} out")  # fmt: skip
    if d.warm_start < 0 or d.warm_start % interval:
        raise UserError(
            f"[diloco] warm_start = {d.warm_start} must be a multiple of sync_every / fragments = {interval} (the "
            "outer steps then begin with a whole period)"
        )
    if d.sync_every_max and (d.sync_every_max < d.sync_every or d.sync_every_max % d.fragments or d.balance_replicas):
        raise UserError(
            f"[diloco] sync_every_max = {d.sync_every_max} must be 0 (a fixed H), or a multiple of fragments = "
            f"{d.fragments} of at least sync_every = {d.sync_every} without balance_replicas (whose periods are H's)"
        )
    if d.warm_start and d.balance_replicas:
        raise UserError("[diloco] warm_start averages after every update, and balance_replicas idles a slow "
                        "replica's slots: use one of them")  # fmt: skip
    if d.mixing and not d.overlap_steps:
        raise UserError(
            "[diloco] mixing mixes in the local updates made during overlap_steps, and overlap_steps = 0; "
            "set overlap_steps >= 1 or mixing = 0"
        )
    if d.balance_replicas and inner.traits.overlapped:
        synchronous = _able(lambda t: not t.why_not_in_replicas and not t.overlapped)
        raise UserError(
            f"[diloco] balance_replicas idles a slow replica's slots, and data_parallel = '{inner.name}' runs its "
            f"updates overlapped with the next; use one of {synchronous}, or balance_replicas = false"
        )
    if d.balance_replicas and not cfg.training.max_tokens:
        raise UserError(
            "[diloco] balance_replicas needs [training] max_tokens: the replicas' inner updates differ, so the run and "
            "its learning-rate schedule are measured in tokens; set it (e.g. --training.max_tokens 1000000000)"
        )
    fault_tolerance.check_config(cfg)
    if d.outer_lr <= 0 or not 0.0 <= d.outer_momentum < 1.0:
        raise UserError(
            f"[diloco] outer_lr = {d.outer_lr:g} must be positive and outer_momentum = {d.outer_momentum:g} in [0, 1)"
        )


def _check_model(cfg: Config, model) -> None:
    """One of torchacco's models: the configured one, or `model` (built from models/)."""
    spec = get_model_spec(cfg.model.name)
    args = model.args if model is not None else model_args(spec, cfg.model)
    check_model_parallel(spec, cfg, args)
    if cfg.checkpoint.export_hf and spec.hf is None:
        raise UserError(
            f"[checkpoint] export_hf = true but model {cfg.model.name} has no Hugging Face adapter "
            "(ModelSpec.hf, e.g. models/<name>/hf.py); set export_hf = false, or add an adapter"
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise UserError(
            f"[training] seq_len = {cfg.training.seq_len} exceeds the model's {args.max_seq_len} positions "
            f"({cfg.model.name} {cfg.model.init_from or cfg.model.flavor}); use --training.seq_len "
            f"{args.max_seq_len} or less"
        )


def _check_data(cfg: Config, own_data: bool) -> None:
    for key in ("dataset", "validation") if not own_data else ():
        path = getattr(cfg.data, key)
        if path and path != "embedded" and not Path(path).expanduser().exists():
            if not glob.has_magic(path):
                raise UserError(
                    f"[data] {key} path not found: {path} (a file, folder or glob pattern of .txt, .jsonl, .json "
                    f"or .parquet files)"
                )
            if not glob.glob(str(Path(path).expanduser()), recursive=True):
                raise UserError(f"[data] {key} = {path!r} matches no files; fix the pattern")
    if cfg.tokenizer.path and not Path(cfg.tokenizer.path).is_file():
        raise UserError(f"[tokenizer] path not found: {cfg.tokenizer.path} (a tokenizer.json file)")


def _check_devices(t, local_world_size: int | None) -> None:
    if t.device == "cuda" and not torch.cuda.is_available():
        raise UserError("[training] device = 'cuda' but CUDA is not available; use --training.device cpu (or auto)")
    local_world = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and t.device != "cpu" else 0
    if gpus and local_world > gpus:
        raise UserError(f"{local_world} processes per node but only {gpus} GPUs; set NGPU={gpus} (or fewer)")


def check_parallelism(p, world_size: int) -> int:
    """Checks of the [parallelism] degrees that need no model; returns the data-parallel degree."""
    tp, pp, replicas = p.tensor_parallel_degree, p.pipeline_parallel_degree, p.replicas
    for key, value in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp), ("replicas", replicas)):
        if value < 1:
            raise UserError(f"[parallelism] {key} must be at least 1, got {value}")
    if world_size % (n := replicas * tp * pp):
        factors = {"replicas": replicas} if replicas > 1 else {}  # named only when there are several
        factors |= {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp}
        raise UserError(
            f"{world_size} ranks are not divisible by [parallelism] {' × '.join(factors)} = "
            f"{' × '.join(map(str, factors.values()))} = {n}; launch a multiple of {n} ranks (NPROC × NNODES) or "
            f"change {'replicas' if replicas > 1 else 'the degrees'}"
        )
    if p.bucket_cap_mb < 0:
        raise UserError(f"[parallelism] bucket_cap_mb must be 0 (torch's default) or positive, got {p.bucket_cap_mb:g}")
    if p.pipeline_microbatches < 0:
        raise UserError(
            f"[parallelism] pipeline_microbatches must be 0 (auto) or positive, got {p.pipeline_microbatches}"
        )
    return world_size // n


def _check_profiling(p, device: str) -> None:
    if not p.enable:
        return
    for key in ("start_step", "active_steps"):
        if getattr(p, key) < 1:
            raise UserError(f"[profiling] {key} must be at least 1, got {getattr(p, key)}")
    if p.every and p.every <= p.active_steps:
        raise UserError(
            f"[profiling] every = {p.every} must exceed active_steps = {p.active_steps} (a trace spans "
            "active_steps updates, plus one to warm the profiler up), or be 0 (trace once)"
        )
    if p.memory_snapshot and (device == "cpu" or not torch.cuda.is_available()):
        raise UserError(
            "[profiling] memory_snapshot records the CUDA allocator's history and this run has no GPU; "
            "set memory_snapshot = false (peak memory is in metrics.jsonl as memory_gib)"
        )


def main(argv: list[str] | None = None, world_size: int | None = None, local_world_size: int | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    world_size = world_size or int(os.environ.get("WORLD_SIZE", 1))
    return run_cli(lambda: validate(load_config(argv), world_size, local_world_size) and None)
