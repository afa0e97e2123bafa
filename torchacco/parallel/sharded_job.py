"""The sharded job, the one communication round ZeRO-1, ACCO, DPU and WP share: reduce-scatter gradients → gather
per-rank counts → normalise by the global token count → clip → AdamW on this rank's fp32 shard (commit, or peek
for an estimate) → all-gather the new parameters. Each phase is labelled for the profiler (`torchacco/job/...`).
"""

from __future__ import annotations

import math

import torch
from torch.profiler import record_function

from torchacco.optim import ShardedAdamW
from torchacco.parallel.accounting import gather_counts
from torchacco.parallel.collectives import all_gather, reduce_scatter
from torchacco.parallel.flat import FlatParams
from torchacco.parallel.strategy import Counts, UpdateResult

COMMIT = "commit"  # θ ← Opt(θ, ḡ): m, v, step and the master shard advance
ESTIMATE = "estimate"  # θ̃ = Opt(θ, ḡ) without touching any state (ACCO)
COMMIT_AND_PREDICT = "commit_and_predict"  # θ ← Opt(θ, ḡ), then gather Opt(θ, ḡ) once more (WP)


def reduce_update_gather(
    flat: FlatParams, opt: ShardedAdamW, grads, local: Counts, lr_for, kind, out, max_norm, estimate_clip_norm=None
) -> UpdateResult:
    """`grads`: this rank's full flat sum-of-token-loss gradients, reduced in place into its slice; `local`: its
    counts; `lr_for`: global tokens consumed -> lr; `out`: the full flat buffer for the new parameters (may be
    `grads`), this rank's slice written and the rest all-gathered. An ESTIMATE's `estimate_clip_norm`: the norm that
    decides its clipping (None: its own). The job holds nothing beyond these buffers but the optimizer's few working
    chunks."""
    group = flat.group
    grad = flat.shard(grads)
    with record_function("torchacco/job/reduce_scatter"):
        reduce_scatter(grad, grads, group=group)

    # One small collective for all the scalars of every rank: ‖shard‖² and its Counts.
    with record_function("torchacco/job/norm_and_counts"):
        counts = gather_counts(local, group, grad.device, scalars=flat.sq_norm(grad))
    sq_norm, loss_sum = flat.model_parallel_sum(counts.scalar_sums[0], counts.loss_sum)  # over tp × pp peers
    tokens, consumed = counts.tokens, counts.consumed
    if not (math.isfinite(sq_norm) and math.isfinite(loss_sum)):
        # Every rank sees the same gathered numbers, so every rank skips together. The
        # optimizer state is untouched: θ̃ = θ for an estimate, θ stays for a commit.
        gather_master(flat, opt, out)
        bad = counts.nonfinite_ranks(group, flat.mp_group, grad.device)  # as the job's ranks, from every stage
        return counts.result(
            loss_sum, math.sqrt(sq_norm) / max(tokens, 1.0), lr_for(consumed), kind != ESTIMATE,
            skipped=True, nonfinite_ranks=bad,
        )  # fmt: skip
    if tokens <= 0 and kind == ESTIMATE:  # a half with every label masked: no information, θ̃ = θ
        gather_master(flat, opt, out)
        return counts.result(0.0, 0.0, lr_for(consumed), False)
    counts.require_tokens()
    grad_norm = math.sqrt(sq_norm) / tokens
    scale = 1.0 / tokens  # the gradient of the mean token loss ...
    clip_norm = estimate_clip_norm if kind == ESTIMATE and estimate_clip_norm is not None else grad_norm
    if max_norm and clip_norm > max_norm:
        scale *= max_norm / (clip_norm + 1e-6)  # ... clipped

    lr = lr_for(consumed)
    send = flat.shard(out)
    with record_function(f"torchacco/job/optimizer_{kind}"):
        if kind == ESTIMATE:
            opt.peek(grad, lr, scale, out=send)
        else:
            opt.step(grad, lr, scale, out=send, predict=kind == COMMIT_AND_PREDICT)
    with record_function("torchacco/job/all_gather"):
        all_gather(out, send, group=group)
    return counts.result(loss_sum, grad_norm, lr, kind != ESTIMATE)


def gather_master(flat: FlatParams, opt: ShardedAdamW, out: torch.Tensor) -> None:
    """`out` ← θ: every rank's fp32 master shard, in out's dtype (in place, no shard-sized copy)."""
    send = flat.shard(out)
    send.copy_(opt.state.master)
    with record_function("torchacco/job/all_gather"):
        all_gather(out, send, group=flat.group)
