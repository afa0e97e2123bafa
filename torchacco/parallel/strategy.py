"""The interface the training loop drives, and what each data-parallel strategy declares.

A strategy turns this rank's sum-of-token-loss gradients into updates normalised by the all-reduced token count:
`micro_batches()` yields one context per micro-batch of a compute period (DDP and FSDP skip gradient sync on all
but the last; adaptive ACCO decides as it goes how many to run); `step(counts)` ends the period and returns the
`UpdateResult` of the update completed now, or None (a round that commits nothing); `evaluation()` gives the
module holding θ; `state_dict()` / `load_state_dict()` (DCP `Stateful`) resume exactly between two updates.
What the rest of torchacco needs to know about a strategy is declared by its class (`Traits`, the classmethods),
so no caller asks for a strategy by name."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, field, fields
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

import torch

from torchacco.device import Stopwatch
from torchacco.errors import UserError
from torchacco.lr import TokenSchedule
from torchacco.options import Options

if TYPE_CHECKING:
    from torchacco.config import LRSchedule, Optimizer, Training


@dataclass
class Counts:
    """What one rank contributed to an update (or one period of it). The loss fields may be device tensors and the
    compute time stopwatches, so ending a period never waits for the GPU; `as_tensor()` reads them later."""

    loss_tokens: float = 0.0  # tokens in the loss: the normaliser
    loss_sum: float = 0.0  # sum of their token losses
    micro_batches: int = 0
    consumed: float = 0.0  # input tokens processed, in the loss or not: the LR schedule's clock
    compute: tuple[Stopwatch, ...] = ()  # the time of each period's forward and backward

    FIELDS: ClassVar[int] = 5  # as_tensor()'s length

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_tensor(self, device) -> torch.Tensor:
        """(loss tokens, loss sum, micro-batches, consumed, compute seconds) as float64 on `device`."""
        seconds = sum(watch.seconds() for watch in self.compute)
        values = [self.loss_tokens, self.loss_sum, self.micro_batches, self.consumed, seconds]
        # float64 from the start: through torch.tensor's default float32 a restored loss sum would lose its low bits.
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

    @classmethod
    def from_config(
        cls, t: Training, optimizer: Optimizer, lr_schedule: LRSchedule, dp_size, param_dtype=torch.float32, replicas=1
    ) -> UpdatePlan:
        """The plan of a run over `dp_size` data-parallel ranks per replica; with several replicas, one replica's: its
        share of the global batch, its schedule over its tokens. One line for a global batch the ranks cannot split."""
        per_step = t.local_batch_size * dp_size * replicas
        if t.global_batch_size % per_step:
            ranks = f"data-parallel ranks = {t.local_batch_size} × {dp_size}"
            if replicas > 1:
                ranks = f"data-parallel ranks × replicas = {t.local_batch_size} × {dp_size} × {replicas}"
            raise UserError(f"[training] global_batch_size = {t.global_batch_size} is not divisible by "
                            f"local_batch_size × {ranks} = {per_step}; use a multiple of {per_step}")  # fmt: skip
        global_batch = t.global_batch_size or per_step
        tokens_per_step = global_batch * t.seq_len / replicas
        schedule = TokenSchedule(
            peak_lr=optimizer.lr,
            warmup_tokens=lr_schedule.warmup_steps * tokens_per_step,
            total_tokens=(t.max_tokens / replicas if t.max_tokens else t.steps * tokens_per_step),
            decay=lr_schedule.decay,
            min_lr_ratio=lr_schedule.min_lr_ratio,
        )
        return cls(global_batch // per_step, schedule, t.max_norm, param_dtype, tokens_per_step)


@dataclass(frozen=True)
class Traits:
    """What the rest of torchacco needs to know about a strategy class, before anything is built."""

    name: str
    # Where its communication sits, for the cost model and the logs:
    #   all_reduce_in_backward: bucketed all-reduce hidden under the last micro-batch's backward (DDP)
    #   per_micro_batch: parameter all-gathers and gradient reduce-scatters inside forward/backward (FSDP)
    #   sharded_job: reduce-scatter, sharded AdamW, all-gather after the period (ZeRO-1 and the overlapped)
    communication: Literal["all_reduce_in_backward", "per_micro_batch", "sharded_job"]
    sync_phase: str  # what the loop waits for after a period (heartbeat, diagnoses)
    overlapped: bool = False  # the sharded job runs beside the next compute period
    estimates: bool = False  # some rounds run an ESTIMATE job (ACCO's θ̃)
    periods_per_update: int = 1  # compute periods (and jobs) per committed update
    model_parallel: bool = True  # composes with tensor and pipeline parallelism
    balances: bool = True  # runs [parallelism] balance_batches (ranks may run unequal micro-batches)
    why_not_in_replicas: str = ""  # why DiLoCo's replicas cannot run it inside ("": its theta.named_tensors() are θ)
    resume_needs_same_ranks: bool = False  # its checkpoints hold per-rank state
    autocast_compute: bool = False  # fp32 weights, forward/backward autocast to the compute dtype
    shards_theta: bool = False  # theta.named_tensors() are this rank's shard of θ (not all of it)
    shards_within_node: bool = False  # HSDP: per_micro_batch in a node, one all-reduce per shard across nodes
    options: type[Options] | None = None  # its own config section (`cfg.strategy_options[options.section]`)
    # The strategy whose update this one computes in another floating-point order: its loss per token is that
    # one's, so the cost model reads that one's measured token efficiency (None: its own, or none measured).
    update_of: str | None = None


class Strategy(abc.ABC):
    traits: ClassVar[Traits]
    name: ClassVar[str]  # traits.name, what `[parallelism] data_parallel` calls it

    model: torch.nn.Module
    theta: Theta  # θ between updates (for DiLoCo's outer step and the export)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "traits" in cls.__dict__:
            cls.name = cls.traits.name

    @classmethod
    def check_config(cls, dp_size, model_parallel: str, *, options, training, optimizer, lr_schedule) -> str | None:
        """Why this strategy cannot run the config's sections (`options`: its own, None without one) in one line, or
        None; `model_parallel` names the tp/pp degrees in use ('' when none). Validation checks the traits first."""
        return None

    @classmethod
    def memory(cls, numel: float, dp_size: int, param_dtype: torch.dtype, reduce_dtype, options=None) -> MemoryParts:
        """The bytes a rank keeps from its first update on, by part, for `numel` parameter elements stored on it over
        `dp_size` data-parallel ranks (`options`: its options section, None: the defaults); the cost model's figure."""
        raise NotImplementedError(f"{cls.name} does not count its memory (Strategy.memory)")

    @classmethod
    def gathered_memory(
        cls, parallelism, block_numel: float, root_numel: float, blocks: int, param_dtype, group: int = 1
    ) -> float:
        """Bytes a rank allocates only while computing, beside the activations, for blocks of `block_numel`
        stored elements each and `root_numel` outside them, its state divided over `group` ranks ([parallelism] read
        from `parallelism`): none."""
        return 0.0

    @classmethod
    def accumulation_memory(cls, parallelism, numel: float, micro_batches: int) -> float:
        """The gradient bytes a rank holds between the micro-batches of an update, for `numel` stored elements, where
        more than `memory`'s gradients (FSDP's unsharded accumulator): none."""
        return 0.0

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        """The key of the strategy's state in a checkpoint: one per part of the model a rank's state covers."""
        return "dp"

    @classmethod
    def from_config(cls, model: torch.nn.Module, dims, plan: UpdatePlan, device, *, parallelism, optimizer, options):
        """The strategy over `model` (this rank's part of it, after tensor/pipeline parallelism) from the sections it
        reads, named by keyword: [parallelism], [optimizer], `options` (its own, None without one); `**_` the rest."""
        raise NotImplementedError(f"{cls.name} is not built from a config")

    @classmethod
    def build(cls, model, dims, plan: UpdatePlan, device, init: Callable[[], None] | None, **sections) -> Strategy:
        """`from_config` of the config's `sections`, after `init` allocates a model built on meta (None: allocated)."""
        if init is not None:
            init()
        return cls.from_config(model, dims, plan, device, **sections)

    @abc.abstractmethod
    def micro_batches(self) -> Iterator[contextlib.AbstractContextManager]: ...

    @abc.abstractmethod
    def step(self, counts: Counts) -> UpdateResult | None: ...

    def start(self, run_state, load_run_state) -> UpdateResult | None:
        """Before the first update: `run_state()` is the whole run's state (the loop's counts, the strategy's, the data
        position) and `load_run_state(state)` writes one in. A strategy that joins a running run from a peer's state
        returns the update it joined at (the loop counts it); the others None."""
        return None

    @contextlib.contextmanager
    def evaluation(self):
        yield self.model

    def close(self) -> None:  # noqa: B027 (most strategies hold nothing to drain)
        """Drain anything in flight (an overlapped schedule's job) and stop its helpers."""

    @abc.abstractmethod
    def state_dict(self) -> dict: ...

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None: ...


class Theta(Protocol):
    """Where a strategy keeps the committed parameters θ between updates (`Strategy.theta`): what
    DiLoCo's outer step (docs/diloco.md) and the export read and write."""

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The fp32 tensors this rank keeps θ in (its shard, for a sharded strategy), by parameter
        name in the model's order. Writing them sets θ; `refresh_copies()` then refreshes what derives from it."""

    def refresh_copies(self) -> None:
        """The pieces were written: refresh the compute parameters that are copies of them."""

    def weights_state_dict(self) -> dict:
        """The part of the strategy's `state_dict()` that holds θ (what an export loads)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """θ as full fp32 tensors by parameter name (a collective)."""
