"""The device mesh and a rank's place in it.

The mesh is 3-D, ("pp", "dp", "tp"): tensor-parallel ranks are neighbours (one node's fast
links), then data parallel, then pipeline stages outermost. A rank's coordinates are
(pp_rank, dp_rank, tp_rank); dp = world / (tp × pp). Setting up the default process group
(rendezvous, diagnosis of a rank that never joins) is `process_groups.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

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
    # For the sharded-optimizer job's few scalars (gradient norm, loss) over tp × pp: a group
    # of its own, because the job runs on the communication thread while compute uses the tp
    # and pp groups (two threads must never share a group). None without tp/pp.
    mp_group: dist.ProcessGroup | None = None
    timeout: timedelta = timedelta(minutes=30)  # every group's: [training] collective_timeout_s

    def new_group(self, ranks=None, backend=None) -> dist.ProcessGroup:
        """A process group with the run's collective timeout (torch's subgroups default to their own)."""
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size()

    @property
    def pp_size(self) -> int:
        return self.mesh["pp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def model_parallel(self) -> bool:
        """Is a model replica split over several ranks (tp or pp)?"""
        return self.tp_enabled or self.pp_enabled

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


def build_dims(device: Device, tp: int, pp: int, local_rank: int, local_world: int, timeout: timedelta) -> ParallelDims:
    """The mesh over the initialised default group, every subgroup with `timeout`."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % (tp * pp):
        raise UserError(
            f"{world} ranks are not divisible by tensor_parallel_degree × pipeline_parallel_degree = {tp} × {pp}"
        )
    names = ("pp", "dp", "tp")
    mesh = init_device_mesh(
        device.type, (pp, world // (tp * pp), tp), mesh_dim_names=names,
        backend_override={name: (device.backend, _options(device.backend, timeout, name == "dp")) for name in names},
    )  # fmt: skip
    mp_group = _model_parallel_group(mesh, world, tp, pp, timeout)
    return ParallelDims(world, rank, local_rank, local_world, mesh, mp_group, timeout)


def _options(backend: str, timeout: timedelta, high_priority: bool = False):
    """Options that give a mesh's subgroups the run's timeout; with NCCL, the data-parallel group's
    communicator on high-priority streams (its collectives run beside compute, in the overlapped
    schedules, and should not wait behind it)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = high_priority
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options


def _model_parallel_group(
    mesh: DeviceMesh, world: int, tp: int, pp: int, timeout: timedelta
) -> dist.ProcessGroup | None:
    """The ranks of this rank's (tp × pp) block, i.e. the same dp coordinate."""
    if tp * pp == 1:
        return None
    dp = world // (tp * pp)
    ranks = mesh.mesh.permute(1, 0, 2).reshape(dp, tp * pp).tolist()  # one row per dp coordinate
    mine = None
    for row in ranks:  # every rank creates every group, in the same order
        group = dist.new_group(row, timeout=timeout)
        if dist.get_rank() in row:
            mine = group
    return mine
