"""Checks of a config that need no data and no process group, so mistakes surface before launch.

`torchacco validate --config FILE [overrides]` runs them alone. The launcher (`torchacco.launch`) runs them in
its own process before it starts any worker, so a bad key, type, path or batch size is one line on the terminal instead
of the same error from every rank; WORLD_SIZE is the number of processes to check for when run alone."""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path

import torch

from torchacco import fault_tolerance, run_folder, user_model
from torchacco.activation_checkpoint import check_activation_checkpoint
from torchacco.build import ModelKind, model_args
from torchacco.config import Config, load_config
from torchacco.errors import UserError, run_cli
from torchacco.parallel.diloco import DiLoCo
from torchacco.parallel.model_parallel import check_model_parallel
from torchacco.parallel.registry import able, strategy_class
from torchacco.parallel.strategy import UpdatePlan
from torchacco.preemption import check_config as check_preemption
from torchacco.spec import get_model_spec


def validate(
    cfg: Config, world_size: int, local_world_size: int | None = None, model=None, own_data=False, here=True
) -> ModelKind:
    """`model` and `own_data`: a model or datasets passed to train() replace the configured ones, whose checks are then
    skipped (the model's own are made instead). `here` = False skips what depends on this machine (the files the run
    reads, its devices): a dry run for a cluster. Returns whose model the run trains (decided here, where the model
    enters)."""
    kind = ModelKind.of(model, cfg.model)
    if kind.foreign:  # first: tp/pp is the model's limit, whatever the degrees and strategy
        user_model.check(model, cfg.parallelism, cfg.training, cfg.checkpoint)
    dp_size = check_parallelism(cfg.parallelism, fault_tolerance.job_world(world_size, cfg.diloco, cfg.parallelism))
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
            raise UserError(f"[{section}] folder = {name!r} must name a folder inside the dump folder (e.g. "
                            f'"{section}"); to keep it elsewhere, choose --job.dump_folder there')  # fmt: skip
    check_preemption(cfg.preemption)
    if not here:
        return
    run_folder.check(cfg, Path(cfg.job.dump_folder))  # a different run's folder: refused before any worker starts
    _check_profiling(cfg.profiling, cfg.training.device)
    if cfg.checkpoint.load_path and not Path(cfg.checkpoint.load_path).is_dir():
        raise UserError(f"[checkpoint] load_path not found: {cfg.checkpoint.load_path} (a step-N checkpoint folder)")
    if cfg.model.init_from and not (Path(cfg.model.init_from) / "config.json").is_file():
        raise UserError(f"[model] init_from = {cfg.model.init_from} is not a Hugging Face "
                        "folder with a config.json; point it at a folder exported by "
                        "torchacco (<dump_folder>/hf) or downloaded from the Hub")  # fmt: skip


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
        raise UserError(f"[optimizer] slow_weight = {o.slow_weight:g} must be in (0, 1]; "
                        "to step without the slow moment, set slow_beta = 0")  # fmt: skip
    _check_muon(o, cfg.parallelism, cfg.emulation.virtual_compute)
    check_activation_checkpoint(t.activation_checkpoint, t.selective_checkpoint)
    _check_strategy(cfg, dp_size)
    _check_emulation(cfg)


def _check_muon(o, p, virtual_compute: bool) -> None:
    """What `[optimizer] name = "muon"` does not combine with, one line each."""
    if o.name != "muon":
        return
    if o.slow_beta:
        raise UserError("[optimizer] slow_beta is AdamW's slow moment, not Muon's; "
                        "with name = 'muon' set slow_beta = 0")  # fmt: skip
    if not 0 <= o.muon_momentum < 1 or not 1 <= o.ns_steps < 100:
        raise UserError(f"[optimizer] muon_momentum must be in [0, 1) and ns_steps in [1, 99], got {o.muon_momentum:g}"
                        f" and {o.ns_steps}")  # fmt: skip
    if p.tensor_parallel_degree > 1 and strategy_class(p.data_parallel).traits.overlapped:
        # the job's thread would gather matrices over the tp group while the compute's forward uses it
        raise UserError("[optimizer] name = 'muon' with tensor parallelism needs a synchronous "
                        f"data_parallel strategy, not {p.data_parallel!r}; set tensor_parallel_degree "
                        "= 1, another data_parallel, or name = 'adamw'")  # fmt: skip
    if virtual_compute:
        raise UserError("[emulation] virtual_compute times AdamW only; with it, set [optimizer] name = 'adamw'")


def _check_emulation(cfg: Config) -> None:
    e, p = cfg.emulation, cfg.parallelism
    if not e.virtual_compute:
        return
    if e.forward_s <= 0 or e.backward_s <= 0 or e.optimizer_s_per_param < 0 or not 0 <= e.block_share <= 1:
        raise UserError("[emulation] virtual_compute needs forward_s and backward_s > 0, optimizer_s_per_param >= 0 "
                        "and block_share in [0, 1]; `torchacco calibrate --config FILE` measures them")  # fmt: skip
    if e.slow_factor < 1 or not all(r.strip().isdigit() for r in e.slow_ranks.split(",") if r.strip()):
        raise UserError(f"[emulation] slow_ranks = {e.slow_ranks!r} must list ranks (e.g. "
                        f'"2,3") and slow_factor = {e.slow_factor:g} be >= 1')  # fmt: skip
    refused = {
        "an evaluation ([eval] every = 0)": cfg.eval.every,
        "compile ([model] compile = false)": cfg.model.compile,
        "tensor or pipeline parallelism (tp = pp = 1)": p.tensor_parallel_degree * p.pipeline_parallel_degree > 1,
    }
    for what, set_ in refused.items():
        if set_:
            raise UserError(f"[emulation] virtual_compute computes no losses and no model: it runs without {what}")


def _check_strategy(cfg: Config, dp_size: int) -> None:
    """The strategy's traits against the config, then its own checks and DiLoCo's; a refusal lists those that can."""
    p, cls = cfg.parallelism, strategy_class(cfg.parallelism.data_parallel)
    degrees = {"tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree}
    model_parallel = " × ".join(f"{n}={d}" for n, d in degrees.items() if d > 1)  # 'tp=2 × pp=2'; '' for none
    if model_parallel and not cls.traits.model_parallel:
        which = able(lambda t: t.model_parallel)
        raise UserError(f"data_parallel = '{cls.name}' with {model_parallel} is not supported; use one of {which}")
    if p.balance_batches and not cls.traits.balances:
        raise UserError(f"[parallelism] balance_batches = true with data_parallel = '{cls.name}': its "
                        "ranks must run the same micro-batches (collectives inside forward and backward); "
                        f"use one of {able(lambda t: t.balances)}, or balance_batches = false")  # fmt: skip
    if p.balance_batches and model_parallel:
        raise UserError(f"[parallelism] balance_batches = true with {model_parallel} is "
                        "not supported: tensor- and pipeline-parallel peers must run the "
                        "same micro-batches; set balance_batches = false")  # fmt: skip
    sections = {"training": cfg.training, "optimizer": cfg.optimizer, "lr_schedule": cfg.lr_schedule}
    if reason := cls.check_config(dp_size, model_parallel, options=cfg.options(cls.traits.options), **sections):
        raise UserError(reason)
    DiLoCo.check(cls, cfg.options(cls.traits.options), cfg.diloco, cfg.parallelism, cfg.training)


def _check_model(cfg: Config, model) -> None:
    """One of torchacco's models: the configured one, or `model` (built from models/)."""
    spec = get_model_spec(cfg.model.name)
    args = model.args if model is not None else model_args(spec, cfg.model)
    check_model_parallel(spec, args, cfg.parallelism, cfg.model, cfg.training)
    if cfg.checkpoint.export_hf and spec.hf is None:
        raise UserError(f"[checkpoint] export_hf = true but model {cfg.model.name} has no "
                        "Hugging Face adapter (ModelSpec.hf, e.g. models/<name>/hf.py); "
                        "set export_hf = false, or add an adapter")  # fmt: skip
    if cfg.training.seq_len > args.max_seq_len:
        raise UserError(f"[training] seq_len = {cfg.training.seq_len} exceeds the model's {args.max_seq_len} "
                        f"positions ({cfg.model.name} {cfg.model.init_from or cfg.model.flavor}); use "
                        f"--training.seq_len {args.max_seq_len} or less")  # fmt: skip


def _check_data(cfg: Config, own_data: bool) -> None:
    for key in ("dataset", "validation") if not own_data else ():
        path = getattr(cfg.data, key)
        if path and path != "embedded" and not Path(path).expanduser().exists():
            if not glob.has_magic(path):
                raise UserError(f"[data] {key} path not found: {path} (a file, folder or glob "
                                "pattern of .txt, .jsonl, .json or .parquet files)")  # fmt: skip
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
        raise UserError(f"{world_size} ranks are not divisible by [parallelism] {' × '.join(factors)} = "
                        f"{' × '.join(map(str, factors.values()))} = {n}; launch a multiple of {n} ranks (NPROC "
                        f"× NNODES) or change {'replicas' if replicas > 1 else 'the degrees'}")  # fmt: skip
    if p.bucket_cap_mb < 0:
        raise UserError(f"[parallelism] bucket_cap_mb must be 0 (torch's default) or positive, got {p.bucket_cap_mb:g}")
    if p.pipeline_microbatches < 0:
        raise UserError("[parallelism] pipeline_microbatches must be 0 (auto) or "
                        f"positive, got {p.pipeline_microbatches}")  # fmt: skip
    return world_size // n


def _check_profiling(p, device: str) -> None:
    if not p.enable:
        return
    for key in ("start_step", "active_steps"):
        if getattr(p, key) < 1:
            raise UserError(f"[profiling] {key} must be at least 1, got {getattr(p, key)}")
    if p.every and p.every <= p.active_steps:
        raise UserError(f"[profiling] every = {p.every} must exceed active_steps = {p.active_steps} (a trace spans "
                        "active_steps updates, plus one to warm the profiler up), or be 0 (trace once)")  # fmt: skip
    if p.memory_snapshot and (device == "cpu" or not torch.cuda.is_available()):
        raise UserError("[profiling] memory_snapshot records the CUDA allocator's history and this run has no GPU; "
                        "set memory_snapshot = false (peak memory is in metrics.jsonl as memory_gib)")  # fmt: skip


def main(argv: list[str] | None = None, world_size: int | None = None, local_world_size: int | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    world_size = world_size or int(os.environ.get("WORLD_SIZE", 1))
    return run_cli(lambda: validate(load_config(argv), world_size, local_world_size) and None)
