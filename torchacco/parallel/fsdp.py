"""FSDP: FSDP2's `fully_shard` (ZeRO-3), parameters gathered and gradients reduce-scattered
inside forward and backward."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchacco.blocks import block_list
from torchacco.device import DTYPES
from torchacco.parallel.ddp import DDP
from torchacco.parallel.replicated import Replicated
from torchacco.parallel.strategy import MemoryParts, Traits


class FSDP(Replicated):
    """FSDP2 (ZeRO-3): `fully_shard` per block, then the root — under pipeline parallelism, each
    of this rank's stage modules is a root (the schedule calls them, not the model)."""

    traits = Traits(
        "fsdp",
        "per_micro_batch",
        "gradient all-reduce and optimizer step",
        balances=False,  # its all-gathers and reduce-scatters run inside every rank's forward and backward
        shards_theta=True,
        update_of=DDP.name,  # DDP's update, with parameters, gradients and optimizer state sharded
    )

    def __init__(
        self, model, dims, plan, optimizer, reduce_dtype=torch.float32, reshard_after_forward=True, mesh=None,
        accumulate_unsharded=False, init=None,
    ):  # fmt: skip
        self.accumulate_unsharded = accumulate_unsharded
        mp = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=reduce_dtype)
        mesh = dims.dp_mesh if mesh is None else mesh  # the data-parallel mesh to shard over (HSDP's is 2-D)
        self.roots = getattr(model, "stage_modules", None) or [model]
        # The blocks, then the roots (a foreign model without blocks is sharded as one unit).
        for module in [*block_list(model), *self.roots]:
            fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        if init is not None:  # a model built on meta: only now does each rank allocate, its shards alone
            init()
        super().__init__(model, dims, plan, optimizer)

    @classmethod
    def memory(cls, numel, dp_size, param_dtype, reduce_dtype, options=None):
        # fp32 parameters, gradients, m and v, all sharded (the compute dtype's gathered copies are transient)
        shard = numel / dp_size
        return MemoryParts(weights=4 * shard, gradients=4 * shard, optimizer=8 * shard)

    @classmethod
    def gathered_memory(cls, parallelism, block_numel, root_numel, blocks, param_dtype, group=1):
        # The root's parameters stay gathered from forward to backward; a block's while it runs and the next's,
        # prefetched (all of them after forward without reshard_after_forward), the next's twice while its all-gather's
        # output is copied out, and one block's unsharded gradient beside the reduce-scatter input it is copied into.
        gathered = root_numel + (3 if parallelism.reshard_after_forward else blocks + 1) * block_numel
        return (gathered + block_numel) * param_dtype.itemsize + block_numel * DTYPES[parallelism.reduce_dtype].itemsize

    @classmethod
    def accumulation_memory(cls, parallelism, numel, micro_batches):
        # Gradients held unsharded between backwards (in the reduce dtype, FSDP2's accumulator): with
        # accumulate_unsharded, and always inside a pipeline step (torch's schedule turns gradient sync off
        # until its last piece).
        unsharded = parallelism.pipeline_parallel_degree > 1 or (parallelism.accumulate_unsharded and micro_batches > 1)
        return numel * DTYPES[parallelism.reduce_dtype].itemsize if unsharded else 0.0

    @classmethod
    def build(cls, model, dims, plan, device, init, **sections):
        return cls.from_config(model, dims, plan, device, init=init, **sections)  # `init` runs once it is sharded

    @classmethod
    def from_config(cls, model, dims, plan, device, *, parallelism, optimizer, init=None, **_):
        return cls(
            model, dims, plan, optimizer, DTYPES[parallelism.reduce_dtype], parallelism.reshard_after_forward,
            accumulate_unsharded=parallelism.accumulate_unsharded, init=init,
        )  # fmt: skip

    @classmethod
    def checkpoint_key(cls, dims) -> str:
        # DTensors span dp and tp; the optimizer's param groups are saved by index, which would
        # collide between stages: one key per stage.
        return f"dp_pp{dims.pp_rank}" if dims.pp_enabled else "dp"

    @contextlib.contextmanager
    def _sync(self, last):
        # By default every micro-batch's gradient is reduce-scattered into the sharded one (torchtitan's way): no
        # unsharded gradient outlives its block's backward. HSDP's all-reduce across replicas waits for the last.
        for root in self.roots:  # (a pipeline stage also reduces after each schedule step)
            root.set_requires_gradient_sync(last or not self.accumulate_unsharded)
            root.set_requires_all_reduce(last)
        yield
