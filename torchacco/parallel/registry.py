"""The data-parallel strategies by name: `[parallelism] data_parallel` picks one.

A strategy is one class (a module of this package, or a user's own, passed to `register`): its
name, options, traits, cost-model figures and benchmark variants are read from it, so the config's
choices and sections, the configuration reference, the cost model and the benchmarks' strategy
lists follow the registered classes.
"""

from __future__ import annotations

from torchacco.errors import UserError
from torchacco.parallel.acco import ACCO
from torchacco.parallel.ddp import DDP
from torchacco.parallel.dpu import DPU
from torchacco.parallel.fsdp import FSDP
from torchacco.parallel.hsdp import HSDP
from torchacco.parallel.strategy import Strategy, UpdatePlan
from torchacco.parallel.wp import WP
from torchacco.parallel.zero1 import ZeRO1

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (DDP, ZeRO1, FSDP, HSDP, ACCO, DPU, WP)}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy class (usable as a decorator); its name must be new, its options section
    new or the very dataclass another strategy already reads there. Register before building the
    config (`load_config`, `Config()`): a config has the sections of the strategies registered then."""
    if cls.name in STRATEGIES and STRATEGIES[cls.name] is not cls:
        raise ValueError(f"a strategy named {cls.name!r} is registered already ({STRATEGIES[cls.name].__qualname__})")
    shared = {c.options_section: c.options for c in STRATEGIES.values() if c.options is not None}
    if cls.options is not None and shared.get(cls.options_section, cls.options) is not cls.options:
        raise ValueError(f"[{cls.options_section}] holds another strategy's options; give {cls.name} its own section")
    STRATEGIES[cls.name] = cls
    return cls


def strategy_class(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise UserError(f"unknown data-parallel strategy {name!r}; registered: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def default_strategy() -> type[Strategy]:
    return next(cls for cls in STRATEGIES.values() if cls.default)


def build_strategy(model, cfg, dims, plan: UpdatePlan, device) -> Strategy:
    """The configured strategy over `model` (this rank's part of it, after tensor/pipeline parallelism),
    inside DiLoCo's outer step when the run has several replicas (`plan` is then one replica's)."""
    if dims.replicas > 1:
        from torchacco.parallel.diloco import DiLoCo

        return DiLoCo.from_config(model, cfg, dims, plan, device)
    return strategy_class(cfg.parallelism.data_parallel).from_config(model, cfg, dims, plan, device)
