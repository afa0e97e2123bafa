"""The leaf every config section is declared with (imports nothing of torchacco but its errors).

`key()` declares one key: its default and the line of help the configuration reference shows. `Options` is the base of a
strategy's own section: `section` names its TOML table (`[acco]`); `Config.strategy_options` holds one of each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal


def key(default, help: str, choices=None):
    """A config key. `choices`, a function returning the accepted values, is for a set known only at run time (the
    registered strategies); `default` may then be such a function too."""
    metadata = {"help": help, "choices": choices}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class Options:
    """A strategy's options, read from the TOML table `section` (strategies that share options name one class)."""

    section: ClassVar[str]


@dataclass
class OverlappedOptions(Options):
    """The overlapped schedules (acco, dpu and wp): their [acco] section."""

    section: ClassVar[str] = "acco"  # the paper's name for the family; dpu and wp read it too

    mode: Literal["deterministic", "adaptive", "balanced"] = key(
        "deterministic",
        "deterministic: a fixed number of micro-batches per period, then wait for the job; adaptive: keep "
        "accumulating until the job is done (the batch grows); balanced: the global batch stays fixed and is "
        "split between the ranks by their measured speed",
    )
    accumulator_dtype: Literal["fp32", "bf16"] = key("fp32", "gradient accumulator dtype (bf16 is the paper's)")
    max_growth: float = key(2.0, "adaptive: a rank runs at most this multiple of its period's micro-batches; 0: no cap")
    lr_batch_scaling: float = key(
        0.5,
        "adaptive: the lr is scaled by (update's tokens / nominal tokens)^this; 0.5: Adam's square-root rule; 0: off",
    )
    estimate_comm: Literal["full", "bf16"] = key(
        "full",
        "acco: with an fp32 compute dtype, the estimate round's gradients and parameters travel in bf16 "
        "(half the bytes; the estimate is approximate by nature)",
    )
    dpu_warmup_steps: int = key(0, "dpu: synchronous updates before the one-step delay starts")
    drift_every: int = key(10, "acco: log ‖θ̃ − θ‖ / ‖θ‖ every this many commits; 0 disables")
    # Variants of the estimate θ̃ = Opt(θ, g̃), a step with half the update's batch (docs/acco.md, "The estimate").
    estimate_clip: Literal["own", "commit"] = key(
        "own",
        "acco: the gradient norm that decides the estimate's clipping: 'own' (the half batch's, the paper) or "
        "'commit' (the last commit's, so the estimate is clipped as its commit will likely be)",
    )
    estimate_share: float = key(
        0.5, "acco, deterministic: share of each update's micro-batches computed at θ̃ (the rest at θ); 0.5: the paper's"
    )


@dataclass
class HSDPOptions(Options):
    section: ClassVar[str] = "hsdp"
    shard_degree: int = key(
        0,
        "hsdp: the data-parallel ranks each parameter is sharded over, one node's (the rest replicate it); 0: the "
        "ranks a node has per tensor- and pipeline-parallel group, LOCAL_WORLD_SIZE / (tp × pp)",
    )
