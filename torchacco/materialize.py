"""Building a model sharded from the start: construct on meta, parallelise there, then allocate and initialise
only this rank's shard, with the values of the whole model initialised on one device from the same seed
(docs/architecture.md, "Order of application"). The trainer runs the step `defer` returns after tensor and pipeline
parallelism; FSDP runs it after sharding, before it builds its optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

# Initialisers whose result ignores the tensor's contents (draw whole, then slice); other in-place ops act
# elementwise, which DTensor applies to the local shard itself.
_FRESH_METHODS = {
    "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
}  # fmt: skip
_FRESH_INIT = {
    name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_") and name != "calculate_gain"
}


def defer(
    model: nn.Module, device: torch.device, seed: int, load: Callable[[nn.Module], None] | None = None
) -> Callable[[], None]:
    """The step that materialises `model` (on meta), to run once: allocate on `device`, initialise from `seed` over
    the module tree as it is now (before pipeline stages prune it), then `load(full)`."""
    full = _shadow(model)

    def run() -> None:
        model.to_empty(device=device)
        torch.manual_seed(seed)
        with torch.no_grad(), ShardedInit(device):
            full.init_weights()  # also the buffers (RoPE tables) that no checkpoint holds
        if load is not None:
            load(full)

    return run


def _shadow(module: nn.Module) -> nn.Module:
    """The module tree as it is now, sharing parameters and buffers: what parallelism later prunes or wraps
    stays in the shadow."""
    shadow = copy.copy(module)
    shadow._modules = {name: None if m is None else _shadow(m) for name, m in module._modules.items()}
    return shadow


class ShardedInit(TorchFunctionMode):
    """Random initialisers of sharded or absent (meta) tensors draw the whole tensor on `device`, then keep
    this rank's part."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if not args and "tensor" in kwargs:  # torch.nn.init passes its tensor by keyword
            args = (kwargs.pop("tensor"),)
        target = args[0] if args else None
        sharded = isinstance(target, DTensor)
        fresh = _FRESH_INIT if getattr(func, "__module__", None) == "torch.nn.init" else _FRESH_METHODS
        if (sharded or getattr(target, "is_meta", False)) and name in fresh:
            whole = torch.empty(target.shape, dtype=target.dtype, device=self.device)
            func(whole, *args[1:], **kwargs)
            if sharded:
                copy_shard(target, whole)
            return target
        if sharded and name == "copy_" and not isinstance(args[1], DTensor):
            copy_shard(target, args[1].expand(target.shape))
            return target
        return func(*args, **kwargs)


def copy_shard(target: DTensor, whole: torch.Tensor) -> None:
    """Write this rank's part of `whole` (every rank holds all of it) into `target`; no communication."""
    part = distribute_tensor(whole.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
    target.to_local().copy_(part.to_local())
