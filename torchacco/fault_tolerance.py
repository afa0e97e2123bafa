"""Fault-tolerant DiLoCo replicas ([diloco] fault_tolerant; docs/reliability.md).

Each replica is a torchrun job of its own, so a failure stops one replica, not the run. They meet through
torchft: its lighthouse keeps the quorum of live replicas, each rank's `Manager` keeps a process group over the
ranks holding the same part of the model in every live replica, and a replica behind copies a live one's state.

One outer step is one torchft round: `start_quorum` (a replica behind heals there), the token-weighted exchange,
`should_commit`. A failed round is not committed and runs again with the replicas then present. A replica that
healed in the round sends zeros with weight 0 (its Δ is not one); a lost replica sends none."""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from torchacco.checkpoint import tensor_leaves
from torchacco.errors import PeerFailure, UserError

ENV_REPLICA = "TORCHACCO_REPLICA"  # this job's replica, 0 .. replicas - 1
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
ATTEMPTS = 5  # rounds an outer step may take before the replica gives up
# A replica silent this long is lost (its manager beats every 0.1 s): the others' next round goes on without it.
HEARTBEAT_TIMEOUT_MS = 2000
TORCHFT = "torchft==0.2.0"


def replica_of_job() -> int | None:
    """This job's replica in a fault-tolerant run (each replica its own job), else None."""
    value = os.environ.get(ENV_REPLICA)
    if value is None:
        return None
    if not value.strip().isdigit():
        raise UserError(f"{ENV_REPLICA}={value} is not a replica number; set it to 0, 1, ... (replicas - 1)")
    return int(value)


def job_world(world_size: int, diloco, parallelism) -> int:
    """The ranks of the whole run, from one job's: a fault-tolerant replica's job holds 1/replicas of them."""
    return world_size * parallelism.replicas if diloco.fault_tolerant and replica_of_job() is not None else world_size


def check_config(d, replicas: int) -> None:
    if not d.fault_tolerant:
        return
    refused = [(d.overlap_steps, "overlap_steps = 0"), (d.eager, "eager = false"), (d.topk, "topk = 0"),
               (d.balance_replicas, "balance_replicas = false"), (d.warm_start, "warm_start = 0"),
               (d.sync_every_max, "sync_every_max = 0"),
               (d.outer_momentum_decay, "outer_momentum_decay = false")]  # fmt: skip
    for value, fix in refused:
        if value:
            raise UserError("[diloco] fault_tolerant runs each outer step as one round of "
                            "the replicas present, which may run again, after a committed "
                            f"update; set {fix}, or fault_tolerant = false")  # fmt: skip
    if d.outer_dtype != "fp32":
        raise UserError("[diloco] fault_tolerant sends the pseudo-gradient as one fp32 all-reduce "
                        "over torchft's group (its gathers are not yet wired); set outer_dtype = "
                        f"'fp32' (got {d.outer_dtype!r}), or fault_tolerant = false")  # fmt: skip
    replica = replica_of_job()
    if replica is not None and replica >= replicas:
        raise UserError(f"{ENV_REPLICA}={replica}, but [parallelism] replicas = {replicas}: "
                        f"number the replicas' jobs 0 to {replicas - 1}")  # fmt: skip
    if not 1 <= d.min_replicas <= replicas:
        raise UserError(f"[diloco] min_replicas = {d.min_replicas} can never be met with [parallelism] "
                        f"replicas = {replicas}; set it between 1 and {replicas}")  # fmt: skip
    for name in ("join_timeout_s", "round_timeout_s"):
        if getattr(d, name) <= 0:
            raise UserError(f"[diloco] {name} = {getattr(d, name):g} must be positive")
    if importlib.util.find_spec("torchft") is None:  # (not imported here: it must load after _quiet_torchft)
        raise UserError("[diloco] fault_tolerant needs torchft; install it with "
                        f"`pip install {TORCHFT}` (or ./install.sh ft)")  # fmt: skip


def lighthouse_address(options) -> str:
    address = options.lighthouse or os.environ.get(ENV_LIGHTHOUSE, "")
    if not address:
        raise UserError("[diloco] fault_tolerant needs a lighthouse: start ./run_train.sh "
                        "on one machine (it starts one), or run `torchacco lighthouse` "
                        f"and set {ENV_LIGHTHOUSE} or [diloco] lighthouse")  # fmt: skip
    url = urlparse(address if "://" in address else f"http://{address}")
    deadline = time.monotonic() + 15.0
    while True:  # one line now, rather than a quorum that times out in half an hour
        try:
            socket.create_connection((url.hostname, url.port or 80), timeout=2.0).close()
            return address
        except (OSError, TypeError):
            if time.monotonic() > deadline:
                raise UserError(f"no lighthouse answers at {address} ([diloco] lighthouse or ${ENV_LIGHTHOUSE}); "
                                "start it (torchacco lighthouse) or correct the address") from None  # fmt: skip
            time.sleep(0.5)


def _address_towards(url: str) -> str:
    """This host's address on the route to `url` (what the other replicas reach it at, on a symmetric network)."""
    target = urlparse(url if "://" in url else f"http://{url}")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(target.hostname), target.port or 80))  # (UDP: nothing is sent)
        return s.getsockname()[0]


def _quiet_torchft() -> None:
    """Before torchft loads: its lighthouse and managers log every quorum at info."""
    os.environ.setdefault("RUST_LOG", "warn")


def start_lighthouse(min_replicas: int, join_timeout_s: float, bind: str = "[::]:0"):
    """torchft's lighthouse in this process (`.address()`, `.shutdown()`)."""
    _quiet_torchft()
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=int(join_timeout_s * 1000),
                            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)  # fmt: skip


class ReplicaLink:
    """This rank's place among the replicas: its torchft Manager, the round's group, and the heal."""

    def __init__(self, options, replica: int, replicas: int, dims, device_type: str, layout: str, log=print):
        self.options, self.dims, self.device_type = options, dims, device_type
        self.lighthouse = lighthouse_address(options)  # (reachable, or one line now)
        logging.getLogger("torchft").setLevel(logging.CRITICAL)  # (a failed round's traceback: its line says it)
        # torchft's state server logs every request, and its reader warns that the received buffers are read-only
        http.server.BaseHTTPRequestHandler.log_message = lambda *args, **kwargs: None
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        self.replica, self.replicas, self.log = replica, replicas, log
        self.layout = layout  # what a peer's state must match to be copied here, rank for rank
        self.healed = False
        self.present = replicas  # replicas in the last round
        self.copy_s, self.copy_bytes = 0.0, 0  # the last heal's copy alone (without the wait for the round)
        self._state: tuple[Callable[[], dict], Callable[[dict], None]] | None = None

    def heal_with(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a replica behind the others copies from one of them: `save()` on the donor, `load()` here. Then
        this replica joins torchft: only once it can train, so that the others never wait for it to start."""
        self._state = (save, load)
        _quiet_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.process_group import ManagedProcessGroup

        class TimedTransport(HTTPTransport):
            """torchft's HTTP state transfer, timed (what a heal's copy costs, apart from the wait for the round), at
            an address the other replicas reach (torchft's own names the host, which may resolve elsewhere)."""

            def address(self) -> str:
                return f"http://{here}:{self._server.socket.getsockname()[1]}/checkpoint/"

            def recv_checkpoint(self, *args, **kwargs):
                started = time.perf_counter()
                state = super().recv_checkpoint(*args, **kwargs)
                link.copy_s = time.perf_counter() - started
                link.copy_bytes = sum(t.numel() * t.element_size() for _, t in tensor_leaves(state))
                return state

        link, dims, lighthouse = self, self.dims, self.lighthouse
        here = _address_towards(lighthouse)
        # The round's transfers: a stalled peer fails the round after this, and the next runs without it. Its
        # quorum waits as long as a collective may (a replica restarting waits for the others' next outer step).
        timeout = timedelta(seconds=self.options.round_timeout_s)
        # torchft's store, new for each start of the replica: torchrun's outlives a restart, and a restarted rank
        # would read the manager address its predecessor left there
        port = torch.zeros(1, dtype=torch.int64, device=self.device_type)
        if dims.rank == 0:
            self._store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], 0, is_master=True,
                                                     wait_for_workers=False, timeout=dims.timeout)  # fmt: skip
            port.fill_(self._store.port)
        torch.distributed.broadcast(port, src=0)
        self.pg = (ProcessGroupNCCL if self.device_type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.options.min_replicas,
            use_async_quorum=False,  # a replica behind heals before its first exchange
            init_sync=False,  # a run starting (or resuming) together keeps each replica's own state
            rank=dims.rank,
            world_size=dims.world_size,
            replica_id=f"torchacco_{self.replica}",  # torchft reads the trailing digits
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(port.item()),
            lighthouse_addr=lighthouse,
            hostname=os.environ["MASTER_ADDR"],  # where the other replicas reach this one's manager
            timeout=timeout,
            quorum_timeout=dims.timeout,
            # (a heal copies about four times the pseudo-gradient's bytes: θ_global, momentum, the inner state)
            checkpoint_transport=TimedTransport(timeout=4 * timeout, num_chunks=0),
        )
        self.manager.register_state_dict_fn("torchacco", self._load, self._save)
        # The round's group: torchft's wrapper (on NCCL it aborts a lost peer's communicator) through the manager,
        # which records a failed collective and returns at once: a survivor never blocks, `should_commit` decides.
        self.group = ManagedProcessGroup(self.manager)

    def _save(self) -> dict:
        # every DTensor as this rank's local tensor (a peer at the same rank holds the same shard)
        return {"layout": self.layout, **tree_map_only(DTensor, DTensor.to_local, self._state[0]())}

    def _load(self, state: dict) -> None:
        if state["layout"] != self.layout:
            raise UserError(f"replica {self.replica} cannot heal from a replica laid out otherwise "
                            f"({state['layout']} against its {self.layout}): launch every replica "
                            "with the same ranks, parallelism and data_parallel")  # fmt: skip
        self._state[1](state)
        self.healed = True

    def _open(self) -> None:
        self.healed = False
        started = time.perf_counter()
        self.manager.start_quorum()
        if self.healed:  # (the time includes the wait for the others' round)
            self.log(f"torchacco: replica {self.replica} healed from a live replica in "
                     f"{time.perf_counter() - started:.1f} s (the copy: "
                     f"{self.copy_bytes / 2**20:.1f} MiB in {self.copy_s:.2f} s)")  # fmt: skip

    def join(self, running: Callable[[], bool], wait_s: float) -> bool:
        """The first rounds of a (re)starting replica. True: it healed into a running run, and the round is
        open (the caller takes part in the outer step the others are in, then `commit`s). False: the run
        starts (or resumes) here, with every replica present or after `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            self._open()
            if self.healed and running():
                return True
            # Uncommitted rounds until all are here: a replica's first commit would make a later one heal from it,
            # and replicas resuming their own checkpoints together must keep their own state.
            if self.manager.num_participants() >= self.replicas or time.monotonic() > deadline:
                self.manager.should_commit()
                self._count_present()
                return False
            time.sleep(0.2)

    def round(self, exchange: Callable[[object], torch.Tensor], opened: bool = False):
        """`exchange(group)` over the replicas present, as one committed round: its result. A replica that heals
        in the round finds `healed` set before its exchange. A round that fails runs again."""
        for attempt in range(1, ATTEMPTS + 1):
            if not opened:
                self._open()
            opened = False
            result = None
            if self.manager.errored() is None:
                try:
                    result = exchange(self.group)
                except Exception as e:  # a replica lost in the round: torchft decides, with every replica
                    # (torch's collective logger, formatting the error for a group it does not know, raises its own)
                    self.manager.report_error(e.__context__ if "world group map" in str(e) and e.__context__ else e)
            if self.manager.should_commit():
                self._count_present()
                return result
            error = self.manager.errored()
            cause = str(error.original_exception if error else "not committed").strip().splitlines()
            self.log(f"torchacco: replica {self.replica}: outer step round {attempt} failed "
                     f"({cause[-1][:160] if cause else 'no detail'}); again with the replicas present")  # fmt: skip
        raise PeerFailure(f"replica {self.replica}: the outer step failed in {ATTEMPTS} rounds "
                          "in a row; the lighthouse or this replica's link is down")  # fmt: skip

    def _count_present(self) -> None:
        present = self.manager.num_participants()
        if present != self.present:  # one line for each change: a replica lost, stalled, cut off, or back
            self.log(f"torchacco: replica {self.replica}: {present} of {self.replicas} replicas in this outer step "
                     f"(were {self.present})")  # fmt: skip
        self.present = present

    def close(self) -> None:
        if hasattr(self, "manager"):
            self.manager.shutdown(wait=False)


def unmerged_updates(metrics: Path) -> tuple[int, int]:
    """(first, last) of the updates a replica's previous run computed after its last outer step, from its
    metrics.jsonl (their pseudo-gradient died with it); (0, 0) when there are none. `last` is the last logged."""
    if not metrics.is_file():
        return 0, 0
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    merged = max((r["step"] for r in records if "outer_step" in r), default=0)
    last = records[-1]["step"] if records else 0
    return (merged + 1, last) if last > merged else (0, 0)


def copy_into(target, received):
    """`received` (a peer's state, its DTensors local) written into `target` (this rank's own state of the same shape):
    tensors in place (a DTensor's local shard), the rest replaced."""
    if isinstance(target, dict) and isinstance(received, dict):
        return {k: copy_into(target.get(k), v) for k, v in received.items()}
    if isinstance(target, (list, tuple)) and isinstance(received, (list, tuple)) and len(target) == len(received):
        return type(target)(copy_into(a, b) for a, b in zip(target, received))
    if isinstance(target, torch.Tensor) and isinstance(received, torch.Tensor):
        local = target.to_local() if isinstance(target, DTensor) else target
        if local.shape == received.shape:
            local.copy_(received)
            return target
        return received.to(local.device)
    return received


def main(argv: list[str] | None = None) -> int:
    """`torchacco lighthouse`: the lighthouse of a cluster's fault-tolerant run."""
    parser = argparse.ArgumentParser(prog="torchacco lighthouse", description=main.__doc__)
    parser.add_argument("--min-replicas", type=int, default=1, help="replicas a quorum needs")
    parser.add_argument("--join-timeout-s", type=float, default=60.0)
    parser.add_argument("--bind", default="[::]:29510")
    args = parser.parse_args(argv)
    server = start_lighthouse(args.min_replicas, args.join_timeout_s, args.bind)
    print(f"torchacco: lighthouse at {server.address()}; set {ENV_LIGHTHOUSE}={server.address()}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
    return 0
