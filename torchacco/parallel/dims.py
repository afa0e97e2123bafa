"""The device mesh and a rank's place in it.

The mesh is 4-D, ("replica", "pp", "dp", "tp"): tensor-parallel ranks are neighbours (one node's fast links),
replicas outermost (the slowest links: docs/diloco.md); dp = world / (replicas × tp × pp), and without replicas
the "replica" dimension has size 1. The default process group is `process_groups.py`'s.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.health import Heartbeat
from torchacco.parallel.collectives import add_return_group


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
    # The ranks that read different data: every replica's dp ranks with this rank's (pp, tp)
    # coordinate (evaluation averages over them), on a communicator of their own: an overlapped strategy's job thread
    # issues on the dp group.
    data_group: dist.ProcessGroup | None = None
    # A fault-tolerant replica's job (torchacco/fault_tolerance.py): (its replica, the run's replicas). The mesh holds
    # this one replica; the others are reached through torchft.
    replica_job: tuple[int, int] | None = None
    # Where this rank is, for the diagnoses: the trainer's (health.start), which what takes the dims reports to.
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(None, 0, 1))  # (silent outside train())

    def new_group(self, ranks=None, backend=None) -> dist.ProcessGroup:
        """A process group with the run's collective timeout (torch's subgroups default to their own)."""
        return dist.new_group(ranks, timeout=self.timeout, backend=backend)

    # The mesh's dimensions: their submeshes, sizes and this rank's coordinate.
    tp_mesh = property(lambda self: self.mesh["tp"])
    pp_mesh = property(lambda self: self.mesh["pp"])
    dp_mesh = property(lambda self: self.mesh["dp"])
    tp_size = property(lambda self: self.mesh["tp"].size())
    pp_size = property(lambda self: self.mesh["pp"].size())
    dp_size = property(lambda self: self.mesh["dp"].size())
    tp_rank = property(lambda self: self.mesh["tp"].get_local_rank())
    pp_rank = property(lambda self: self.mesh["pp"].get_local_rank())
    dp_rank = property(lambda self: self.mesh["dp"].get_local_rank())
    dp_group = property(lambda self: self.mesh["dp"].get_group())
    tp_enabled = property(lambda self: self.tp_size > 1)
    pp_enabled = property(lambda self: self.pp_size > 1)
    is_main = property(lambda self: self.rank == 0)

    model_parallel = property(lambda self: self.tp_enabled or self.pp_enabled)  # a model replica over several ranks
    replicas = property(lambda self: self.replica_job[1] if self.replica_job else self.mesh["replica"].size())
    replica_rank = property(
        lambda self: self.replica_job[0] if self.replica_job else self.mesh["replica"].get_local_rank()
    )
    # This rank and the ranks holding the same part of the model in the other replicas (the outer step's).
    replica_group = property(lambda self: self.mesh["replica"].get_group())
    # This rank's data shard: replicas × dp ranks read different data.
    data_rank = property(lambda self: self.replica_rank * self.dp_size + self.dp_rank)
    data_size = property(lambda self: self.replicas * self.dp_size)


def build_dims(device: Device, tp, pp, local_rank, local_world, timeout, replicas=1, job=None) -> ParallelDims:
    """The mesh over the initialised default group, every subgroup with `timeout` (`job`: `replica_job`)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (replicas * tp * pp):
        raise UserError(
            f"{world} ranks are not divisible by replicas × tensor_parallel_degree × pipeline_parallel_degree = "
            f"{replicas} × {tp} × {pp}"
        )
    # DTensor caches sharding propagation by mesh equality, which ignores the groups: a second run in
    # this process with an equal mesh would send its tensor-parallel traffic over the first run's
    # groups (their timeout, or destroyed). The cache starts again with each run's mesh.
    clear_dtensor_sharding_cache()
    names = ("replica", "pp", "dp", "tp")
    options = {
        name: (device.backend, group_options(device.backend, timeout, name in ("dp", "replica"))) for name in names
    }
    shape = (replicas, pp, world // (replicas * tp * pp), tp)
    if "backend_override" not in inspect.signature(init_device_mesh).parameters:
        raise UserError(
            f"torch {torch.__version__} cannot give the mesh's groups the run's collective timeout "
            "(init_device_mesh has no backend_override); install torch>=2.9 (the suite runs on 2.13.0)"
        )
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names, backend_override=options)
    mp_group = _model_parallel_group(mesh, tp, pp, timeout)
    dims = ParallelDims(world, rank, local_rank, local_world, mesh, mp_group, timeout, replica_job=job)
    dims.data_group = _data_group(mesh, timeout)  # its own: the main thread's, while a sharded job issues on dp
    if device.backend == "gloo" and dims.dp_size == 2:  # the sharded job's ring: one connection per direction
        add_return_group(dims.dp_group, group_per_row(mesh, "dp", timeout))
    return dims


def clear_dtensor_sharding_cache() -> None:
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # torch renamed it: the cache's staleness only matters for a second run in one process
        return
    _clear_sharding_prop_cache()


def group_options(backend: str, timeout: timedelta, high_priority: bool = False):
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


def _model_parallel_group(mesh: DeviceMesh, tp: int, pp: int, timeout: timedelta) -> dist.ProcessGroup | None:
    """The ranks of this rank's (tp × pp) block, i.e. the same (replica, dp) coordinate."""
    return None if tp * pp == 1 else _own_group(mesh, ("pp", "tp"), timeout)


def _data_group(mesh: DeviceMesh, timeout: timedelta) -> dist.ProcessGroup:
    """The ranks of this rank's (pp, tp) coordinate over every replica and dp rank."""
    return _own_group(mesh, ("replica", "dp"), timeout)


def group_per_row(mesh: DeviceMesh, dim: str, timeout: timedelta) -> dist.ProcessGroup:
    """This rank's group along mesh dimension `dim`, as a group of its own: the mesh's group of that dimension may be in
    use on another thread (two threads must never share a group). Every rank must call it, in the same order."""
    backend = dist.get_backend()  # on NCCL, high-priority streams, as the mesh's dp and replica groups
    return _own_group(mesh, (dim,), timeout, group_options(backend, timeout, True) if backend == "nccl" else None)


def _own_group(mesh: DeviceMesh, names: tuple[str, ...], timeout: timedelta, options=None) -> dist.ProcessGroup:
    """The ranks that differ from this one only along the mesh dimensions `names`, as a new group of their own."""
    axes = [mesh.mesh_dim_names.index(name) for name in names]
    rest = [a for a in range(mesh.mesh.ndim) if a not in axes]
    rows = mesh.mesh.permute(*rest, *axes).reshape(-1, math.prod(mesh.mesh.shape[a] for a in axes)).tolist()
    mine = None
    for row in rows:  # every rank creates every group, in the same order
        group = dist.new_group(row, timeout=timeout, pg_options=options)
        if dist.get_rank() in row:
            mine = group
    return mine
