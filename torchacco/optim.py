"""AdamW: torch's, for replicated and FSDP parameters, and a sharded one over flat buffers; and Muon on the hidden
matrices with AdamW on the rest (`[optimizer] name = "muon"`, docs/optimizers.md; the flat-shard Muon is in
parallel/muon.py).

`ShardedAdamW` owns one rank's fp32 slice of the flattened parameters and its moments; `step()` commits an
update, `peek()` returns the parameters it would give without touching any state (ACCO's estimate).

With `[optimizer] slow_beta`, both keep a second, slow first moment s (MT-DAO, arXiv 2510.05361) and step along
(1 − ω)·m̂ + ω·ŝ, both bias-corrected: a direction that remembers more than β1's few updates, which is what the
replicas of local-update schedules lose between syncs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _adjust_lr, _zeropower_via_newtonschulz

from torchacco.blocks import block_list, unwrap

if TYPE_CHECKING:
    from torchacco.config import Optimizer as OptimizerConfig


def no_weight_decay_ids(model: nn.Module) -> set[int]:
    """Norms, biases (ndim < 2) and embeddings (incl. a tied output head) get no decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return embeddings | {id(p) for p in model.parameters() if p.ndim < 2}


def hidden_matrix_ids(model: nn.Module) -> set[int]:
    """Muon's parameters: the 2-D weights inside the model's blocks (`blocks.block_list`). Embeddings, the output
    head (tied or not), the final norm lie outside the blocks; norms and biases inside them are not matrices."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    blocks = block_list(unwrap(model))
    return {id(p) for b in blocks for p in b.parameters() if p.ndim == 2 and id(p) not in embeddings}


def optimizer_state_share(cfg: OptimizerConfig, model: nn.Module) -> float:
    """The optimizer's fp32 state per parameter against AdamW's two moments: 1.5 with the slow moment; with Muon,
    one buffer instead of two on the hidden matrices."""
    if cfg.name == "muon":
        hidden = hidden_matrix_ids(model)
        params = [p for p in model.parameters() if p.requires_grad]
        return 1 - sum(p.numel() for p in params if id(p) in hidden) / sum(p.numel() for p in params) / 2
    return 1.5 if cfg.slow_beta else 1.0


def muon_workload(cfg: OptimizerConfig, model: nn.Module) -> dict[str, float]:
    """The cost model's Muon fields (`cost_model.Workload`): the hidden matrices' elements, one step's Newton–Schulz
    FLOPs over them, ns_steps × (4m²n + 2m³) for an m × n matrix, m ≤ n, and the largest's elements; none with
    AdamW."""
    if cfg.name != "muon":
        return {}
    hidden = hidden_matrix_ids(model)
    shapes = [sorted(p.shape) for p in model.parameters() if id(p) in hidden]
    flops = sum(cfg.ns_steps * (4 * m * m * n + 2 * m**3) for m, n in shapes)
    sizes = [m * n for m, n in shapes]
    return {"muon_params": float(sum(sizes)), "muon_flops": float(flops), "muon_largest": float(max(sizes))}


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The replicated and FSDP strategies' optimizer: AdamW, or with `name = "muon"` Muon on the hidden matrices
    and AdamW on the rest, as one optimizer."""
    if cfg.name != "muon":
        return build_adamw(model, cfg)
    hidden = hidden_matrix_ids(model)
    params = [p for p in model.parameters() if p.requires_grad]
    matrices, rest = [p for p in params if id(p) in hidden], [p for p in params if id(p) not in hidden]
    muon = GatheringMuon(
        matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum, ns_steps=cfg.ns_steps,
        adjust_lr_fn="match_rms_adamw",  # the lr and weight decay tuned for AdamW carry over
    ) if matrices else None  # fmt: skip
    adamw = build_adamw(model, cfg, rest) if rest else None
    return MuonWithAdamW([o for o in (muon, adamw) if o is not None])


def build_adamw(model: nn.Module, cfg: OptimizerConfig, params: list | None = None) -> torch.optim.Optimizer:
    """torch's AdamW over `params` (default: the trainable ones), or `SlowMomentumAdamW` with `slow_beta`."""
    skip = no_weight_decay_ids(model)
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    groups = [
        {"params": [p for p in params if id(p) not in skip], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if id(p) in skip], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.slow_beta:
        return SlowMomentumAdamW(groups, cfg)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def adamw_update(p, m, v, grad, lr: float, step: int, cfg: OptimizerConfig, slow=None, decay: float = 0.0) -> None:
    """One AdamW step in place, elementwise (so any slice of a tensor steps as the whole would);
    with `slow`, the slow moment is mixed into the direction. `decay` is the weight decay of `p`."""
    if decay:
        p.mul_(1 - lr * decay)
    m.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
    v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
    bias1 = 1 - cfg.beta1**step
    denom = v.sqrt().div_(math.sqrt(1 - cfg.beta2**step)).add_(cfg.eps)
    if slow is None:
        p.addcdiv_(m, denom, value=-lr / bias1)
        return
    w = cfg.slow_weight
    slow.mul_(cfg.slow_beta).add_(grad, alpha=1 - cfg.slow_beta)
    direction = m.mul((1 - w) / bias1).add_(slow, alpha=w / (1 - cfg.slow_beta**step))
    p.addcdiv_(direction, denom, value=-lr)


class SlowMomentumAdamW(torch.optim.Optimizer):
    """AdamW with the slow first moment, for replicated and FSDP parameters (DTensors included):
    `adamw_update` per parameter, so ZeRO-1's sharded steps equal DDP's."""

    def __init__(self, groups: list[dict], cfg: OptimizerConfig):
        super().__init__(groups, {"lr": cfg.lr, "weight_decay": cfg.weight_decay})
        self.cfg = cfg

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    for name in ("exp_avg", "exp_avg_sq", "exp_avg_slow"):
                        state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                adamw_update(
                    p, state["exp_avg"], state["exp_avg_sq"], p.grad, group["lr"], int(state["step"].item()),
                    self.cfg, slow=state["exp_avg_slow"], decay=group["weight_decay"],
                )  # fmt: skip


class GatheringMuon(torch.optim.Muon):
    """torch's Muon, where a DTensor matrix (FSDP's row shard, a tensor-parallel shard) is orthogonalised whole: its
    Nesterov update gathered on every rank, Newton–Schulz run on the full matrix, each rank keeping its shard of the
    result. Plain tensors (DDP) step with torch's own `step`."""

    @torch.no_grad()
    def step(self, closure=None):
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    _muon_step_gathered(p, p.grad, state["momentum_buffer"], group)


def _muon_step_gathered(p, grad, buf, group: dict) -> None:
    """torch's `_single_tensor_muon` for one parameter, with the update gathered for Newton–Schulz."""
    lr, momentum = group["lr"], group["momentum"]
    buf.lerp_(grad, 1 - momentum)
    update = grad.lerp(buf, momentum) if group["nesterov"] else buf
    whole = update.bfloat16().full_tensor() if isinstance(update, DTensor) else update  # Newton–Schulz reads bf16
    ortho = orthogonalise(whole, group["ns_steps"], group["ns_coefficients"], group["eps"])
    if isinstance(p, DTensor):  # this rank's shard of the result, as p is laid out (no communication)
        ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
    p.mul_(1 - lr * group["weight_decay"])
    p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))


def orthogonalise(update: torch.Tensor, ns_steps: int, coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), eps=EPS):
    """torch's Newton–Schulz iteration (in bf16) on a whole matrix, with torch's Muon's defaults."""
    return _zeropower_via_newtonschulz(update, coefficients, ns_steps, eps)


class MuonWithAdamW(torch.optim.Optimizer):
    """Optimizers over disjoint parameters as one: one `param_groups` list (the loop sets each group's lr) and one
    state, which DCP saves and loads whole; `step` steps each."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts
        super().__init__([g for o in parts for g in o.param_groups], {})
        self._share()

    def _share(self) -> None:
        groups = iter(self.param_groups)
        for o in self.parts:
            o.param_groups = [next(groups) for _ in o.param_groups]
            o.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        for o in self.parts:
            o.step()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: hand them to the parts
        self._share()


@dataclass
class AdamWState:
    master: torch.Tensor  # fp32 parameters of this rank's shard
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int = 0
    exp_avg_slow: torch.Tensor | None = None  # with [optimizer] slow_beta


class ShardedAdamW:
    """AdamW over a 1-D fp32 shard; decoupled weight decay on the `decay_ranges` only.

    The gradient (any dtype) is scaled (1 / token count, clipping) as it is read, a chunk at a time, and `out`
    (any dtype) may be the gradient's own buffer, since each chunk is read before it is written: an update's
    working memory is a few chunks, not fp32 copies of the shard, beside the next micro-batch's activations.
    """

    def __init__(self, master: torch.Tensor, decay_ranges: list[tuple[int, int]], cfg: OptimizerConfig):
        assert master.dtype == torch.float32 and master.ndim == 1
        slow = torch.zeros_like(master) if cfg.slow_beta else None
        self.state = AdamWState(master, torch.zeros_like(master), torch.zeros_like(master), exp_avg_slow=slow)
        self.decay_ranges, self.cfg = decay_ranges, cfg

    def step(self, grad, lr: float, scale: float = 1.0, out=None, predict: bool = False, chunk=None) -> torch.Tensor:
        """Commit one step with the gradient `grad * scale`: master, m, v and step advance. `out` receives the
        new master shard, or with `predict` the shard one more step with the same gradient would give (weight
        prediction). Returns the master shard."""
        s = self.state
        s.step += 1
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            p = self._update(self._slices(part), g, lr, s.step, offset)
            if predict:
                p = self._update(self._slices(part, clone=True), g, lr, s.step + 1, offset)
            if out is not None:
                out[part].copy_(p)
        return s.master

    def peek(self, grad, lr: float, scale=1.0, out=None, chunk=None) -> torch.Tensor:
        """The master shard after `step(grad, lr, scale)`, written into `out` (a new fp32 tensor by default),
        leaving m, v, step and master untouched (ACCO's estimate)."""
        s = self.state
        out = torch.empty_like(s.master) if out is None else out
        for part, offset in self._chunks(chunk):
            g = self._scaled(grad[part], scale)
            out[part].copy_(self._update(self._slices(part, clone=True), g, lr, s.step + 1, offset))
        return out

    def shards(self) -> dict[str, torch.Tensor]:
        """The shard-sized state a checkpoint holds, by name (DCP loads into these tensors)."""
        s = self.state
        names = ("master", "exp_avg", "exp_avg_sq", "exp_avg_slow")
        return {name: getattr(s, name) for name in names if getattr(s, name) is not None}

    def loaded(self, step: int) -> None:
        """After DCP wrote `shards()` in place."""
        self.state.step = step

    def _chunks(self, chunk: int | None):
        """(slice, offset) over the shard; by default a 32nd of it, between 64 Ki and 4 Mi elements: bounded
        working memory without thousands of tiny kernels."""
        n = self.state.master.numel()
        chunk = chunk or min(max(-(-n // 32), 1 << 16), 1 << 22)
        for start in range(0, n, chunk):
            yield slice(start, start + chunk), start

    @staticmethod
    def _scaled(grad: torch.Tensor, scale: float) -> torch.Tensor:
        g = grad.to(torch.float32, copy=True)  # a copy: `out` may overwrite grad's buffer
        return g.mul_(scale) if scale != 1.0 else g

    def _slices(self, part: slice, clone: bool = False) -> tuple:
        """(master, m, v, slow moment or None) over `part`: views of the state, or copies."""
        s = self.state
        slow = None if s.exp_avg_slow is None else s.exp_avg_slow[part]
        views = (s.master[part], s.exp_avg[part], s.exp_avg_sq[part], slow)
        return tuple(None if t is None else t.clone() for t in views) if clone else views

    def _update(self, slices: tuple, grad, lr, step, offset: int) -> torch.Tensor:
        """One AdamW step on (p, m, v, slow), a slice of the shard that starts at `offset`; returns p."""
        p, m, v, slow = slices
        if self.cfg.weight_decay:
            for start, end in self.decay_ranges:
                lo, hi = max(start - offset, 0), min(end - offset, p.numel())
                if lo < hi:
                    p[lo:hi].mul_(1 - lr * self.cfg.weight_decay)
        adamw_update(p, m, v, grad, lr, step, self.cfg, slow)
        return p
