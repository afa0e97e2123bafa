"""The one training loop. Strategies (DDP, ZeRO-1, FSDP, later ACCO) decide how gradients
become updates; the loop owns data, loss, metrics, evaluation and stopping.

Usable from Python: `train(cfg, model=..., datasets=(train, val))`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torchacco import health, hf_io, run_folder
from torchacco.checkpoint import Checkpointer, RankState, TrainState
from torchacco.config import Config
from torchacco.device import Device, compute_dtype, select_device, set_cpu_threads
from torchacco.errors import PeerFailure, Terminated, UserError
from torchacco.faults import from_env
from torchacco.lr import TokenSchedule
from torchacco.metrics import MetricsLogger
from torchacco.parallel.data_parallel import build_data_parallel
from torchacco.parallel.dims import (ParallelDims, all_reduce_sum, check_parallelism, destroy, init_distributed,
                                     launch_env)
from torchacco.parallel.model_parallel import (apply_model_parallel, check_model_parallel, gather_stages,
                                               model_parallel_label, state_key)
from torchacco.spec import get_model_spec

IGNORE_INDEX = -100


def validate(cfg: Config, world_size: int, local_world_size: int | None = None) -> None:
    """Checks that need no data and no process group, so mistakes surface before launch."""
    t = cfg.training
    dp_size = check_parallelism(cfg, world_size)
    folder = Path(cfg.checkpoint.folder)
    if not cfg.checkpoint.folder.strip() or folder.is_absolute() or ".." in folder.parts or folder == Path("."):
        raise UserError(f"[checkpoint] folder = {cfg.checkpoint.folder!r} must name a folder inside the dump folder "
                        "(e.g. \"checkpoint\"); to keep checkpoints elsewhere, choose --job.dump_folder there")
    if cfg.checkpoint.load_path and not Path(cfg.checkpoint.load_path).is_dir():
        raise UserError(f"[checkpoint] load_path not found: {cfg.checkpoint.load_path} (a step-N checkpoint folder)")
    if cfg.model.init_from and not (Path(cfg.model.init_from) / "config.json").is_file():
        raise UserError(f"[model] init_from = {cfg.model.init_from} is not a Hugging Face folder with a config.json; "
                        "point it at a folder exported by torchacco (<dump_folder>/hf) or downloaded from the Hub")
    for key in ("seq_len", "local_batch_size", "steps", "collective_timeout_s", "max_skips_in_a_row"):
        if getattr(t, key) <= 0:
            raise UserError(f"[training] {key} must be positive, got {getattr(t, key)}")
    per_step = t.local_batch_size * dp_size
    if t.global_batch_size and t.global_batch_size % per_step:
        raise UserError(
            f"[training] global_batch_size = {t.global_batch_size} is not divisible by local_batch_size × "
            f"data-parallel ranks = {t.local_batch_size} × {dp_size} = {per_step}; "
            f"use a multiple of {per_step}"
        )
    if cfg.parallelism.data_parallel in ("acco", "dpu", "wp"):
        _validate_overlapped(cfg, dp_size)
    args = model_args(cfg)
    check_model_parallel(cfg, args)
    if t.seq_len > args.max_seq_len:
        raise UserError(
            f"[training] seq_len = {t.seq_len} exceeds the model's {args.max_seq_len} positions "
            f"({cfg.model.name} {cfg.model.init_from or cfg.model.flavor}); use --training.seq_len {args.max_seq_len} "
            "or less"
        )
    if cfg.data.dataset != "embedded" and not Path(cfg.data.dataset).exists():
        raise UserError(f"[data] dataset path not found: {cfg.data.dataset} (a file or folder of .txt/.jsonl/.json)")
    if cfg.tokenizer.path and not Path(cfg.tokenizer.path).is_file():
        raise UserError(f"[tokenizer] path not found: {cfg.tokenizer.path} (a tokenizer.json file)")
    if t.device == "cuda" and not torch.cuda.is_available():
        raise UserError("[training] device = 'cuda' but CUDA is not available; use --training.device cpu (or auto)")
    local_world = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and t.device != "cpu" else 0
    if gpus and local_world > gpus:
        raise UserError(f"{local_world} processes per node but only {gpus} GPUs; set NGPU={gpus} (or fewer)")


def _validate_overlapped(cfg: Config, world_size: int) -> None:
    t, kind = cfg.training, cfg.parallelism.data_parallel
    micro_batches = (t.global_batch_size or t.local_batch_size * world_size) // (t.local_batch_size * world_size)
    if kind == "acco" and micro_batches % 2:
        raise UserError(
            f"acco computes each update over two periods (at θ̃ and at θ), so it needs an even number of "
            f"micro-batches per update and rank; got {micro_batches}: set [training] global_batch_size to a multiple "
            f"of 2 × local_batch_size × ranks = {2 * t.local_batch_size * world_size}"
        )
    if cfg.acco.mode == "adaptive" and not t.max_tokens:
        raise UserError(
            "[acco] mode = 'adaptive' lets each update's batch grow while communication runs, so a step count "
            "does not fix the learning-rate schedule or the data seen: set [training] max_tokens (the token budget)"
        )


def _main_first(dims: ParallelDims, fn, on: bool | None = None):
    """Run `fn` on local rank 0 (or where `on`) while the others wait; a failure there fails
    every rank, so no rank is left waiting in a collective for one that has given up."""
    error = None
    if (dims.local_rank == 0) if on is None else on:
        try:
            fn()
        except UserError as e:
            error = str(e)
    errors = [None] * dims.world_size
    dist.all_gather_object(errors, error)
    message = next((e for e in errors if e), None)
    if message:
        raise UserError(message)


def build_data(cfg: Config, dims: ParallelDims):
    import data

    _main_first(dims, lambda: data.prepare(cfg.data, cfg.tokenizer, cfg.training.seq_len))
    tokenizer = data.load_tokenizer(cfg.data, cfg.tokenizer)
    train_set, val_set = data.build_datasets(
        cfg.data, cfg.tokenizer, cfg.training.seq_len, dims.dp_rank, dims.dp_size, cfg.training.seed
    )
    return tokenizer, train_set, val_set


def model_args(cfg: Config, vocab_size: int = 0):
    """The configured architecture: the flavor's, or that of the [model] init_from folder."""
    spec = get_model_spec(cfg.model.name)
    if cfg.model.init_from:
        hf_config = json.loads((Path(cfg.model.init_from) / "config.json").read_text())
        if spec.hf is None:
            raise UserError(f"model {cfg.model.name} has no Hugging Face adapter (models/{cfg.model.name}/hf.py); "
                            "it cannot be initialised from [model] init_from")
        return spec.hf.args_from_hf_config(hf_config)  # the weights fix the vocabulary
    return spec.args(cfg.model.flavor, vocab_size=cfg.model.vocab_size or vocab_size or None)


def build_model(cfg: Config, vocab_size: int, device: Device) -> nn.Module:
    spec = get_model_spec(cfg.model.name)
    args = model_args(cfg, vocab_size)
    if vocab_size > args.vocab_size:
        raise UserError(
            f"the tokenizer has {vocab_size} tokens but the model's vocabulary is {args.vocab_size}; "
            f"set [model] vocab_size = {vocab_size} (or 0 to follow the tokenizer)"
        )
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device.torch)
    torch.manual_seed(cfg.training.seed)
    with torch.no_grad():
        model.init_weights()  # also the buffers (RoPE tables) that no checkpoint holds
    if cfg.model.init_from:
        _, _, weights = hf_io.load_hf(cfg.model.init_from, cfg.model.name)
        hf_io.load_into(model, weights)
    return model


def export_hf(cfg: Config, dp, dims: ParallelDims, folder: Path, tokenizer) -> Path | None:
    """θ (fp32 from the strategy's committed state) as a Hugging Face folder; rank 0 writes."""
    weights = gather_stages(dp.full_state_dict(), dims)  # a collective: every rank takes part
    if not dims.is_main:
        return None
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.checkpoint.export_dtype]
    unwrapped = getattr(dp.model, "module", dp.model)
    return hf_io.save_hf(folder, cfg.model.name, unwrapped.args, weights, dtype=dtype,
                         tokenizer_path=str(tokenizer.path) if tokenizer else None,
                         eos_id=tokenizer.eos_id if tokenizer else None)


def token_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-token cross-entropy losses and the number of tokens behind it."""
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)
    return loss, (labels != IGNORE_INDEX).sum()


def evaluate(model: nn.Module, loader, batches: int, device: Device, dims: ParallelDims, pipeline=None) -> float:
    was_training = model.training
    model.eval()
    loss_sum, count = torch.zeros((), dtype=torch.float64, device=device.torch), 0
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i >= batches:
                break
            batch = {k: v.to(device.torch, non_blocking=True) for k, v in batch.items()}
            loss, n = pipeline.evaluate(batch) if pipeline else token_loss_sum(model, batch)
            loss_sum += loss.double()
            count += n.item()
    model.train(was_training)
    if dims.tp_size * dims.pp_size == 1:
        total, tokens = all_reduce_sum([loss_sum.item(), float(count)], device.torch, dims.dp_group)
    else:  # one rank per (pp, tp) block holds the loss: the last stage's first tp rank
        owner = dims.tp_rank == 0 and dims.pp_rank == dims.pp_size - 1
        total, tokens = all_reduce_sum([loss_sum.item() * owner, float(count) * owner], device.torch)
    return total / max(tokens, 1.0)


def _overlap_metrics(result) -> dict:
    """Exposed communication and overlap of an overlapped schedule's update (none for sync ones)."""
    if not result.seconds:
        return {}
    metrics = {"exposed_comm_s": result.exposed_s,
               "overlap": max(0.0, 1.0 - result.exposed_s / max(result.seconds, 1e-9))}
    if result.drift is not None:
        metrics["estimate_drift"] = result.drift
    return metrics


def prepare_dump_folder(cfg: Config, dims: ParallelDims) -> Path:
    folder = Path(cfg.job.dump_folder)
    _main_first(dims, lambda: run_folder.prepare(cfg, folder), on=dims.is_main)
    return folder


def train(cfg: Config, model: nn.Module | None = None, datasets: tuple | None = None) -> dict:
    """Train with `cfg`. `model` (built, on the right device) and `datasets` ((train, val)
    torch datasets of {"input_ids", "labels"}) replace the configured ones when given."""
    _, world, local_rank, local_world = launch_env()
    validate(cfg, world)
    device = select_device(cfg.training.device, local_rank)
    if device.type == "cpu":
        set_cpu_threads(cfg.training.num_threads, local_world)
    own_group = not dist.is_initialized()
    dims = init_distributed(device, cfg.training.collective_timeout_s, cfg.parallelism.tensor_parallel_degree,
                            cfg.parallelism.pipeline_parallel_degree)
    heartbeat = health.start(dims.rank, dims.world_size)
    sigterm = health.SigtermGuard()
    clean = False
    try:
        summary = _train(cfg, dims, device, model, datasets)
        clean = True
        return summary
    except (RuntimeError, dist.DistBackendError, Terminated) as e:
        if not isinstance(e, Terminated) and not _is_peer_failure(e):
            raise
        where = heartbeat.where()
        # torchrun stops the survivors of a dead worker: find out who died before exiting.
        sigterm.defer()
        diagnosis = heartbeat.diagnose()
        cause = ("stopped by SIGTERM" if isinstance(e, Terminated) else
                 f"a collective failed ({str(e).strip().splitlines()[-1][:120]})")
        if isinstance(e, Terminated) and "stopped responding" not in diagnosis:
            raise Terminated() from None  # a plain SIGTERM: exit quietly with 143
        raise PeerFailure(
            f"rank {dims.rank}: {cause} during its {where}: {diagnosis}; [training] collective_timeout_s = "
            f"{cfg.training.collective_timeout_s:g}"
        ) from None
    finally:
        sigterm.restore()
        health.stop()
        if own_group:
            # After an error, skip the barrier: peers may be inside another collective, and
            # torchrun stops them once this process exits.
            destroy(barrier=clean)


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, dist.DistBackendError) or any(
        marker in text for marker in ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer"))


def _train(cfg: Config, dims: ParallelDims, device: Device, model, datasets) -> dict:
    import data

    t = cfg.training
    folder = prepare_dump_folder(cfg, dims)
    torch.manual_seed(t.seed)

    if datasets is None:
        tokenizer, train_set, val_set = build_data(cfg, dims)
        vocab = tokenizer.vocab_size
    else:
        tokenizer, (train_set, val_set) = None, datasets
        vocab = 0
    if cfg.eval.every and getattr(val_set, "num_windows", None) == 0:
        raise UserError(
            f"the validation split has no window of {t.seq_len + 1} tokens per rank; raise [data] val_fraction, "
            "point [data] validation at more text, or set [eval] every = 0"
        )
    if model is None:
        model = build_model(cfg, vocab, device)
    n_params = sum(p.numel() for p in model.parameters())
    model, pipeline = apply_model_parallel(model, cfg, dims, device)  # tp/pp: this rank's part of the model
    dtype = compute_dtype(t.mixed_precision, device)
    if cfg.model.compile:
        for block in model.layers:
            block.compile()
    _main_first(dims, lambda: run_folder.check_space(folder, n_params, cfg.checkpoint.enable), on=dims.is_main)
    flops_per_token = model.args.flops_per_token(t.seq_len) if hasattr(model, "args") else 6 * n_params

    global_batch = t.global_batch_size or t.local_batch_size * dims.dp_size
    accumulation = global_batch // (t.local_batch_size * dims.dp_size)
    tokens_per_step = global_batch * t.seq_len
    schedule = TokenSchedule(
        peak_lr=cfg.optimizer.lr,
        warmup_tokens=cfg.lr_schedule.warmup_steps * tokens_per_step,
        total_tokens=t.max_tokens or t.steps * tokens_per_step,
        decay=cfg.lr_schedule.decay,
        min_lr_ratio=cfg.lr_schedule.min_lr_ratio,
    )
    dp = build_data_parallel(model, cfg, dims, accumulation, schedule, dtype, device)
    autocast = dtype if cfg.parallelism.data_parallel == "ddp" and dtype != torch.float32 else None
    train_loader = data.build_dataloader(train_set, t.local_batch_size)
    val_loader = data.build_dataloader(val_set, t.local_batch_size)
    state = TrainState(dims.dp_size)
    checkpointer, resumed = _resume(cfg, folder, dims, dp, state, train_loader)
    log = MetricsLogger(folder, dims.is_main, cfg.metrics.tensorboard, cfg.metrics.progress_bar, t.steps,
                        keep_until_step=state.step)
    if resumed:
        log.info(f"torchacco: {resumed}")
    log.info(
        f"torchacco: {cfg.model.name}/{cfg.model.flavor} {n_params / 1e6:.2f}M params | "
        f"{cfg.parallelism.data_parallel} × {dims.dp_size}{model_parallel_label(dims, dp.model)} on {device.name} | "
        f"{str(dtype).removeprefix('torch.')} | "
        f"batch {global_batch} × {t.seq_len} (accumulation {accumulation}) | {t.steps} steps | {folder}"
    )

    try:
        # Per-rank rates divide by every rank (a replica spans tp × pp of them), not by dp.
        summary = _loop(cfg, dims, device, dp, state, train_loader, val_loader, log,
                        Throughput(flops_per_token, dims.world_size, device, dtype), autocast, checkpointer, pipeline)
        if cfg.checkpoint.export_hf:
            health.current().enter("export to Hugging Face format")
            exported = export_hf(cfg, dp, dims, folder / "hf", tokenizer)
            if exported:
                log.info(f"torchacco: exported θ to {exported} (Hugging Face safetensors + config.json)")
    finally:
        dp.close()  # drains an overlapped schedule's job and stops its thread, also on errors
        log.close()
        if checkpointer is not None:
            checkpointer.close()
    return summary


def _resume(cfg: Config, folder: Path, dims: ParallelDims, dp, state: TrainState, loader):
    """The checkpointer (or None) and a line saying what was resumed (or None)."""
    c = cfg.checkpoint
    if not c.enable:
        return None, None
    checkpointer = Checkpointer(folder / c.folder, dims.rank, c.keep, c.async_save,
                                timedelta(seconds=cfg.training.collective_timeout_s))
    path = Path(c.load_path) if c.load_path else checkpointer.latest() if c.resume else None
    if path is None:
        return checkpointer, None
    health.current().enter(f"checkpoint load ({path})")
    checkpointer.load(path, {"train": state})
    same_ranks = state.dp_size == dims.dp_size
    if not same_ranks and getattr(dp, "resume_needs_same_ranks", False):
        raise UserError(
            f"{path} holds {cfg.parallelism.data_parallel}'s in-flight accumulators of {state.dp_size} data-parallel "
            f"ranks; resume it on {state.dp_size} ranks (this run has {dims.dp_size})"
        )
    # Weights and optimizer state reshard onto any number of ranks; each rank's position in
    # its data shard only means something for the same number of ranks.
    checkpointer.load(path, checkpoint_state(dp, state, loader, dims, with_rank_state=same_ranks))
    message = f"resumed from {path} at step {state.step} ({int(state.tokens):,} tokens)"
    if not same_ranks:
        message += (f"; data-parallel ranks changed ({state.dp_size} -> {dims.dp_size}): weights and optimizer "
                    "state resharded, the data order restarts")
    state.dp_size = dims.dp_size
    return checkpointer, message


def checkpoint_state(dp, state: TrainState, loader, dims: ParallelDims, with_rank_state: bool = True) -> dict:
    rank_state = {f"rank{dims.rank}": RankState(loader)} if with_rank_state else {}
    return {"train": state, state_key(dp, dims): dp, **rank_state}


def _loop(cfg, dims, device, dp, state, train_loader, val_loader, log, throughput, autocast, checkpointer,
          pipeline=None) -> dict:
    t = cfg.training
    batches = iter(train_loader)  # after a resume: continues where the checkpoint left off
    summary = {}
    device.reset_peak_memory()
    throughput.restart(state.tokens)
    heartbeat = health.current()
    faults = from_env(dims.rank)
    while state.step < t.steps:
        heartbeat.enter(f"compute (step {state.step + 1})")
        poison = faults.before_period(state.step + 1)
        local = compute_period(dp, batches, device, autocast, throughput.times, pipeline, poison)
        heartbeat.enter(f"{dp.sync_phase} (step {state.step + 1})")
        with throughput.timing("sync"):
            result = dp.step(*local)
        if result is None or not result.committed:
            continue  # an overlapped schedule's non-committing round
        state.step += 1
        state.tokens += result.consumed
        step, tokens_seen = state.step, state.tokens
        stop_for_nonfinite = _count_nonfinite(t, state, result)


        done = bool(step == t.steps or (t.max_tokens and tokens_seen >= t.max_tokens))
        evaluate_now = cfg.eval.every and (step % cfg.eval.every == 0 or done)
        evaluate_now = evaluate_now and not stop_for_nonfinite
        if step % cfg.metrics.log_every == 0 or step == 1 or done or evaluate_now or result.skipped:
            record = {"step": step, "tokens": int(tokens_seen), "loss": result.loss, "lr": result.lr,
                      **throughput.since_last(tokens_seen, result)}
            if state.skipped:
                record |= {"skipped": result.skipped, "skipped_steps": state.skipped}
            if evaluate_now:
                heartbeat.enter(f"evaluation (step {step})")
                with dp.evaluation() as eval_model:
                    val_loss = evaluate(eval_model, val_loader, cfg.eval.batches, device, dims, pipeline)
                record |= {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50))}
            log.log(record)
            summary.update(record)
            throughput.restart(tokens_seen)  # evaluation, logging and checkpoints are not training time
        if stop_for_nonfinite:
            raise UserError(stop_for_nonfinite)  # after logging the step, before checkpointing it
        if checkpointer is not None and (done or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)):
            heartbeat.enter(f"checkpoint save (step {step})")
            checkpointer.save(step, checkpoint_state(dp, state, train_loader, dims))
            throughput.restart(tokens_seen)
        if done:
            break
    summary["steps"] = state.step
    return summary


def _count_nonfinite(t, state: TrainState, result) -> str | None:
    """Apply [training] on_nonfinite to an update whose loss or gradient was NaN/Inf: the reason
    to stop, if any. The job already left θ as it was; every rank decides alike (the numbers
    were gathered)."""
    if not result.skipped:
        state.skips_in_a_row = 0
        return None
    state.skipped += 1
    state.skips_in_a_row += 1
    source = (f"the loss of rank(s) {', '.join(map(str, result.nonfinite_ranks))}" if result.nonfinite_ranks
              else "the gradients")
    advice = "lower [optimizer] lr, raise [lr_schedule] warmup_steps, or check the data"
    if t.on_nonfinite == "abort":
        return (f"non-finite loss or gradient at step {state.step} (from {source}; loss {result.loss}, gradient "
                f"norm {result.grad_norm}); the update was not applied. {advice}, or set [training] "
                "on_nonfinite = 'skip' to skip such updates")
    if state.skips_in_a_row >= t.max_skips_in_a_row:
        return (f"{state.skips_in_a_row} updates in a row had a non-finite loss or gradient (steps "
                f"{state.step - state.skips_in_a_row + 1}-{state.step}, last from {source}); stopping "
                f"([training] max_skips_in_a_row = {t.max_skips_in_a_row}). {advice}")
    return None


def compute_period(dp, batches, device: Device, autocast, times: dict, pipeline=None,
                   poison: bool = False) -> tuple[float, float, float]:
    """Forward and backward over one compute period's micro-batches. This rank's tokens in the
    loss, loss sum, and tokens consumed (in the loss or not). With a pipeline, each micro-batch
    is one schedule step (its loss sum is 0 except on the last stage)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=device.torch)
    tokens = torch.zeros((), dtype=torch.int64, device=device.torch)
    consumed = 0
    for micro_batch in dp.micro_batches():
        t0 = time.perf_counter()
        batch = {k: v.to(device.torch, non_blocking=True) for k, v in next(batches).items()}
        t1 = time.perf_counter()
        with micro_batch, torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            if pipeline is not None:
                loss, n = pipeline.forward_backward(batch)
            else:
                loss, n = token_loss_sum(dp.model, batch)
                if poison:  # injected fault (torchacco/faults.py)
                    loss = loss * float("nan")
                loss.backward()
        loss_sum += loss.detach().double()
        tokens += n
        consumed += batch["input_ids"].numel()
        times["data"] += t1 - t0
        times["compute"] += time.perf_counter() - t1
    device.synchronize()
    return tokens.item(), loss_sum.item(), float(consumed)


class Throughput:
    """Tokens/s, FLOP/s, memory and the data/compute/sync split between two log records."""

    def __init__(self, flops_per_token: float, dp_size: int, device: Device, dtype: torch.dtype):
        self.flops_per_token, self.dp_size, self.device = flops_per_token, dp_size, device
        self.peak = device.peak_flops(dtype)
        self.restart(0.0)

    def restart(self, tokens: float) -> None:
        self.start, self.tokens = time.perf_counter(), tokens
        self.times = {"data": 0.0, "compute": 0.0, "sync": 0.0}

    @contextlib.contextmanager
    def timing(self, phase: str):
        start = time.perf_counter()
        yield
        self.times[phase] += time.perf_counter() - start

    def since_last(self, tokens: float, result) -> dict:
        tps = (tokens - self.tokens) / (time.perf_counter() - self.start)
        busy = sum(self.times.values()) or 1.0
        achieved = self.flops_per_token * tps / self.dp_size
        record = {
            "tokens_per_s": tps, "tokens_per_s_per_rank": tps / self.dp_size, "grad_norm": result.grad_norm,
            "tflops": achieved / 1e12, "memory_gib": self.device.peak_memory_gib(),
            "share_data": self.times["data"] / busy, "share_compute": self.times["compute"] / busy,
            "share_sync": self.times["sync"] / busy, "tokens_per_update": result.consumed,
            "loss_tokens_per_update": result.tokens,
            "micro_batches_per_rank": result.micro_batches, **_overlap_metrics(result),
        }
        if self.peak is not None:
            record["mfu"] = achieved / self.peak
        return record
