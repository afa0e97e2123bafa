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


# docs/parallelism.md's trait table, generated from the classes (tests/test_docs.py checks the page) ---------

TRAITS_BEGIN, TRAITS_END = "<!-- traits:begin -->", "<!-- traits:end -->"


def traits_table(strategies: dict[str, type[Strategy]] | None = None) -> str:
    """A markdown table of each strategy's declared traits: the built-in ones unless given others."""
    if strategies is None:
        strategies = {n: c for n, c in STRATEGIES.items() if c.__module__.startswith("torchacco.parallel.")}
    yes = {True: "yes", False: "no"}
    columns = {
        "communication": lambda c: f"`{c.communication}`",
        "overlapped": lambda c: yes[c.overlapped],
        "periods per update": lambda c: str(c.periods_per_update),
        "tp / pp": lambda c: yes[c.supports_model_parallel],
        "shards θ": lambda c: yes[c.shards_theta],
        "flat buffers": lambda c: yes[c.flat_buffers],
        "`balance_batches`": lambda c: yes[c.balances],
        "inside DiLoCo replicas": lambda c: yes[c.supports_replicas],
        "resume on another dp size": lambda c: yes[not c.resume_needs_same_ranks],
        "forward/backward": lambda c: "fp32 weights, autocast" if c.autocast_compute else "compute dtype",
        "update of": lambda c: f"`{c.update_of}`" if c.update_of else "its own",
        "options": lambda c: f"`[{c.options_section}]`" if c.options_section else "—",
    }
    lines = ["| `data_parallel` | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, cls in strategies.items():
        cells = [f"`{name}`" + (" (default)" if cls.default else "")] + [cell(cls) for cell in columns.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m torchacco.parallel.registry: the table to put between the markers
    print(f"{TRAITS_BEGIN}\n{traits_table()}{TRAITS_END}")
