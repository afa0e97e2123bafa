"""The interface the training loop drives, and what each data-parallel strategy declares.

A strategy turns this rank's sum-of-token-loss gradients into updates normalised by the
all-reduced token count:

- `micro_batches()` yields one context per micro-batch of a compute period (DDP and FSDP
  skip gradient sync on all but the last; adaptive ACCO decides as it goes how many to run);
- `step(counts)` ends the period and returns the `UpdateResult` of the update completed now,
  or None (an overlapped schedule's round that commits nothing);
- `evaluation()` gives the module holding the committed parameters θ; `close()` drains;
- `state_dict()` / `load_state_dict()` (DCP `Stateful`) hold everything needed to resume
  exactly between two updates; `weights_state_dict()` is the part that holds θ, and
  `full_state_dict()` gathers θ as full fp32 tensors by parameter name (for export).

What the rest of torchacco needs to know about a strategy — whether its communication runs
beside compute, whether it composes with tensor/pipeline parallelism, how many compute periods
an update spans, how its checkpoint is keyed and resumed, what it asks of the config — is
declared here, by the class, so no caller asks for a strategy by name.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import astuple, dataclass, field
from typing import ClassVar, Literal

import torch

from torchacco.device import Stopwatch
from torchacco.errors import UserError
from torchacco.lr import TokenSchedule


@dataclass
class Counts:
    """What one rank contributed to an update (or one period of it). The loss fields may be
    tensors on the compute device and the compute time stopwatches, so ending a period never
    waits for the GPU; `as_tensor()` reads them where a wait costs nothing."""

    loss_tokens: float = 0.0  # tokens in the loss: the normaliser
    loss_sum: float = 0.0  # sum of their token losses
    micro_batches: int = 0
    consumed: float = 0.0  # input tokens processed, in the loss or not: the LR schedule's clock
    compute: tuple[Stopwatch, ...] = ()  # the time of each period's forward and backward

    FIELDS: ClassVar[int] = 5  # as_tensor()'s length

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            self.loss_tokens + other.loss_tokens,
            self.loss_sum + other.loss_sum,
            self.micro_batches + other.micro_batches,
            self.consumed + other.consumed,
            self.compute + other.compute,
        )

    def as_tensor(self, device) -> torch.Tensor:
        """(loss tokens, loss sum, micro-batches, consumed, compute seconds) as float64 on `device`."""
        seconds = sum(watch.seconds() for watch in self.compute)
        values = [self.loss_tokens, self.loss_sum, self.micro_batches, self.consumed, seconds]
        # float64 from the start: a Python float (counts restored from a checkpoint) through
        # torch.tensor's default float32 would lose the low bits of a float64 loss sum.
        values = [v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64) for v in values]
        return torch.stack([v.to(device=device, dtype=torch.float64) for v in values])


@dataclass
class UpdateResult:
    tokens: float  # global count of the tokens in the loss behind the update (its normaliser)
    loss: float  # global mean token loss of the gradients behind it
    grad_norm: float  # before clipping
    lr: float
    committed: bool
    micro_batches: list[int] = field(default_factory=list)  # per rank
    compute_s: list[float] = field(default_factory=list)  # per rank: forward/backward seconds behind it
    consumed: float = 0.0  # global input tokens processed, in the loss or not: the LR schedule's clock
    seconds: float = 0.0  # wall time of the job
    exposed_s: float = 0.0  # time the compute side waited for jobs since the previous commit
    jobs_s: float = 0.0  # time those jobs took (ACCO: the estimate's and the commit's)
    drift: float | None = None  # ‖θ̃ − θ‖ / ‖θ‖ (ACCO, every few commits)
    skipped: bool = False  # a non-finite loss or gradient: θ (and the optimizer state) left as it was
    nonfinite_ranks: list[int] = field(default_factory=list)  # ranks whose own loss was non-finite
    outer: dict = field(default_factory=dict)  # an outer step's metrics, after the update it followed (DiLoCo)
    advice: str | None = None  # one line for the user, from what the run measured (logged once)


@dataclass(frozen=True)
class MemoryParts:
    """Bytes one rank keeps between updates, by part (`Strategy.memory`)."""

    weights: float = 0.0  # the parameters forward and backward read
    gradients: float = 0.0  # where backward accumulates
    master: float = 0.0  # an fp32 copy of θ beside the weights (a sharded optimizer's)
    optimizer: float = 0.0  # AdamW's moments
    buffers: float = 0.0  # the strategy's own: an overlapped job's buffer, DiLoCo's outer state

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer + self.buffers

    def __add__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class UpdatePlan:
    """How gradients become an update, whatever the strategy."""

    micro_batches: int  # per rank and update
    schedule: TokenSchedule
    max_norm: float  # 0: no clipping
    param_dtype: torch.dtype  # the compute dtype
    tokens_per_update: float = 0.0  # the recipe's: global batch × seq_len


class Strategy(abc.ABC):
    name: ClassVar[str]
    # Where its communication sits, for the cost model and the logs:
    #   all_reduce_in_backward: bucketed all-reduce hidden under the last micro-batch's backward (DDP)
    #   per_micro_batch: parameter all-gathers and gradient reduce-scatters inside forward/backward (FSDP)
    #   sharded_job: reduce-scatter, sharded AdamW, all-gather after the period (ZeRO-1 and the overlapped)
    communication: ClassVar[Literal["all_reduce_in_backward", "per_micro_batch", "sharded_job"]]
    overlapped: ClassVar[bool] = False  # the sharded job runs beside the next compute period
    periods_per_update: ClassVar[int] = 1  # compute periods (and jobs) per committed update
    supports_model_parallel: ClassVar[bool] = True  # composes with tensor and pipeline parallelism
    flat_buffers: ClassVar[bool] = False  # parameters as views of one flat buffer per (pp, tp) coordinate
    resume_needs_same_ranks: ClassVar[bool] = False  # its checkpoints hold per-rank state
    autocast_compute: ClassVar[bool] = False  # fp32 weights, forward/backward autocast to the compute dtype
    sync_phase: ClassVar[str]  # what the loop waits for after a period (heartbeat, diagnoses)
    default: ClassVar[bool] = False  # the strategy `[parallelism] data_parallel` names by default
    # DiLoCo's replicas (docs/diloco.md) can run it inside: between updates its `theta_pieces()` are θ.
    supports_replicas: ClassVar[bool] = True
    replicas_refused_because: ClassVar[str] = "its parameters between updates are not θ"  # (when it does not)
    balances: ClassVar[bool] = True  # runs [parallelism] balance_batches (ranks may run unequal micro-batches)
    shards_theta: ClassVar[bool] = False  # theta_pieces() are this rank's shard of θ (not all of it)
    # Its constructor shards the module's parameters (FSDP2) and then calls materialize(model): a
    # model built on meta reaches it unallocated (torchacco/materialize.py); others get it allocated.
    shards_module: ClassVar[bool] = False
    # per_micro_batch inside a node only, and one all-reduce of each shard across nodes per update (HSDP)
    shards_within_node: ClassVar[bool] = False
    # Its options: a dataclass of `config.key`s, read as the TOML section `options_section` (two
    # strategies that truly share options name the same dataclass and section).
    options: ClassVar[type | None] = None
    options_section: ClassVar[str | None] = None
    # The strategy whose update this one computes in another floating-point order: its loss per token is that
    # one's, so the cost model reads that one's measured token efficiency (None: its own, or none measured).
    update_of: ClassVar[str | None] = None
    # The variants benchmarks run: a label -> its extra `--section.key VALUE` arguments and the cost
    # model's mode for it. The strategy's own name, with no arguments, is the plain variant.
    variants: ClassVar[dict[str, tuple[tuple[str, ...], str]]] = {}

    model: torch.nn.Module

    # What the class says about a run, before anything is built ------------------------------

    @classmethod
    def check_config(cls, cfg, dp_size: int, model_parallel: str) -> None:
        """Raise a UserError for a config this strategy cannot run; `model_parallel` names the
        tp/pp degrees in use ('' when none)."""
        if model_parallel and not cls.supports_model_parallel:
            from torchacco.parallel.registry import STRATEGIES

            able = ", ".join(f"'{name}'" for name, other in STRATEGIES.items() if other.supports_model_parallel)
            raise UserError(f"data_parallel = '{cls.name}' with {model_parallel} is not supported; use one of {able}")
        if cfg.parallelism.balance_batches and not cls.balances:
            from torchacco.parallel.registry import STRATEGIES

            able = ", ".join(f"'{name}'" for name, other in STRATEGIES.items() if other.balances)
            raise UserError(
                f"[parallelism] balance_batches = true with data_parallel = '{cls.name}': its ranks must run the "
                f"same micro-batches (collectives inside forward and backward); use one of {able}, or "
                "balance_batches = false"
            )
        if cfg.parallelism.balance_batches and model_parallel:
            raise UserError(
                f"[parallelism] balance_batches = true with {model_parallel} is not supported: tensor- and "
                "pipeline-parallel peers must run the same micro-batches; set balance_batches = false"
            )

    @classmethod
    def benchmark_variants(cls) -> dict[str, tuple[tuple[str, ...], str]]:
        """label -> (extra CLI arguments, cost-model mode), the plain strategy first."""
        return {cls.name: ((), "deterministic"), **cls.variants}

    @classmethod
    def memory(
        cls, numel: float, dp_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype, options=None
    ) -> MemoryParts:
        """The bytes a rank keeps from its first update on, by part, for `numel` parameter elements stored on
        it (its tensor/pipeline-parallel part of the model) over `dp_size` data-parallel ranks; `options` is
        the strategy's options section (its defaults when None). The cost model's and the dry run's figure."""
        raise NotImplementedError(f"{cls.name} does not count its memory (Strategy.memory)")

    @classmethod
    def gathered_memory(cls, parallelism, block_numel: float, root_numel: float, blocks: int, param_dtype) -> float:
        """Bytes a rank allocates only while computing, beside the activations, for blocks of `block_numel`
        stored elements each and `root_numel` outside them ([parallelism] read from `parallelism`): none."""
        return 0.0

    @classmethod
    def memory_group(cls, options, dp_size: int, local_world_size: int, tp: int, pp: int) -> int:
        """The data-parallel ranks a rank's state is divided over (`memory`'s dp_size): all of them."""
        return dp_size

    @classmethod
    def autocast_dtype(cls, param_dtype: torch.dtype) -> torch.dtype | None:
        return param_dtype if cls.autocast_compute and param_dtype != torch.float32 else None

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        """The key of the strategy's state in a checkpoint: one per part of the model that a rank's
        state covers. Without tp/pp the whole model is one part."""
        return "dp"

    @classmethod
    @abc.abstractmethod
    def from_config(cls, model: torch.nn.Module, cfg, dims, plan: UpdatePlan, device) -> Strategy:
        """The strategy over `model` (this rank's part of it, after tensor/pipeline parallelism)."""

    # The loop's interface -------------------------------------------------------------------

    @abc.abstractmethod
    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager]: ...

    @abc.abstractmethod
    def step(self, counts: Counts) -> UpdateResult | None: ...

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model

    def close(self) -> None:  # noqa: B027 (most strategies hold nothing to drain)
        """Drain anything in flight (an overlapped schedule's job) and stop its helpers."""

    # State ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def state_dict(self) -> dict: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def weights_state_dict(self) -> dict:
        """The part of `state_dict()` that holds θ (what an export loads)."""
        return self.state_dict()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """θ as full fp32 tensors by parameter name (a collective)."""
        raise NotImplementedError(f"{self.name} does not export its parameters")

    def master_shard(self) -> torch.Tensor | None:
        """This rank's fp32 slice of θ where the strategy shards it (padding included), else None."""
        return None

    def ranks_meet(self) -> bool:
        """After the update just returned, has every rank of the run been through a collective with
        every other (so a world-wide agreement costs no one any waiting)? Data parallelism meets at
        every update; DiLoCo's replicas only at outer steps."""
        return True

    # The outer step's access to θ (docs/diloco.md) -----------------------------------------------

    def theta_pieces(self) -> list[tuple[str, torch.Tensor]]:
        """Between two updates: the fp32 tensors this rank keeps θ in (its shard, for a sharded
        strategy), by parameter name in the model's order. Writing them sets θ; `theta_written()`
        then refreshes what derives from it."""
        raise NotImplementedError(f"{self.name} does not expose θ to an outer step")

    def theta_written(self) -> None:  # noqa: B027 (θ is the compute parameters themselves in most)
        """The pieces of θ were written: refresh the compute parameters that are copies of them."""
