"""Process-group and device-mesh bookkeeping, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchacco.device import Device
from torchacco.errors import UserError


@dataclass
class ParallelDims:
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    mesh: DeviceMesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.dp_mesh.get_group()

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.dp_mesh.size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from torchrun's environment; 1 process otherwise."""
    env = os.environ
    if "RANK" not in env:
        return 0, 1, 0, 1
    return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))


def init_distributed(device: Device, timeout_s: float = 1800.0) -> ParallelDims:
    rank, world, local_rank, local_world = launch_env()
    if not dist.is_initialized():
        kwargs = dict(backend=device.backend, timeout=timedelta(seconds=timeout_s))
        if device.type == "cuda":
            kwargs["device_id"] = device.torch
        if "RANK" in os.environ:
            dist.init_process_group(**kwargs)
        else:  # a plain `python` process: a one-rank group keeps one code path
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    return ParallelDims(world, rank, local_rank, local_world, mesh)


def check_parallelism(cfg, world_size: int) -> None:
    p = cfg.parallelism
    if p.tensor_parallel_degree != 1 or p.pipeline_parallel_degree != 1:
        raise UserError(
            "tensor and pipeline parallelism are not implemented yet; "
            "set [parallelism] tensor_parallel_degree = 1 and pipeline_parallel_degree = 1"
        )


def destroy(barrier: bool = True) -> None:
    if dist.is_initialized():
        if barrier:
            # Without it a rank can tear gloo down while a peer still uses it, and the peer
            # aborts ("terminate called without an active exception").
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(values: list[float], device: torch.device, group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
