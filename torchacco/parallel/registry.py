"""The data-parallel strategies by name: `[parallelism] data_parallel` picks one."""

from __future__ import annotations

from torchacco.parallel.acco import ACCO, DPU, WP
from torchacco.parallel.replicated import DDP, FSDP
from torchacco.parallel.strategy import Strategy, UpdatePlan
from torchacco.parallel.zero1 import ZeRO1

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, ZeRO1, FSDP, ACCO, DPU, WP)}
# `[parallelism] data_parallel`'s Literal choices are these names (tests/test_config.py keeps them equal).


def strategy_class(name: str) -> type[Strategy]:
    return STRATEGIES[name]


def build_strategy(model, cfg, dims, plan: UpdatePlan, device) -> Strategy:
    """The configured strategy over `model` (this rank's part of it, after tensor/pipeline parallelism)."""
    return strategy_class(cfg.parallelism.data_parallel).from_config(model, cfg, dims, plan, device)
