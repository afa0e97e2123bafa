"""Training checkpoints with torch.distributed.checkpoint (DCP), taken between two updates (docs/checkpoints.md).

`checkpoint_state()` is the one schema the trainer and `torchacco.export` share. A save writes `step-N.tmp/`, which
rank 0 renames to `step-N/` once every rank has finished: a `step-N` folder is always complete."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from torchacco.config import Checkpoint as CheckpointConfig
from torchacco.errors import UserError
from torchacco.parallel.collectives import HOST_GROUPS
from torchacco.parallel.process_groups import on_one_rank

STEP_DIR = re.compile(r"^step-(\d+)$")


class TrainState(Stateful):
    def __init__(self, dp_size: int = 1):
        self.step, self.tokens = 0, 0.0
        self.dp_size = dp_size  # ranks reading different data (replicas × dp) of the run that saved it, after a load
        self.skipped = self.skips_in_a_row = 0  # updates skipped for a non-finite loss or gradient

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for key in vars(self):
            setattr(self, key, state[key])


class RankState(Stateful):
    """What differs per rank: its data-loader position and RNG streams."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        state = {"dataloader": self.loader.state_dict(), "cpu_rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda_rng"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["dataloader"])
        torch.set_rng_state(state["cpu_rng"])
        if "cuda_rng" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = ((STEP_DIR.match(p.name), p) for p in folder.iterdir() if p.is_dir())
    return sorted((int(m.group(1)), p) for m, p in found if m)


def _state_dicts(state: dict) -> dict:
    """`state` with each Stateful replaced by its state dict (what DCP saves of it)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


class HostStaging(AsyncStager):
    """A host copy of the state that training can no longer change (asynchronous saves): pinned on CUDA, so
    the GPU keeps no second copy. Allocated at the first save, reused while the state keeps its shapes. DCP's
    stager for `dcp.async_save`, which then writes this copy: the only one on the host (its default stager would
    copy it again)."""

    _synchronize_after_execute = False  # the copy is complete when `stage` returns

    def __init__(self):
        self.staged = None

    def stage(self, state: dict) -> dict:
        plain = _state_dicts(state)
        pin = any(t.is_cuda for _, t in tensor_leaves(plain))  # (a CPU run has nothing to pin)
        if self.staged is None or _layout(plain) != _layout(self.staged):
            self.staged = _create_cpu_state_dict(plain, pin_memory=pin)
        staged = _copy_state_dict(plain, self.staged, non_blocking=pin)  # (with this save's ints and strings)
        if pin:
            torch.cuda.synchronize()  # the copies are complete before training changes the state
        return staged


def staging_bytes(state: dict) -> int:
    """The host bytes one rank's asynchronous save holds: its local tensors, each once, as `HostStaging` copies them
    (a strategy's state dict holds AdamW's moments from the start: `Replicated.state_dict`)."""
    local = [t.to_local() if isinstance(t, DTensor) else t for _, t in tensor_leaves(_state_dicts(state))]
    return sum(t.numel() * t.element_size() for t in local)


SHARED_CHECK = ".torchacco-shared-check"
SHARED_CHECK_TRIES = 6  # 0.5 s apart


def check_shared(folder: Path, dims) -> None:
    """Refuse, before training, a checkpoint folder that some node does not see (a node-local disk), where
    the first save would fail or leave parts behind: every rank writes into the one folder rank 0 publishes."""
    if dims.world_size == dims.local_world_size:
        return  # one node
    store = dist.distributed_c10d._get_default_store()
    key = "torchacco/shared-check"

    def write() -> None:
        token = uuid.uuid4().hex
        folder.mkdir(parents=True, exist_ok=True)
        (folder / SHARED_CHECK).write_text(token)
        store.set(key, token)

    def read() -> None:
        marker, token = folder / SHARED_CHECK, store.get(key).decode()
        for _ in range(SHARED_CHECK_TRIES):  # a network filesystem may show another node's new file late
            if marker.is_file() and marker.read_text() == token:
                return
            time.sleep(0.5)
        node = dims.rank // dims.local_world_size
        named = folder if folder.is_absolute() else f"{folder} ({folder.absolute()} on node {node})"
        raise UserError(f"the checkpoint folder {named} is not shared: node {node} ({socket.gethostname()}) does "
                        "not see what rank 0 wrote there. Every rank writes its part of a checkpoint into one "
                        "folder: put --job.dump_folder (which holds the checkpoint folder) on a filesystem every "
                        "node mounts, at the same path on each, or set [checkpoint] enable = false")  # fmt: skip

    on_one_rank(dims, write, main_only=True, what="check that the checkpoint folder is shared")
    on_one_rank(dims, read, what="check that the checkpoint folder is shared")
    on_one_rank(dims, lambda: (folder / SHARED_CHECK).unlink(missing_ok=True), main_only=True, what="clean up")


def checkpoint_bytes(state: dict, n_params: int) -> int:
    """The bytes a checkpoint of `state` writes over all ranks: each tensor at its global size (a sharded one
    once), plus AdamW's two fp32 moments per parameter where torch's AdamW creates them only at its first step."""
    total = optimizer = 0
    for path, t in tensor_leaves(_state_dicts(state)):
        size = t.numel() * t.element_size()  # a DTensor's numel() is its global one
        total += size
        optimizer += size if "optim" in path else 0
    return total + max(0, 8 * n_params - optimizer)


def tensor_leaves(tree) -> list[tuple[str, torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, lists and tuples (a DTensor whole, at its global size)."""
    return [(keystr(path), t) for path, t in tree_flatten_with_path(tree)[0] if isinstance(t, torch.Tensor)]


def _layout(tree):
    """`tree` with each tensor as its (shape, dtype) and every other value as None: what a staging copy keeps."""
    return tree_map(lambda x: (x.shape, x.dtype) if isinstance(x, torch.Tensor) else None, tree)


class Checkpointer:
    def __init__(self, folder: Path, rank: int, keep: int, async_save: bool, timeout: timedelta | None = None):
        self.folder, self.rank, self.keep, self.async_save = folder, rank, keep, async_save
        # their own group: an asynchronous save never interleaves with the training collectives
        self.group = dist.new_group(backend="gloo", timeout=timeout)
        HOST_GROUPS.add(self.group)
        self.in_flight: tuple | None = None
        self.staging = HostStaging()

    def latest(self) -> Path | None:
        dirs = step_dirs(self.folder)
        return dirs[-1][1] if dirs else None

    def agreed_latest(self) -> Path | None:
        """The latest checkpoint as rank 0 lists it, on every rank (a node's listing may be stale)."""
        chosen = [self.latest() if self.rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0, group=self.group)
        return chosen[0]

    def save(self, step: int, state: dict) -> None:
        self.wait()
        final = self.folder / f"step-{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        self._on_rank_0(final, lambda: _fresh_folder(tmp))
        with self._write_errors(final):
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group, async_stager=self.staging)
                self.in_flight = (future, tmp, final)
            else:
                dcp.save(state, checkpoint_id=tmp, process_group=self.group)
                self._publish(tmp, final)

    def wait(self) -> None:
        if self.in_flight is not None:
            future, tmp, final = self.in_flight
            self.in_flight = None
            with self._write_errors(final):
                future.result()
            self._publish(tmp, final)

    @contextlib.contextmanager
    def _write_errors(self, final: Path):
        """A failed write (disk full, permissions) is one clear line; the earlier checkpoints stay intact."""
        try:
            yield
        except (OSError, CheckpointException) as e:
            causes = _causes(e) or [e]
            reason = next((c.strerror for c in causes if isinstance(c, OSError) and c.strerror), None)
            reason = reason or str(causes[0]).strip().splitlines()[-1][:160]
            free = shutil.disk_usage(self.folder).free / 2**20 if self.folder.exists() else 0.0
            reason += f"; {free:.0f} MiB free on its disk"
            done = [p.name for _, p in step_dirs(self.folder)]
            kept = f"the earlier checkpoint {done[-1]} is intact" if done else "no earlier checkpoint exists"
            raise UserError(f"could not write checkpoint {final} ({reason}); {kept}. Free some space or "
                            "fix the folder's permissions, then run again to resume") from None  # fmt: skip

    def _publish(self, tmp: Path, final: Path) -> None:
        dist.barrier(group=self.group)  # every rank has written its part
        self._on_rank_0(final, lambda: self._rename(tmp, final))

    def _rename(self, tmp: Path, final: Path) -> None:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # atomic: `step-N` appears complete or not at all
        for _, old in step_dirs(self.folder)[: -self.keep] if self.keep else []:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.folder.glob("step-*.tmp"):
            if stale != tmp:
                shutil.rmtree(stale, ignore_errors=True)

    def _on_rank_0(self, final: Path, fn) -> None:
        """Rank 0 alone changes the folder while the others wait; its failure fails every rank at once with its
        message, not after the collective timeout."""
        error = None
        if self.rank == 0:
            try:
                with self._write_errors(final):
                    fn()
            except UserError as e:
                error = str(e)
        shared = [error]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        if shared[0]:
            raise UserError(shared[0])

    def load(self, path: Path, state: dict) -> None:
        if not (path / ".metadata").is_file():
            raise UserError(f"{path} is not a complete torchacco checkpoint (no .metadata); "
                            "point [checkpoint] load_path at a step-N folder")  # fmt: skip
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.group)
        except CheckpointException as e:  # a BaseException: DCP failed on some rank
            causes = _causes(e)
            first = causes[0] if causes else None
            if isinstance(first, UserError):
                raise first from None
            cause = str(first).strip().splitlines()[0][:160] if causes and str(first).strip() else "unknown"
            if causes and (any(w in cause.lower() for w in ("mismatch", "missing key")) or isinstance(first, KeyError)):
                raise UserError(f"cannot resume from {path}: it does not match this run's model, optimizer "
                                f"or data_parallel strategy ({cause}); resume with the config it was saved "
                                "with, or start a new --job.dump_folder") from None  # fmt: skip
            earlier = [p for _, p in step_dirs(path.parent) if p != path]
            hint = f"--checkpoint.load_path {earlier[-1]}" if earlier else "a new --job.dump_folder"
            raise UserError(f"cannot read checkpoint {path}, it may be corrupted "
                            f"({type(first).__name__ if causes else 'error'}: {cause}); "
                            f"resume from an earlier one with {hint}") from None  # fmt: skip

    def close(self) -> None:
        self.wait()
        dist.destroy_process_group(self.group)


def _causes(e: BaseException) -> list:
    """The exceptions behind a DCP failure (its `failures` hold (exception, traceback) pairs)."""
    return [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]


def _fresh_folder(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def checkpoint_state(strategy, state: TrainState, loader, dims, with_rank_state: bool = True) -> dict:
    """What a checkpoint holds: the schema both the trainer and the offline export read."""
    rank_state = {f"rank{dims.rank}": RankState(loader)} if with_rank_state else {}
    return {"train": state, strategy.checkpoint_key(dims): strategy, **rank_state}


def resume(
    c: CheckpointConfig, folder: Path, dims, strategy, state: TrainState, loader, timeout: timedelta
) -> tuple[Checkpointer | None, str | None]:
    """The checkpointer (None when checkpoints are off) and, after loading the checkpoint to resume from (if
    any), a line saying what was resumed."""
    if not c.enable:
        return None, None
    checkpointer = Checkpointer(folder / c.folder, dims.rank, c.keep, c.async_save, timeout)
    path = Path(c.load_path) if c.load_path else checkpointer.agreed_latest() if c.resume else None
    if path is None:
        return checkpointer, None
    checkpointer.load(path, {"train": state})
    same_ranks = state.dp_size == dims.data_size
    if not same_ranks and strategy.traits.resume_needs_same_ranks:
        raise UserError(f"{path} holds {strategy.name}'s per-rank state (in-flight accumulators, "
                        f"or a replica's shard) of {state.dp_size} data-parallel ranks; resume it "
                        f"on {state.dp_size} ranks (this run has {dims.data_size})")  # fmt: skip
    # Weights and optimizer state reshard onto any number of ranks; a rank's data position only on as many ranks
    checkpointer.load(path, checkpoint_state(strategy, state, loader, dims, with_rank_state=same_ranks))
    message = f"resumed from {path} at step {state.step} ({int(state.tokens):,} tokens)"
    if not same_ranks:
        message += f"; data-parallel ranks changed ({state.dp_size} -> {dims.data_size}): weights and optimizer "
        message += "state resharded, the data order restarts"
    state.dp_size = dims.data_size
    return checkpointer, message
