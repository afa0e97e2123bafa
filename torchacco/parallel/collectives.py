"""The sharded job's two big collectives, as fast as the backend allows.

NCCL's run near their ring ideal and are used as they are. gloo's reduce-scatter moves an all-reduce's bytes and
its all-gather takes 1.3–1.6× the ideal on a shaped link, so for gloo both run here as rings of point-to-point
messages, (W−1)/W of the buffer per rank. Both work in place on a flat buffer, rank r's shard being chunk r."""

from __future__ import annotations

import functools
import os
import threading
import weakref
import zlib
from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed the single-tensor collectives; keep working on older releases.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

RING_MIN_NUMEL = 1 << 16  # below this, a message's latency outweighs the bytes saved
PIECE_NUMEL = 1 << 22  # ring messages are cut to this size: the staging buffer stays bounded

_before_collective: Callable[[str], None] | None = None
_everywhere = False
_heartbeat = None  # the run's, which `watch_collectives` installs: the free functions here report to it
# gloo joins two ranks by one TCP connection, whose two directions a 2-rank ring's messages take turns on in some
# calls (on a shaped link, 1.3-1.4x the ideal on average): its messages to the lower rank go by a second group
_return_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# One issuing thread per process group (docs/reliability.md#one-thread-per-communicator), as NCCL needs: with this
# variable set (the test suite sets it) a collective raises where another thread issued on its group before.
CHECK_THREADS = "TORCHACCO_CHECK_COLLECTIVE_THREADS"
_issuers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> the thread that issues on it (a name
# may come back for another group once the groups are destroyed: a test process starts several runs)
HOST_GROUPS: weakref.WeakSet = weakref.WeakSet()  # gloo on every backend (checkpoints'): threads may take turns
# (not isend and irecv: torch's P2POp, which pipeline stages build, accepts only those very functions)
WATCHED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier",
           "all_gather_object", "broadcast_object_list", "gather_object", "gather", "scatter", "send", "recv",
           "all_to_all_single", "reduce_scatter_single", "all_gather_single")  # fmt: skip


def _issue(name: str, group, hooked: bool = False) -> None:
    """Before a collective: the hook (where `hooked`), the heartbeat's record, the thread check."""
    if hooked and _before_collective is not None:
        _before_collective(name)
    if not dist.is_initialized():
        return
    group, me = group or dist.group.WORLD, threading.current_thread()
    if group not in dist.distributed_c10d._world.pg_names:  # torchft's: not torch's to name, its manager's to check
        return
    if _heartbeat is not None:
        _heartbeat.issued(name, group.group_name)
    first = _issuers.setdefault(group, mine := f"{me.name} ({me.ident})")
    if first != mine and os.environ.get(CHECK_THREADS) and group not in HOST_GROUPS:
        raise RuntimeError(f"two threads issue collectives on process group {group.group_name} "
                           f"({dist.get_process_group_ranks(group)}): {first}, then {mine}")  # fmt: skip


def watch_collectives(heartbeat) -> None:
    """torch.distributed's collectives called from Python (not DDP's or DTensor's) run `_issue` first; they and these
    report to `heartbeat` (health.start's; None: to none)."""
    global _heartbeat
    _heartbeat = heartbeat
    for name in WATCHED:
        fn = getattr(dist, name, None)
        if fn is None or hasattr(fn, "_torchacco_watched"):
            continue

        @functools.wraps(fn)
        def watched(*args, _fn=fn, _name=name, **kwargs):
            _issue(_name, kwargs.get("group"), hooked=_everywhere)
            return _fn(*args, **kwargs)

        watched._torchacco_watched = True
        setattr(dist, name, watched)


def add_return_group(group: dist.ProcessGroup, back: dist.ProcessGroup) -> None:
    """A 2-rank gloo `group`'s second connection: `back` (the same two ranks) carries the ring's messages to the
    lower rank. Held as long as `group` is."""
    _return_groups[group] = back


def set_collective_hook(hook: Callable[[str], None] | None, everywhere: bool = False) -> None:
    """Call `hook(name)` before each reduce-scatter and all-gather here ("reduce_scatter" or "all_gather"; None
    removes it), and with `everywhere` before each collective `watch_collectives` sees (its torch.distributed name):
    benchmarks/gpu.py delays ACCO's jobs with it, torchacco/faults.py injects a stuck collective."""
    global _before_collective, _everywhere
    _before_collective, _everywhere = hook, everywhere


def _name(group) -> str:
    """A short name of `group` that its ranks agree on (for the heartbeat). Not cached: a cache would keep the group
    alive past destroy_process_group(), and gloo would abort at interpreter exit."""
    if not dist.is_initialized():
        return "-"
    members = ",".join(map(str, dist.get_process_group_ranks(group or dist.group.WORLD)))
    return f"{zlib.crc32(members.encode()):08x}"


def _enter_and_use_ring(name: str, tensor: torch.Tensor, group) -> bool:
    """Before collective `name`: the hook, then the heartbeat (a stall in the hook never enters); whether it runs here
    as a ring."""
    _issue(name, group, hooked=True)
    if _heartbeat is not None:
        _heartbeat.entered(name, _name(group))
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1 and tensor.numel() >= RING_MIN_NUMEL


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """`output` ← this rank's chunk of the sum of every rank's `input` (output may be that chunk of input)."""
    if not _enter_and_use_ring("reduce_scatter", input, group):
        _reduce_scatter(output, input, group=group)
        return
    world, rank, send_to, recv_from = _neighbours(group)
    chunks = input.chunk(world)
    staging = torch.empty(min(PIECE_NUMEL, chunks[0].numel()), dtype=input.dtype, device=input.device)
    # Step s: pass chunk r-s-1 (holding s+1 ranks' sums) on, add the incoming chunk r-s-2 to ours;
    # after W-1 steps chunk r holds every rank's sum.
    for step in range(world - 1):
        outgoing, incoming = chunks[(rank - step - 1) % world], chunks[(rank - step - 2) % world]
        for start in range(0, incoming.numel(), staging.numel()):
            piece = slice(start, start + staging.numel())
            received = staging[: incoming[piece].numel()]
            _exchange(outgoing[piece], send_to, received, recv_from, group, rank)
            incoming[piece].add_(received)
    if output.data_ptr() != chunks[rank].data_ptr():
        output.copy_(chunks[rank])


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """`output` ← every rank's `input`, in rank order (input may be this rank's chunk of output)."""
    if not _enter_and_use_ring("all_gather", output, group):
        all_gather_single(output, input, group=group)
        return
    world, rank, send_to, recv_from = _neighbours(group)
    chunks = output.chunk(world)
    if input.data_ptr() != chunks[rank].data_ptr():
        chunks[rank].copy_(input)
    # Step s: pass on chunk r-s (ours, or the one received last step), receive chunk r-s-1 in place.
    for step in range(world - 1):
        outgoing, incoming = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        for start in range(0, incoming.numel(), PIECE_NUMEL):
            piece = slice(start, start + PIECE_NUMEL)
            _exchange(outgoing[piece], send_to, incoming[piece], recv_from, group, rank)


def exchange(pieces: list[tuple[int, torch.Tensor, torch.Tensor]], group=None) -> None:
    """Point-to-point with a few peers at once: for each (peer's rank in `group`, the tensor sent to it, the tensor
    received from it), in an order both sides share. Not a collective: the heartbeat's counts stay per collective."""
    if not pieces:
        return
    group = group or dist.group.WORLD
    _issue("exchange", group)
    peers = [(dist.get_global_rank(group, peer), send, recv) for peer, send, recv in pieces]
    if len(peers) == 1:  # one peer: the ring's exchange, with a 2-rank gloo group's second connection
        peer, send, recv = peers[0]
        _exchange(send, peer, recv, peer, group, dist.get_rank(group))
        return
    ops = []
    for peer, send, recv in peers:
        ops += [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _neighbours(group) -> tuple[int, int, int, int]:
    """(world, rank, the next rank's global rank, the previous rank's global rank) of the ring."""
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return world, rank, dist.get_global_rank(group, (rank + 1) % world), dist.get_global_rank(group, (rank - 1) % world)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group, rank: int) -> None:
    back = _return_groups.get(group or dist.group.WORLD)
    if back is None:
        ops = [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
        works = dist.batch_isend_irecv(ops)
    else:  # rank 0 of the pair sends on `group` and receives on `back`; rank 1 the other way round
        ahead, behind = (group, back) if rank == 0 else (back, group)
        works = [dist.isend(send, dst, group=ahead), dist.irecv(recv, src, group=behind)]
    for work in works:
        work.wait()


def all_reduce_sum(values: list[float], device: torch.device, group=None) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()
