"""Starting and ending a run's processes: the rendezvous, the default process group, one
rank's work while the others wait, and the teardown."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchacco import health
from torchacco.device import Device
from torchacco.errors import PeerFailure, UserError
from torchacco.parallel.dims import ParallelDims, build_dims


def launch_env() -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from torchrun's environment; 1 process otherwise."""
    env = os.environ
    if "RANK" not in env:
        return 0, 1, 0, 1
    world = int(env["WORLD_SIZE"])
    return int(env["RANK"]), world, int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", world))


FLIGHT_RECORDER = "flight_recorder"  # in the dump folder: each rank's last collectives, written on a hang


def nccl_flight_recorder(dump_folder: Path) -> None:
    """Before the process group exists: NCCL's flight recorder on, unless the user set it. Each rank keeps its last
    2,000 collectives and writes them to <dump_folder>/flight_recorder/rank_<r> on a timeout (`fr_trace` reads them)."""
    prefix = str(dump_folder / FLIGHT_RECORDER / "rank_")
    defaults = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the name torch used before 2.7
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,  # likewise
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)


def dump_flight_recorder(dump_folder: Path, rank: int, dump=None, timeout_s: float = 5.0) -> Path | None:
    """Write this rank's flight recorder where NCCL's timeout dump goes, now (a hang is diagnosed, and the process
    exits, before NCCL would dump). None when the recorder is off, this torch has none, or the dump failed or took
    over `timeout_s`."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or 0) <= 0:
        return None
    c10d = torch._C._distributed_c10d
    dump = dump or getattr(c10d, "_dump_nccl_trace", None) or getattr(c10d, "_dump_fr_trace", None)
    if dump is None:
        return None
    env = os.environ
    prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    path = Path(f"{prefix or dump_folder / FLIGHT_RECORDER / 'rank_'}{rank}")

    def write() -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)  # on this node's disk too
        path.write_bytes(dump())
        return path

    # With a deadline: a watchdog stuck beside the hang may hold the recorder's lock, and the diagnosis must go first
    # (which matters more than its evidence: a failed write is dropped).
    return health.within(write, timeout_s, "torchacco-flight-recorder", errors=(OSError, RuntimeError))


def init_distributed(device: Device, timeout_s: float = 1800.0, tp=1, pp=1, replicas=1, job=None) -> ParallelDims:
    timeout = timedelta(seconds=timeout_s)
    _, _, local_rank, local_world = launch_env()
    if dist.is_initialized():
        return build_dims(device, tp, pp, local_rank, local_world, timeout, replicas, job)
    kwargs = dict(backend=device.backend, timeout=timeout)
    if device.type == "cuda":
        kwargs["device_id"] = device.torch
    if "RANK" not in os.environ:  # a plain `python` process: a one-rank group keeps one code path
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return build_dims(device, tp, pp, local_rank, local_world, timeout, replicas, job)
    if int(os.environ.get("WORLD_SIZE", 1)) > local_world:
        check_gloo_interface()  # several nodes: gloo groups (CPU runs; preemption, checkpoints) cross them
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store = attempt_store(store, rank, world, timeout_s)
    with _diagnosed_setup(store, rank, world, timeout_s):
        dist.init_process_group(store=store, rank=rank, world_size=world, **kwargs)
        return build_dims(device, tp, pp, local_rank, local_world, timeout, replicas, job)


def check_gloo_interface() -> None:
    """gloo binds to the address the host's name resolves to unless GLOO_SOCKET_IFNAME names an interface: a loopback
    address (Debian's 127.0.1.1) makes every other node connect to itself until the timeout. Say so before."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or _loopback(os.environ.get("MASTER_ADDR", "127.0.0.1")):
        return  # an interface named, or every "node" on this host (tests, one machine)
    host = socket.gethostname()
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        address = None
    if address is None or address.is_loopback:
        found = "does not resolve" if address is None else f"resolves to the loopback address {address}"
        raise UserError(f"this node's name {host!r} {found}, which the other nodes cannot reach: "
                        "set GLOO_SOCKET_IFNAME to the interface that connects the nodes (e.g. "
                        "GLOO_SOCKET_IFNAME=eth0; `ip -brief addr` lists them)")  # fmt: skip


def _loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(name)).is_loopback
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _diagnosed_setup(store: dist.Store, rank: int, world: int, timeout_s: float):
    """A rank that died or stalls while the groups are set up: name it in one line, not a store traceback (a
    heartbeat of its own tells the dead from the slow)."""
    beat = health.Heartbeat(dist.PrefixStore("torchacco/setup/", store), rank, world)
    beat.enter("process-group setup")
    try:
        yield
    except RuntimeError as e:  # DistStoreError, DistNetworkError, DistBackendError, gloo's own
        if not (isinstance(e, dist.DistError) or health.is_peer_failure(e)):
            raise
        cause = str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__
        raise PeerFailure(f"rank {rank}: setting up the process group failed ({cause}): {beat.diagnose()}; "
                          f"[training] collective_timeout_s = {timeout_s:g}") from None  # fmt: skip
    finally:
        beat.close()


def attempt_store(store: dist.Store, rank: int, world: int, timeout_s: float) -> dist.Store:
    """The part of the launcher's store that belongs to this launch attempt: torchrun keeps its store across worker
    restarts, where restarted workers would wait for the dead ones' gloo addresses. Rank 0 names the attempt with a
    fresh nonce and hands it to each rank under a key that rank just made up, which no earlier attempt wrote."""
    prefix = "torchacco/attempt/"
    if rank != 0:
        mine = uuid.uuid4().hex
        store.set(f"{prefix}join/{rank}", mine)
        try:
            attempt = store.get(f"{prefix}name-for/{mine}").decode()  # waits up to the store's timeout
        except dist.DistStoreError:
            raise PeerFailure(f"rank {rank}: rank 0 did not admit this rank to the process group within "
                              f"[training] collective_timeout_s = {timeout_s:g}: rank 0, or a rank it waits for, "
                              "died or stalled while starting (rank 0's message names it)") from None  # fmt: skip
        store.set(f"{prefix}{attempt}/ready/{rank}", "1")
    else:
        attempt = uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        for peer in range(1, world):
            late = PeerFailure(f"rank 0: rank {peer} did not join the process group within [training] "
                               f"collective_timeout_s = {timeout_s:g}: it died or stalled while "
                               "starting (its own messages, or its node's log, say why)")  # fmt: skip
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


WAIT_LOG_S = 60.0  # how often a waiting rank says what it waits for
_calls = 0  # on_one_rank's calls so far: the same on every rank, so each call has keys of its own


def on_one_rank(dims: ParallelDims, fn, main_only: bool = False, what: str = "prepare") -> None:
    """Run `fn` on each node's local rank 0 (or on rank 0 alone: `main_only`) while the others wait on the store (not
    in a collective, which an hours-long preparation would outlast), saying every WAIT_LOG_S what they wait for; a
    UserError there fails every rank."""
    global _calls
    if not dist.is_initialized():
        fn()
        return
    _calls += 1
    nodes = max(1, dims.world_size // dims.local_world_size)
    runners = [0] if main_only else [node * dims.local_world_size for node in range(nodes)]
    store = dist.distributed_c10d._get_default_store()
    key = f"torchacco/once/{_calls}/"
    if dims.rank in runners:
        dims.heartbeat.enter(what)
        try:
            fn()
        except Exception as e:  # a UserError as it is; a bug named by rank (its traceback says more)
            message = e if isinstance(e, UserError) else f"rank {dims.rank} failed to {what} ({type(e).__name__}: {e})"
            store.set(f"{key}{dims.rank}", f"error:{message}")
            raise
        store.set(f"{key}{dims.rank}", "ok")
    start = last_log = time.monotonic()
    who = ", ".join(map(str, runners))
    dims.heartbeat.enter(f"waiting for rank(s) {who} to {what}")
    pending = [f"{key}{r}" for r in runners]
    while not store.check(pending):
        time.sleep(0.5 if time.monotonic() - start < 60 else 5.0)  # a long wait asks the store less often
        if time.monotonic() - last_log >= WAIT_LOG_S:
            last_log = time.monotonic()
            waited = f"{last_log - start:.0f} s so far; no timeout applies"
            print(f"torchacco: rank {dims.rank}: waiting for rank(s) {who} to {what} ({waited})", flush=True)
    message = next((v[6:] for v in (store.get(k).decode() for k in pending) if v.startswith("error:")), None)
    if message:
        raise UserError(message)


def destroy(barrier: bool = True) -> None:
    if dist.is_initialized():
        if barrier:  # else a rank can tear gloo down while a peer uses it ("terminate called without an active ...")
            dist.barrier()
        dist.destroy_process_group()
