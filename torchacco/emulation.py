"""Virtual compute: on the emulated cluster, ranks wait where a GPU would compute, leaving the CPU to what communicates.

With `[emulation] virtual_compute` (the benchmarks' `--virtual-compute` sets it from `calibrate()`):
- each block's forward and backward, and the rest of the model's (embedding, head and loss), become sleeps of
  their calibrated durations, which hold no CPU; AdamW's elementwise work becomes a sleep per element;
- everything that communicates stays real: parameters and gradients have the model's sizes, and the strategy's
  hooks, buffers, schedules and collectives run as they do.

Gradients are zeros: losses are not computed and are logged as null; speed is what this measures. A slow rank
(`slow_ranks`) waits `slow_factor` times as long, as a slower GPU would compute."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from torchacco.blocks import block_list, blocks_of
from torchacco.device import Device
from torchacco.errors import UserError, run_cli
from torchacco.loss import TokenLoss
from torchacco.optim import ShardedAdamW, SlowMomentumAdamW, build_adamw

if TYPE_CHECKING:
    from torchacco.config import Config, Emulation


class _Wait(torch.autograd.Function):
    """`carrier` through a unit that takes `forward_s` and whose backward takes `backward_s` and gives each of
    `params` a zero gradient (autograd's hooks on them fire as after a real backward)."""

    @staticmethod
    def forward(ctx, carrier, forward_s, backward_s, *params):
        ctx.backward_s = backward_s
        ctx.shapes = [(p.shape, p.dtype, p.device) for p in params]  # FSDP may free the storage after forward
        time.sleep(forward_s)
        return carrier.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return (grad, None, None, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def virtualize(model: nn.Module, settings: Emulation, rank: int) -> None:
    """Replace `model`'s compute with waits (in place, before any parallelism: FSDP's and DDP's hooks stay)."""
    blocks = blocks_of(model)
    if blocks is None or getattr(model, "layers", None) is not blocks:
        raise UserError("[emulation] virtual_compute needs a model whose blocks are model.layers (torchacco's models)")
    factor = slowness(settings, rank)
    per_block = settings.block_share / len(blocks)
    block_f, block_b = (factor * s * per_block for s in (settings.forward_s, settings.backward_s))
    rest_f, rest_b = (factor * s * (1 - settings.block_share) for s in (settings.forward_s, settings.backward_s))
    units = block_list(model)
    for block in units:
        # the parameters are read at each call: FSDP swaps in the unsharded ones for forward
        block.forward = lambda x, *args, _block=block, **kwargs: _Wait.apply(x, block_f, block_b, *_block.parameters())
    others = [m for m in model.children() if m is not blocks]

    def forward(input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        x = torch.zeros(*input_ids.shape, 1, device=input_ids.device)
        for block in units:
            x = block(x)
        own = [p for p in model._parameters.values() if p is not None]
        return _Wait.apply(x, rest_f, rest_b, *own, *(p for m in others for p in m.parameters()))

    model.forward = forward


def slowness(settings: Emulation, rank: int) -> float:
    """How much longer than calibrated this rank's waits last: slow_factor on the slow ranks, else 1."""
    slow = {int(r) for r in settings.slow_ranks.split(",") if r.strip()}
    return settings.slow_factor if rank in slow else 1.0


class VirtualLoss(TokenLoss):
    """The trainer's loss under virtual compute: the model's output summed (zero), over the batch's token count."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return logits.sum()


def install_optimizer_waits(seconds_per_element: float, factor: float = 1.0) -> None:
    """AdamW's elementwise work as waits, for the rest of this process (a training worker's): torch's AdamW (the
    replicated and FSDP strategies) and ShardedAdamW's chunks (ZeRO-1 and the overlapped schedules, on their side
    runner too). DiLoCo's outer step, a few elementwise operations per outer step, stays real."""
    per = seconds_per_element * factor

    def sharded_update(self, slices, grad, lr, step, offset):
        time.sleep(slices[0].numel() * per)
        return slices[0]

    def adamw_step(self, closure=None):
        time.sleep(sum(p.numel() for g in self.param_groups for p in g["params"]) * per)

    ShardedAdamW._update = sharded_update
    torch.optim.AdamW.step = SlowMomentumAdamW.step = adamw_step


def install(model: nn.Module, settings: Emulation, rank: int) -> VirtualLoss:
    """Virtual compute for this rank's process: the model's waits, the optimizer's, and the loss to train with."""
    virtualize(model, settings, rank)
    install_optimizer_waits(settings.optimizer_s_per_param, slowness(settings, rank))
    return VirtualLoss()


def calibrate(cfg: Config, threads: int, repeats: int = 8) -> dict:
    """The [emulation] durations of one micro-batch of the config's shape on this machine's CPU with `threads`
    threads (medians over `repeats`): forward (with the loss), backward, the blocks' share, AdamW per element."""
    from torchacco.build import build_model, model_args
    from torchacco.spec import get_model_spec

    torch.set_num_threads(threads)
    t, spec = cfg.training, get_model_spec(cfg.model.name)
    model = build_model(spec, cfg.model, cfg.tokenizer.vocab_size, t.seed, Device("cpu"))
    vocab = model_args(spec, cfg.model, cfg.tokenizer.vocab_size).vocab_size
    ids = torch.randint(0, vocab, (t.local_batch_size, t.seq_len))
    batch, loss_fn = {"input_ids": ids, "labels": ids}, TokenLoss(t.loss_chunks)
    spans: list[float] = []  # -start and end of each block's forward: their sum is the time in blocks
    for block in block_list(model):
        block.register_forward_pre_hook(lambda m, a: spans.append(-time.perf_counter()))
        block.register_forward_hook(lambda m, a, o: spans.append(time.perf_counter()))
    samples = []  # (forward, backward, the blocks' share of forward) of each repeat
    for _ in range(repeats + 2):
        spans.clear()
        t0 = time.perf_counter()
        loss, _ = loss_fn.of_batch(model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, sum(spans) / (t1 - t0)))
    forward, backward, share = zip(*samples[2:])  # two to warm up
    optimizer = build_adamw(model, cfg.optimizer)
    optimizer.step()
    t0 = time.perf_counter()
    for _ in range(repeats):
        optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    per_param = (time.perf_counter() - t0) / repeats / n
    median = lambda xs: sorted(xs)[len(xs) // 2]
    return {"forward_s": median(forward), "backward_s": median(backward), "block_share": median(share),
            "optimizer_s_per_param": per_param, "threads": threads}  # fmt: skip


def overrides(calibration: dict) -> list[str]:
    """Trainer arguments that run with `calibration`'s virtual compute."""
    keys = ("forward_s", "backward_s", "block_share", "optimizer_s_per_param")
    settings = (a for k in keys for a in (f"--emulation.{k}", repr(calibration[k])))
    return ["--emulation.virtual_compute", "true", *settings]


def main(argv: list[str] | None = None) -> int:
    from torchacco.config import load_config

    parser = argparse.ArgumentParser(prog="torchacco calibrate", description=calibrate.__doc__)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads the measured forward/backward use")
    args, rest = parser.parse_known_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    return run_cli(lambda: print(json.dumps(calibrate(load_config(rest), args.threads))))
