"""Process-group and device-mesh bookkeeping, in one place.

The mesh is 3-D, ("pp", "dp", "tp"): tensor-parallel ranks are neighbours (one node's fast
links), then data parallel, then pipeline stages outermost. A rank's coordinates are
(pp_rank, dp_rank, tp_rank); dp = world / (tp × pp).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchacco import health
from torchacco.device import Device
from torchacco.errors import PeerFailure, UserError


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


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from torchrun's environment; 1 process otherwise."""
    env = os.environ
    if "RANK" not in env:
        return 0, 1, 0, 1
    return (
        int(env["RANK"]),
        int(env["WORLD_SIZE"]),
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
    )


_timeout = timedelta(minutes=30)  # every process group's: [training] collective_timeout_s


def new_group(ranks=None, backend=None) -> dist.ProcessGroup:
    """A process group with the run's collective timeout (torch's subgroups default to their own)."""
    return dist.new_group(ranks, timeout=_timeout, backend=backend)


def init_distributed(device: Device, timeout_s: float = 1800.0, tp: int = 1, pp: int = 1) -> ParallelDims:
    global _timeout
    _timeout = timedelta(seconds=timeout_s)
    _, _, local_rank, local_world = launch_env()
    if dist.is_initialized():
        return _dims(device, tp, pp, local_rank, local_world)
    kwargs = dict(backend=device.backend, timeout=timedelta(seconds=timeout_s))
    if device.type == "cuda":
        kwargs["device_id"] = device.torch
    if "RANK" not in os.environ:  # a plain `python` process: a one-rank group keeps one code path
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return _dims(device, tp, pp, local_rank, local_world)
    store, rank, world = next(dist.rendezvous("env://", timeout=kwargs["timeout"]))
    store = attempt_store(store, rank, world, timeout_s)
    with _diagnosed_setup(store, rank, world, timeout_s):
        dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
        return _dims(device, tp, pp, local_rank, local_world)


def _dims(device: Device, tp: int, pp: int, local_rank: int, local_world: int) -> ParallelDims:
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world % (tp * pp):
        raise UserError(
            f"{world} ranks are not divisible by tensor_parallel_degree × pipeline_parallel_degree = {tp} × {pp}"
        )
    names = ("pp", "dp", "tp")
    mesh = init_device_mesh(
        device.type, (pp, world // (tp * pp), tp), mesh_dim_names=names,
        backend_override={name: (device.backend, _options(device.backend)) for name in names},
    )  # fmt: skip
    return ParallelDims(world, rank, local_rank, local_world, mesh, _model_parallel_group(mesh, world, tp, pp))


@contextlib.contextmanager
def _diagnosed_setup(store: dist.Store, rank: int, world: int, timeout_s: float):
    """While the process groups are set up, a rank that died or stalled makes the others' waits fail
    at the timeout: say which rank, in one line, instead of a store traceback. A heartbeat of its own
    (the run's starts once the groups exist) tells the dead from the merely slow."""
    beat = health.Heartbeat(dist.PrefixStore("torchacco/setup/", store), rank, world)
    beat.enter("process-group setup")
    try:
        yield
    except RuntimeError as e:  # DistStoreError, DistNetworkError, DistBackendError, gloo's own
        if not (isinstance(e, dist.DistError) or health.is_peer_failure(e)):
            raise
        cause = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
        raise PeerFailure(
            f"rank {rank}: setting up the process group failed ({cause}): {beat.diagnose()}; "
            f"[training] collective_timeout_s = {timeout_s:g}"
        ) from None
    finally:
        beat.close()


def attempt_store(store: dist.Store, rank: int, world: int, timeout_s: float) -> dist.Store:
    """The part of the launcher's key-value store that belongs to this launch attempt.

    torchrun's elastic agent keeps its store across worker restarts, so restarted workers would
    read the dead workers' gloo addresses and wait for them until the timeout. Rank 0 names the
    attempt with a fresh nonce and hands it to each rank under a key that rank just made up,
    which no earlier attempt can have written.
    """
    prefix = "torchacco/attempt/"
    if rank != 0:
        mine = uuid.uuid4().hex
        store.set(f"{prefix}join/{rank}", mine)
        try:
            attempt = store.get(f"{prefix}name-for/{mine}").decode()  # waits up to the store's timeout
        except dist.DistStoreError:
            raise PeerFailure(
                f"rank {rank}: rank 0 did not admit this rank to the process group within [training] "
                f"collective_timeout_s = {timeout_s:g}: rank 0, or a rank it waits for, died or stalled while "
                "starting (rank 0's message names it)"
            ) from None
        store.set(f"{prefix}{attempt}/ready/{rank}", "1")
    else:
        attempt = uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        for peer in range(1, world):
            late = PeerFailure(
                f"rank 0: rank {peer} did not join the process group within [training] collective_timeout_s = "
                f"{timeout_s:g}: it died or stalled while starting (its own messages, or its node's log, say why)"
            )
            while True:
                # A join key left by a dead attempt gets a name nobody reads; wait and look again.
                try:
                    joined = store.get(f"{prefix}join/{peer}").decode()
                except dist.DistStoreError:
                    raise late from None
                store.set(f"{prefix}name-for/{joined}", attempt)
                polls = 0
                while not store.check([f"{prefix}{attempt}/ready/{peer}"]) and polls < 100:
                    time.sleep(0.01)
                    polls += 1
                if polls < 100:
                    break
                if time.monotonic() > deadline:
                    raise late
    return dist.PrefixStore(f"{prefix}{attempt}/", store)


def _options(backend: str):
    """Options that give a mesh's subgroups the run's timeout."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = _timeout
    return options


def _model_parallel_group(mesh: DeviceMesh, world: int, tp: int, pp: int) -> dist.ProcessGroup | None:
    """The ranks of this rank's (tp × pp) block, i.e. the same dp coordinate."""
    if tp * pp == 1:
        return None
    dp = world // (tp * pp)
    ranks = mesh.mesh.permute(1, 0, 2).reshape(dp, tp * pp).tolist()  # one row per dp coordinate
    mine = None
    for row in ranks:  # every rank creates every group, in the same order
        group = new_group(row)
        if dist.get_rank() in row:
            mine = group
    return mine


def check_parallelism(p, world_size: int) -> int:
    """Checks of the [parallelism] degrees that need no model; returns the data-parallel degree."""
    tp, pp = p.tensor_parallel_degree, p.pipeline_parallel_degree
    for key, value in (("tensor_parallel_degree", tp), ("pipeline_parallel_degree", pp)):
        if value < 1:
            raise UserError(f"[parallelism] {key} must be at least 1, got {value}")
    if world_size % (tp * pp):
        raise UserError(
            f"{world_size} ranks are not divisible by [parallelism] tensor_parallel_degree × pipeline_parallel_degree "
            f"= {tp} × {pp} = {tp * pp}; launch a multiple of {tp * pp} ranks (NPROC × NNODES) or change the degrees"
        )
    if p.pipeline_microbatches < 0:
        raise UserError(
            f"[parallelism] pipeline_microbatches must be 0 (auto) or positive, got {p.pipeline_microbatches}"
        )
    return world_size // (tp * pp)


def model_parallel_label(p) -> str:
    """'tp=2 × pp=2' for the [parallelism] degrees above 1; '' for none."""
    degrees = (("tp", p.tensor_parallel_degree), ("pp", p.pipeline_parallel_degree))
    return " × ".join(f"{name}={d}" for name, d in degrees if d > 1)


def on_one_rank(dims: ParallelDims, fn, on: bool | None = None) -> None:
    """Run `fn` on local rank 0 (or where `on`) while the others wait; a UserError there fails
    every rank, so no rank is left waiting in a collective for one that has given up."""
    error = None
    if (dims.local_rank == 0) if on is None else on:
        try:
            fn()
        except UserError as e:
            error = str(e)
    errors = [None] * dims.world_size
    dist.all_gather_object(errors, error)
    message = next((e for e in errors if e), None)
    if message:
        raise UserError(message)


def destroy(barrier: bool = True) -> None:
    if dist.is_initialized():
        if barrier:
            # Without it a rank can tear gloo down while a peer still uses it, and the peer
            # aborts ("terminate called without an active exception").
            dist.barrier()
        dist.destroy_process_group()


def global_ranks(group: dist.ProcessGroup, ranks: list[int]) -> list[int]:
    """`ranks` of `group` as ranks of the whole job."""
    members = dist.get_process_group_ranks(group)
    return [members[r] for r in ranks]


def union_over(group: dist.ProcessGroup | None, ranks: list[int], device) -> list[int]:
    """The union of the (global) `ranks` every member of `group` holds: a collective of them all."""
    if group is None:
        return sorted(ranks)
    marks = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    marks[ranks] = 1
    dist.all_reduce(marks, op=dist.ReduceOp.MAX, group=group)
    return marks.nonzero().flatten().tolist()


def all_reduce_sum(values: list[float], device: torch.device, group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
