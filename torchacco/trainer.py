"""The one training loop. Strategies decide how gradients become updates; the loop owns data, loss,
metrics, evaluation, checkpoints and stopping. From Python: `train(cfg, model=..., datasets=..., tokenizer=...)`
(docs/python_api.md)."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from torchacco import checkpoint, data, emulation, fault_tolerance, health, preemption, run_folder, user_model
from torchacco.activation_checkpoint import apply_activation_checkpoint
from torchacco.blocks import block_list, compile_units
from torchacco.build import ModelKind, build_data, build_on_meta, build_strategy
from torchacco.checkpoint import Checkpointer, TrainState, check_shared, checkpoint_bytes, checkpoint_state, resume
from torchacco.config import Config
from torchacco.device import Device, compute_dtype, select_device, set_cpu_threads
from torchacco.errors import PeerFailure, Preempted, Stalled, Terminated, UserError
from torchacco.evaluate import evaluate
from torchacco.export import export_hf
from torchacco.faults import from_env
from torchacco.loss import TokenLoss, value
from torchacco.metrics import MetricsLogger, Throughput
from torchacco.parallel.diloco import has_outer_step
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.model_parallel import apply_model_parallel, check_hardware_queues, model_parallel_label
from torchacco.parallel.process_groups import (
    FLIGHT_RECORDER,
    destroy,
    dump_flight_recorder,
    init_distributed,
    launch_env,
    nccl_flight_recorder,
    on_one_rank,
)
from torchacco.parallel.strategy import Counts, Strategy, UpdatePlan
from torchacco.profiling import Profiler
from torchacco.runners import stall_deadline_s
from torchacco.spec import get_model_spec
from torchacco.validate import validate


def train(cfg: Config, model: nn.Module | None = None, datasets: tuple | None = None, tokenizer=None) -> dict:
    """Train with `cfg`. `model` (built, on the right device: a torchacco model, or a Hugging Face
    causal LM) and `datasets` ((train, val): torch datasets of {"input_ids", "labels"} windows, or
    texts that `tokenizer` turns into them; see data/texts.py) replace the configured ones when given."""
    _, world, local_rank, local_world = launch_env()
    kind = validate(cfg, world, model=model, own_data=datasets is not None)
    replica = fault_tolerance.replica_of_job() if cfg.diloco.fault_tolerant else None
    if replica:  # replica 0 writes the run's folder; the others a folder each inside it
        folder = str(Path(cfg.job.dump_folder) / f"replica_{replica}")
        cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, dump_folder=folder))
    device = _device(cfg, local_rank, local_world)
    own_group = not dist.is_initialized()
    p = cfg.parallelism
    replicas = 1 if replica is not None else p.replicas  # a fault-tolerant job is one replica
    timeout = cfg.training.collective_timeout_s
    job = None if replica is None else (replica, p.replicas)
    dims = init_distributed(device, timeout, p.tensor_parallel_degree, p.pipeline_parallel_degree, replicas, job)
    dump = lambda: dump_flight_recorder(Path(cfg.job.dump_folder), dims.rank)  # noqa: E731
    dims.heartbeat = heartbeat = health.start(dims.rank, dims.world_size, stall_deadline_s(dims.timeout), timeout, dump)
    sigterm = health.SigtermGuard()
    # After SigtermGuard: SIGTERM, when a preemption signal, ends the run at the next update instead.
    preempt = preemption.Preemption(cfg.preemption, dims, cfg.checkpoint.enable)
    clean = False
    adapter = user_model.adapt(model) if kind.foreign else None
    try:
        summary = _train(cfg, dims, device, kind, model, datasets, tokenizer, preempt)
        clean = True
        return summary
    except Preempted:
        clean = True  # every rank stopped at the same update
        raise
    except (RuntimeError, dist.DistBackendError, Terminated) as e:
        if not isinstance(e, Terminated) and not health.is_peer_failure(e):
            raise
        raise _peer_failure(e, cfg, dims, heartbeat, (sigterm, preempt)) from None
    finally:
        try:
            if adapter is not None:
                adapter.remove()
            preempt.close(clean)  # clean: every rank ended the run at the same update (finished or preempted)
            sigterm.restore()
            health.stop(heartbeat)
            if own_group:
                # After an error, skip the barrier: peers may be inside another collective, and
                # torchrun stops them once this process exits.
                destroy(barrier=clean)
        finally:
            health.torn_down()


def _device(cfg: Config, local_rank: int, local_world: int) -> Device:
    """This rank's device, its CPU threads and (CUDA) NCCL's flight recorder."""
    device = select_device(cfg.training.device, local_rank)
    check_hardware_queues(cfg.parallelism, cfg.diloco, device.type)
    if device.type == "cpu":
        set_cpu_threads(cfg.training.num_threads, local_world)
    if device.type == "cuda":
        nccl_flight_recorder(Path(cfg.job.dump_folder))
    return device


def _peer_failure(e: Exception, cfg: Config, dims: ParallelDims, heartbeat, deferred) -> Exception:
    """What a rank raises when a peer failed, stalled or SIGTERM stopped it: the diagnosis, reported at once."""
    where = heartbeat.where()
    # torchrun stops the survivors of a dead worker: find out who died before exiting.
    for signal_guard in deferred:  # SIGTERM and the preemption signal
        signal_guard.defer()
    if not isinstance(e, Terminated):  # the evidence first: the collectives each rank entered
        dump_flight_recorder(Path(cfg.job.dump_folder), dims.rank)
    diagnosis = heartbeat.diagnose()
    if isinstance(e, Terminated) and "stopped responding" not in diagnosis:
        return Terminated()  # a plain SIGTERM: exit quietly with 143
    cause = "stopped by SIGTERM" if isinstance(e, Terminated) else str(e)
    if not isinstance(e, Terminated | Stalled):
        cause = f"a collective failed ({cause.strip().splitlines()[-1][:120]})"
    message = f"rank {dims.rank}: {cause} during its {where}: {diagnosis}; "
    message += f"[training] collective_timeout_s = {cfg.training.collective_timeout_s:g}"
    health.report(message)  # now: the teardown below can block beside a dead peer
    return PeerFailure(message, reported=True)


def _train(cfg: Config, dims: ParallelDims, device: Device, kind: ModelKind, model, datasets, tokenizer, preempt):
    t = cfg.training
    folder = Path(cfg.job.dump_folder)
    on_one_rank(dims, lambda: run_folder.prepare(cfg, folder), main_only=True, what="check the dump folder")
    if device.type == "cuda":  # where NCCL's flight recorder writes on a hang: on this node's disk too
        (folder / FLIGHT_RECORDER).mkdir(parents=True, exist_ok=True)
    if cfg.checkpoint.enable:
        check_shared(folder / cfg.checkpoint.folder, dims)
    torch.manual_seed(t.seed)
    tokenizer, train_set, val_set = _datasets(cfg, dims, datasets, tokenizer)
    vocab = tokenizer.vocab_size if tokenizer else 0
    spec = get_model_spec(cfg.model.name)
    model, init = _model(cfg, spec, device, kind, model, vocab)
    n_params = sum(p.numel() for p in model.parameters())
    loss_fn = TokenLoss(t.loss_chunks, dims.tp_enabled and not dims.pp_enabled and cfg.parallelism.loss_parallel)
    if cfg.emulation.virtual_compute:  # waits instead of compute, before the strategy's hooks (speed only)
        loss_fn = emulation.install(model, cfg.emulation, dims.rank)
    flops_per_token = kind.flops_per_token(model, t.seq_len)  # of the whole model, before any parallelism
    dtype = compute_dtype(t.mixed_precision, device)
    plan = UpdatePlan.from_config(t, cfg.optimizer, cfg.lr_schedule, dims.dp_size, dtype, dims.replicas)
    strategy, pipeline = parallelize(cfg, spec, dims, device, model, loss_fn, plan, init)
    run = _start(cfg, dims, device, strategy, (train_set, val_set), loss_fn, pipeline, n_params)
    run.log.info(f"torchacco: {kind.label} {n_params / 1e6:.2f}M params | {strategy.name} × "
                 f"{dims.dp_size}{model_parallel_label(dims, strategy.model)}{_replicas(cfg, dims)} "
                 f"on {device.name} | {str(dtype).removeprefix('torch.')} | batch "
                 f"{plan.tokens_per_update * dims.replicas // t.seq_len:.0f} × {t.seq_len} "
                 f"(accumulation {plan.micro_batches}) | {t.steps} steps | {folder}")  # fmt: skip
    if cfg.emulation.virtual_compute:
        run.log.info("torchacco: virtual compute ([emulation]): forward, backward and AdamW are waits; losses are "
                     "not computed (logged as null), speed is what this run measures")  # fmt: skip
    run.throughput = Throughput(flops_per_token, dims.world_size, device, dtype)
    try:
        summary = _loop(cfg, dims, device, run, preempt)
        if cfg.checkpoint.export_hf:
            dims.heartbeat.enter("export to Hugging Face format")
            c = cfg.checkpoint
            exported = export_hf(cfg.model.name, kind, strategy, dims, folder / "hf", c.export_dtype, tokenizer)
            if exported:
                run.log.info(f"torchacco: exported θ to {exported} (Hugging Face safetensors + config.json)")
    finally:
        run.profiler.close()
        strategy.close()  # drains an overlapped schedule's job and stops its thread, also on errors
        run.log.close()
        if run.checkpointer is not None:
            run.checkpointer.close()
    return summary


def _datasets(cfg: Config, dims: ParallelDims, datasets, tokenizer):
    """(tokenizer, train set, validation set) of this rank: configured, or passed to train()."""
    t = cfg.training
    if datasets is None:
        tokenizer, train_set, val_set = build_data(cfg.data, cfg.tokenizer, t.seq_len, t.seed, dims)
    else:
        where = (t.seq_len, dims.data_rank, dims.data_size, t.seed, cfg.eval.every > 0)
        tokenizer, train_set, val_set = data.python_datasets(datasets, tokenizer, cfg.data, cfg.tokenizer, *where)
    if cfg.eval.every and getattr(val_set, "num_windows", None) == 0:
        raise UserError(f"the validation split has no window of {t.seq_len + 1} tokens per rank; raise [data] "
                        "val_fraction, point [data] validation at more text, or set [eval] every = 0")  # fmt: skip
    return tokenizer, train_set, val_set


def _model(cfg: Config, spec, device: Device, kind: ModelKind, model, vocab: int):
    """(the configured model on meta, the step that allocates it); or (the one passed to train(), checked, None)."""
    if model is None:
        return build_on_meta(spec, cfg.model, vocab, cfg.training.seed, device)
    on = next(model.parameters()).device
    if on.type != device.type or (device.type == "cuda" and on.index not in (None, device.index)):
        raise UserError(f"the model passed to train() is on {on}, the run on {device.torch}; move it there first "
                        f"(model.to('{device.torch}'))")  # fmt: skip
    if kind.foreign and vocab:
        user_model.check_vocabulary(model, vocab)
    return model, None


def parallelize(cfg: Config, spec, dims: ParallelDims, device: Device, model: nn.Module, loss_fn, plan, init=None):
    """torchtitan's order: stages -> tensor parallel -> activation checkpointing -> compile; then the data-parallel
    strategy: (strategy, pipeline or None). `init` allocates a model built on meta: run by the strategy's build (for
    FSDP, after sharding), so each rank allocates only its part."""
    t = cfg.training
    model, pipeline = apply_model_parallel(model, spec, cfg.parallelism, cfg.model, t, dims, device, loss_fn)
    apply_activation_checkpoint(block_list(model), t.activation_checkpoint, t.selective_checkpoint)
    if cfg.model.compile:
        for unit in compile_units(model):
            unit.compile()
    return build_strategy(model, cfg, dims, plan, device, init), pipeline


def _replicas(cfg: Config, dims: ParallelDims) -> str:
    d = cfg.diloco
    if not has_outer_step(dims.replicas, d):
        return ""
    streaming = f", {d.fragments} fragments, τ {d.overlap_steps}" if d.fragments > 1 or d.overlap_steps else ""
    wire = f"top {d.topk:.2%} in {d.outer_dtype}" if d.topk else d.outer_dtype
    h = f"{d.sync_every}–{d.sync_every_max} (QSR)" if d.sync_every_max else d.sync_every
    if dims.replicas == 1:
        return f" (an outer step every H {h}{streaming}: SNOO)"
    return f" × {dims.replicas} replicas (DiLoCo, H {h}{streaming}, outer {wire})"


def _start(
    cfg: Config, dims: ParallelDims, device: Device, strategy: Strategy, sets, loss_fn, pipeline, n_params: int
) -> Run:
    """The loaders, a resume from the latest checkpoint (or load_path), the metrics log."""
    t, folder = cfg.training, Path(cfg.job.dump_folder)
    train_loader, val_loader = (data.build_dataloader(s, t.local_batch_size) for s in sets)
    state = TrainState(dims.data_size)
    if cfg.checkpoint.enable:  # before anything is written: the bytes this run's checkpoints take
        saved = checkpoint_state(strategy, state, train_loader, dims)
        need, host = checkpoint_bytes(saved, n_params), checkpoint.staging_bytes(saved)  # host: an async save's copy
        space = lambda: run_folder.check_space(folder, need, n_params)
        on_one_rank(dims, space, main_only=True, what="check the free space")
    dims.heartbeat.enter("checkpoint load")
    timeout = timedelta(seconds=t.collective_timeout_s)
    checkpointer, resumed = resume(cfg.checkpoint, folder, dims, strategy, state, train_loader, timeout)
    m = cfg.metrics
    log = MetricsLogger(folder, dims.is_main, m.tensorboard, m.progress_bar, t.steps, state.step, t.max_tokens)
    if cfg.checkpoint.enable:
        log.info(f"torchacco: a checkpoint takes about {need / 2**20:,.1f} MiB ({folder / cfg.checkpoint.folder})")
    if cfg.checkpoint.enable and cfg.checkpoint.async_save:
        log.info(f"torchacco: an asynchronous save holds about {host / 2**20:,.1f} MiB of host memory per rank, "
                 f"{host * dims.local_world_size / 2**20:,.1f} MiB on a node of {dims.local_world_size}")  # fmt: skip
    if resumed:
        log.info(f"torchacco: {resumed}")
    profiler = Profiler(cfg.profiling, folder, dims.rank, device, state.step)
    batches = iter(train_loader)  # after a resume: continues where the checkpoint left off
    return Run(strategy, state, train_loader, val_loader, log, None, checkpointer, loss_fn, pipeline, profiler, batches)


@dataclass
class Run:
    """The parts of a run that the loop drives."""

    strategy: Strategy
    state: TrainState
    train_loader: object
    val_loader: object
    log: MetricsLogger
    throughput: Throughput | None  # set once the model's FLOPs per token are known
    checkpointer: Checkpointer | None
    loss_fn: TokenLoss
    pipeline: object | None
    profiler: Profiler
    batches: object  # iter(train_loader), renewed when a heal replaces the loader's position

    # The whole run's state, what a strategy joining a running run copies from a peer (`Strategy.start`): the loop's
    # counts, the strategy's state and the data position (every replica reads its own shard, in step).
    def heal_state(self) -> dict:
        return {"train": self.state.state_dict(), "strategy": self.strategy.state_dict(),
                "loader": self.train_loader.state_dict()}  # fmt: skip

    def load_heal_state(self, state: dict) -> None:
        self.state.load_state_dict(fault_tolerance.copy_into(self.state.state_dict(), state["train"]))
        self.strategy.load_state_dict(fault_tolerance.copy_into(self.strategy.state_dict(), state["strategy"]))
        self.train_loader.load_state_dict(state["loader"])
        self.batches = iter(self.train_loader)  # from the position just loaded


def _loop(cfg: Config, dims: ParallelDims, device: Device, run: Run, preempt: preemption.Preemption) -> dict:
    strategy, state, throughput, loss_fn, pipeline = run.strategy, run.state, run.throughput, run.loss_fn, run.pipeline
    t = cfg.training
    dtype = compute_dtype(t.mixed_precision, device)
    autocast = dtype if strategy.traits.autocast_compute and dtype != torch.float32 else None
    summary = {}
    snapshot = lambda: checkpoint_state(strategy, state, run.train_loader, dims)  # what a checkpoint saves now
    if (joined := strategy.start(run.heal_state, run.load_heal_state)) is not None:
        state.step += 1  # the update it joined the run at, as the others count it
        state.tokens += joined.consumed
        if run.checkpointer is not None and cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0:
            run.checkpointer.save(state.step, snapshot())  # as the others
    device.reset_peak_memory()
    throughput.restart(state.tokens)
    heartbeat = dims.heartbeat
    faults = from_env(dims.rank, dims.replica_rank, heartbeat)
    while state.step < t.steps:
        heartbeat.enter(f"compute (step {state.step + 1})")
        poison = faults.before_period(state.step + 1)
        counts = compute_period(strategy, loss_fn, run.batches, device, autocast, throughput.times, pipeline, poison)
        heartbeat.enter(f"{strategy.traits.sync_phase} (step {state.step + 1})")
        sync_start = time.perf_counter()
        result = strategy.step(counts)
        throughput.times["sync"] += time.perf_counter() - sync_start
        if result is None or not result.committed:
            continue  # an overlapped schedule's non-committing round
        state.step += 1
        state.tokens += result.consumed
        step, tokens_seen = state.step, state.tokens
        stop_for_nonfinite = _count_nonfinite(t, state, result)
        if result.advice:
            run.log.info(f"torchacco: {result.advice}")

        done = bool(step == t.steps or (t.max_tokens and tokens_seen >= t.max_tokens))
        evaluate_now = cfg.eval.every and (step % cfg.eval.every == 0 or done) and not stop_for_nonfinite
        logged = step % cfg.metrics.log_every == 0 or step == 1 or done or evaluate_now or result.skipped
        if logged or result.outer:
            summary.update(_log_update(cfg, dims, device, run, result, evaluate_now, heartbeat))
        if stop_for_nonfinite:
            raise UserError(stop_for_nonfinite)  # after logging the step, before checkpointing it
        saved = run.checkpointer is not None and (done or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0))
        if saved:
            heartbeat.enter(f"checkpoint save (step {step})")
            with record_function("torchacco/checkpoint_save"):
                run.checkpointer.save(step, snapshot())
            throughput.restart(tokens_seen)
        run.profiler.step(step)
        if done:
            break
        # A stop signal on any rank: every rank stops here, after a checkpoint. Asked where the ranks meet
        # (DiLoCo's replicas: at outer steps), so that it never paces one replica by another.
        ranks_met = cfg.parallelism.replicas == 1 or bool(result.outer)
        if ranks_met and preempt.agreed(wait=cfg.parallelism.replicas > 1):
            preempt.stop(step, run.checkpointer, None if saved else snapshot)
    summary["steps"] = state.step
    return summary


def _log_update(cfg: Config, dims: ParallelDims, device: Device, run: Run, result, evaluate_now, heartbeat) -> dict:
    """The update's metrics record (with a validation loss when `evaluate_now`), logged."""
    state, throughput, step = run.state, run.throughput, run.state.step
    record = {
        "step": step,
        "tokens": int(state.tokens),
        "loss": None if cfg.emulation.virtual_compute else result.loss,
        "lr": result.lr,
        **throughput.since_last(state.tokens, result),
        **result.outer,
    }
    if state.skipped:
        record |= {"skipped": result.skipped, "skipped_steps": state.skipped}
    if evaluate_now:
        heartbeat.enter(f"evaluation (step {step})")
        with run.strategy.evaluation() as eval_model, record_function("torchacco/evaluation"):
            val_loss = evaluate(eval_model, run.val_loader, cfg.eval.batches, device, dims, run.pipeline, run.loss_fn)
        record |= {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50))}
    run.log.log(record)
    throughput.restart(state.tokens)  # evaluation, logging and checkpoints are not training time
    return record


def _count_nonfinite(t, state: TrainState, result) -> str | None:
    """Apply [training] on_nonfinite to an update whose loss or gradient was NaN/Inf (θ is already left as it
    was): the reason to stop, if any. Every rank decides alike (the numbers were gathered)."""
    if not result.skipped:
        state.skips_in_a_row = 0
        return None
    state.skipped += 1
    state.skips_in_a_row += 1
    ranks = ", ".join(map(str, result.nonfinite_ranks))
    source = f"the loss of rank(s) {ranks}" if result.nonfinite_ranks else "the gradients"
    advice = "lower [optimizer] lr, raise [lr_schedule] warmup_steps, or check the data"
    if t.on_nonfinite == "abort":
        return (f"non-finite loss or gradient at step {state.step} (from {source}; loss "
                f"{result.loss}, gradient norm {result.grad_norm}); the update was not applied. "
                f"{advice}, or set [training] on_nonfinite = 'skip' to skip such updates")  # fmt: skip
    if state.skips_in_a_row >= t.max_skips_in_a_row:
        return (f"{state.skips_in_a_row} updates in a row had a non-finite loss or gradient (steps "
                f"{state.step - state.skips_in_a_row + 1}-{state.step}, last from {source}); stopping "
                f"([training] max_skips_in_a_row = {t.max_skips_in_a_row}). {advice}")  # fmt: skip
    return None


def compute_period(
    strategy: Strategy, loss_fn: TokenLoss, batches, device: Device, autocast, times: dict, pipeline=None, poison=False
) -> Counts:
    """Forward and backward over one compute period's micro-batches: what this rank computed. With a
    pipeline, each micro-batch is one schedule step (its loss sum is 0 except on the last stage)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=device.torch)
    tokens = torch.zeros((), dtype=torch.int64, device=device.torch)
    consumed, n = 0, 0
    watch = device.stopwatch().start()
    for micro_batch in strategy.micro_batches():
        t0 = time.perf_counter()
        batch = next(batches, None)
        if batch is None:  # torchacco's own datasets are endless; a dataset passed to train() may not be
            raise UserError("the training dataset ran out; pass an endless one (an IterableDataset that starts "
                            "over), or texts (data/texts.py packs them into endless windows)")  # fmt: skip
        batch = {k: v.to(device.torch, non_blocking=True) for k, v in batch.items()}
        t1 = time.perf_counter()
        with (
            micro_batch,
            torch.autocast(device.type, dtype=autocast, enabled=autocast is not None),
            loss_fn.context(),
            record_function("torchacco/forward_backward"),
        ):
            if pipeline is not None:
                loss, count = pipeline.forward_backward(batch, poison)
            else:
                loss, count = loss_fn.of_batch(strategy.model, batch)
                if poison:  # injected fault (torchacco/faults.py)
                    loss = loss * float("nan")
                loss.backward()
        loss_sum += value(loss).double()
        tokens += count
        consumed += batch["input_ids"].numel()
        n += 1
        times["data"] += t1 - t0
        times["compute"] += time.perf_counter() - t1  # on CUDA: the time to issue the kernels
    # No host sync: the counts stay on the device, which keeps working while the strategy ends the period.
    return Counts(tokens, loss_sum, n, float(consumed), (watch.stop(),))
