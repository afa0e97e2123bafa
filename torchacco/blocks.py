"""A model's transformer blocks: the unit of FSDP sharding, activation checkpointing and
`[model] compile`, found for torchacco's models and foreign ones alike."""

from __future__ import annotations

import torch.nn as nn


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside torch's DistributedDataParallel wrapper (whose parameter names it prefixes), or the
    model itself."""
    return getattr(model, "module", model)


def blocks_of(model: nn.Module) -> nn.Module | None:
    """The transformer blocks: `model.layers` (torchacco's contract), else a foreign model's
    ModuleList of its `_no_split_modules` classes, else its largest ModuleList of one class."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.ModuleList | nn.ModuleDict):
        return layers
    unsplit = set(getattr(model, "_no_split_modules", None) or ())
    candidates = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList) and len(m) and len({type(b) for b in m}) == 1 and _numel(m)
    ]
    declared = [m for m in candidates if type(m[0]).__name__ in unsplit]
    return max(declared or candidates, key=_numel, default=None)


def block_list(model: nn.Module) -> list[nn.Module]:
    """The blocks in order, [] for a model without: a ModuleDict's modules, not its keys."""
    blocks = blocks_of(model)
    return [] if blocks is None else list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def compile_units(model: nn.Module) -> list[nn.Module]:
    """What `[model] compile` compiles: each block, or a blockless model whole."""
    return block_list(model) if blocks_of(model) is not None else [model]
