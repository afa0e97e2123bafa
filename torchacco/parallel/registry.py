"""The data-parallel strategies by name: `[parallelism] data_parallel` picks one.

A built-in strategy is one line of `BUILT_IN`, its class imported when first asked for (building a config imports
no strategy, nor torch); a user's class joins with `register`. The config's choices and sections, the
configuration reference, the cost model and the benchmarks' strategy lists follow these.
"""

from __future__ import annotations

import importlib

from torchacco.errors import UserError
from torchacco.options import HSDPOptions, Options, OverlappedOptions

# name -> ("module:Class", its options section or None); the first is the default.
BUILT_IN: dict[str, tuple[str, type[Options] | None]] = {
    "ddp": ("torchacco.parallel.ddp:DDP", None),
    "zero1": ("torchacco.parallel.zero1:ZeRO1", None),
    "fsdp": ("torchacco.parallel.fsdp:FSDP", None),
    "hsdp": ("torchacco.parallel.hsdp:HSDP", HSDPOptions),
    "acco": ("torchacco.parallel.acco:ACCO", OverlappedOptions),
    "dpu": ("torchacco.parallel.dpu:DPU", OverlappedOptions),
    "wp": ("torchacco.parallel.wp:WP", OverlappedOptions),
}
REGISTERED: dict[str, type] = {}  # the classes `register` added


def names() -> tuple[str, ...]:
    return (*BUILT_IN, *REGISTERED)


def default_name() -> str:
    return next(iter(BUILT_IN))


def option_sections() -> dict[str, type[Options]]:
    """[section] -> options dataclass of the strategies (a section two strategies share once)."""
    options = [o for _, o in BUILT_IN.values()] + [c.traits.options for c in REGISTERED.values()]
    return {o.section: o for o in options if o is not None}


def register(cls: type) -> type:
    """Add a strategy class (usable as a decorator); its name must be new, its options section
    new or the very dataclass another strategy already reads there."""
    name, options = cls.name, cls.traits.options
    if name in names() and REGISTERED.get(name) is not cls:
        raise ValueError(f"a strategy named {name!r} is registered already ({strategy_class(name).__qualname__})")
    if options is not None and option_sections().get(options.section, options) is not options:
        raise ValueError(f"[{options.section}] holds another strategy's options; give {name} its own section")
    REGISTERED[name] = cls
    return cls


def strategy_class(name: str) -> type:
    if name in REGISTERED:
        return REGISTERED[name]
    if name not in BUILT_IN:
        raise UserError(f"unknown data-parallel strategy {name!r}; registered: {', '.join(names())}")
    module, _, cls = BUILT_IN[name][0].partition(":")
    return getattr(importlib.import_module(module), cls)


def strategies() -> dict[str, type]:
    """Every registered strategy's class by name (imports them all)."""
    return {name: strategy_class(name) for name in names()}


def able(test) -> str:
    """The registered strategies whose traits pass `test`, quoted."""
    return ", ".join(f"'{name}'" for name, cls in strategies().items() if test(cls.traits))


# docs/parallelism.md's trait table, generated from the classes (tests/test_docs.py checks the page) ---------

TRAITS_BEGIN, TRAITS_END = "<!-- traits:begin -->", "<!-- traits:end -->"


def traits_table(traits: list | None = None) -> str:
    """A markdown table of strategies' `Traits`: the built-in ones' unless given others."""
    if traits is None:
        traits = [strategy_class(name).traits for name in BUILT_IN]
    yes = {True: "yes", False: "no"}
    columns = {
        "communication": lambda t: f"`{t.communication}`",
        "overlapped": lambda t: yes[t.overlapped],
        "periods per update": lambda t: str(t.periods_per_update),
        "tp / pp": lambda t: yes[t.model_parallel],
        "shards θ": lambda t: yes[t.shards_theta],
        "`balance_batches`": lambda t: yes[t.balances],
        "inside DiLoCo replicas": lambda t: yes[not t.why_not_in_replicas],
        "resume on another dp size": lambda t: yes[not t.resume_needs_same_ranks],
        "forward/backward": lambda t: "fp32 weights, autocast" if t.autocast_compute else "compute dtype",
        "update of": lambda t: f"`{t.update_of}`" if t.update_of else "its own",
        "options": lambda t: f"`[{t.options.section}]`" if t.options else "—",
    }
    lines = ["| `data_parallel` | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for t in traits:
        cells = [f"`{t.name}`" + (" (default)" if t.name == default_name() else "")]
        lines.append("| " + " | ".join(cells + [cell(t) for cell in columns.values()]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    """`torchacco traits`: the table to put between the markers."""
    print(f"{TRAITS_BEGIN}\n{traits_table()}{TRAITS_END}")
    return 0
