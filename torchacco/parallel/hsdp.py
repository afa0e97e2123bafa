"""HSDP: FSDP2 sharded inside a node and replicated across nodes.

`fully_shard` over a 2-D data-parallel mesh ("dp_replicate", "dp_shard"): parameters, gradients and AdamW's state
are sharded over the `[hsdp] shard_degree` ranks of a node, and each shard's reduced gradient is all-reduced with
its copies on the other nodes: the slow links carry one gradient per node and update, as DDP's, while the
per-micro-batch all-gathers stay on the node's fast links.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from torchacco.device import DTYPES
from torchacco.errors import UserError
from torchacco.options import HSDPOptions
from torchacco.parallel.dims import group_options
from torchacco.parallel.fsdp import FSDP


def shard_degree(options: HSDPOptions, dp_size: int, local_world_size: int, tp: int, pp: int) -> int:
    """The shard group's size, checked: it divides the data-parallel ranks (one line otherwise)."""
    if options.shard_degree < 0:
        raise UserError(
            f"[hsdp] shard_degree = {options.shard_degree} must be 0 (a node's ranks) or a positive number of ranks"
        )
    shard = options.shard_degree or max(1, local_world_size // (tp * pp))
    if dp_size % shard:
        raise UserError(
            f"[hsdp] shard_degree = {shard} must divide the {dp_size} data-parallel ranks (shard inside a node, "
            "replicate across nodes); set it to the data-parallel ranks of one node, e.g. --hsdp.shard_degree "
            f"{next((d for d in range(min(shard, dp_size), 0, -1) if dp_size % d == 0), 1)}"
        )
    return shard


class HSDP(FSDP):
    traits = dataclasses.replace(
        FSDP.traits,
        name="hsdp",
        model_parallel=False,  # the 2-D data-parallel mesh is not a submesh of the tp/pp mesh
        why_not_in_replicas="it replicates across nodes itself; DiLoCo's replicas would nest a second copy",
        shards_within_node=True,  # the cost model's HSDP: shards over a node's ranks, all-reduces across nodes
        options=HSDPOptions,
    )

    @classmethod
    def check_config(cls, dp_size: int, model_parallel: str, *, options, **_) -> str | None:
        shard_degree(options, dp_size, int(os.environ.get("LOCAL_WORLD_SIZE", dp_size)), 1, 1)
        return None

    @classmethod
    def from_config(cls, model, dims, plan, device, *, parallelism, optimizer, options, init=None, **_):
        p = parallelism
        shard = shard_degree(options, dims.dp_size, dims.local_world_size, dims.tp_size, dims.pp_size)
        if not hasattr(dims.dp_mesh, "_unflatten"):
            raise UserError(
                f"hsdp needs torch's DeviceMesh._unflatten, which torch {torch.__version__} lacks; install a newer "
                f"torch (the suite runs on 2.13.0) or use data_parallel = '{FSDP.name}'"
            )
        overrides = {name: (device.backend, group_options(device.backend, dims.timeout, True))
                     for name in ("dp_replicate", "dp_shard")}  # fmt: skip
        mesh = dims.dp_mesh._unflatten(
            0, (dims.dp_size // shard, shard), ("dp_replicate", "dp_shard"), backend_override=overrides
        )
        return cls(
            model, dims, plan, optimizer, DTYPES[p.reduce_dtype], p.reshard_after_forward, mesh,
            p.accumulate_unsharded, init,
        )  # fmt: skip
