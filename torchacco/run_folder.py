"""The dump folder: one run's outputs, never mixed with another run's.

A folder holding a run (its `config.toml`) is reused only by the same run: the same config but for `MAY_CHANGE`,
keys that do not change what is trained (so a run can be resumed with more steps, another eval cadence or a longer
timeout). Anything else would resume another run's checkpoints; `--job.overwrite true` removes them first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from torchacco.config import Config, config_from_dict, load_toml
from torchacco.errors import UserError

MAY_CHANGE = {
    "job.description",
    "job.overwrite",
    "job.dump_folder",
    "training.steps",
    "training.max_tokens",
    "training.local_batch_size",
    "training.global_batch_size",  # e.g. on resuming with fewer ranks
    "training.collective_timeout_s",
    "training.num_threads",
    "training.on_nonfinite",
    "training.max_skips_in_a_row",
    "training.device",
    "data.cache_dir",
}
MAY_CHANGE_SECTIONS = {"metrics", "eval", "checkpoint", "profiling", "preemption"}
OUTPUTS = ("config.toml", "metrics.jsonl", "tb", "hf")  # and the checkpoint folder


def _flat(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, values in cfg.to_dict().items() for key, value in values.items()}


def differences(old: Config, new: Config) -> list[str]:
    """The keys that make `new` a different run from `old`."""
    a, b = _flat(old), _flat(new)
    return [k for k in a if a[k] != b[k] and k not in MAY_CHANGE and k.split(".")[0] not in MAY_CHANGE_SECTIONS]


def check(cfg: Config, folder: Path) -> Config | None:
    """Refuse `folder` unless it is free for `cfg`, or holds this same run (read only: validation runs it before any
    worker starts). Returns the different run it holds when `cfg` may overwrite it, else None."""
    recorded = folder / "config.toml"
    if folder.is_file():
        raise UserError(f"--job.dump_folder {folder} is a file; choose a folder")
    if recorded.is_file():
        try:
            old = config_from_dict(load_toml(recorded), str(recorded))
        except UserError as e:
            # Not knowing what the folder holds, never delete it, even when told to overwrite.
            raise UserError(
                f"dump folder {folder} holds a run whose config.toml cannot be read ({e}); torchacco will not delete "
                "it: choose another --job.dump_folder, or remove that folder yourself"
            ) from None
        changed = differences(old, cfg)
        if changed and not cfg.job.overwrite:
            shown = ", ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
            raise UserError(
                f"dump folder {folder} holds a different run (differs in {shown}); resuming it would mix the two. "
                "Choose another --job.dump_folder, or pass --job.overwrite true to delete that run's outputs"
            )
        return old if changed else None
    if folder.is_dir() and any(_foreign(folder)) and not cfg.job.overwrite:
        raise UserError(
            f"dump folder {folder} is not empty and holds no torchacco run; choose another --job.dump_folder (or "
            "pass --job.overwrite true to write into it anyway)"
        )
    return None


def prepare(cfg: Config, folder: Path) -> None:
    """Check and create `folder` for `cfg` (rank 0, before any other rank writes there)."""
    if (replaced := check(cfg, folder)) is not None:
        _remove_outputs(folder, replaced.checkpoint.folder, cfg)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        written = folder / "config.toml.tmp"  # then renamed: another job's validation never reads half a file
        written.write_text(cfg.to_toml(), encoding="utf-8")  # as load_toml reads it
        written.replace(folder / "config.toml")
    except OSError as e:
        raise UserError(
            f"cannot write to dump folder {folder}: {e.strerror}; choose another --job.dump_folder"
        ) from None


def _foreign(folder: Path):
    """What a run did not write: all but the folders of a fault-tolerant run's other replicas (replica_1, ...),
    which may start before replica 0 writes config.toml, and the launcher's per-rank logs."""
    return (p for p in folder.iterdir() if not (p.is_dir() and (p.name.startswith("replica_") or p.name == "logs")))


def _remove_outputs(folder: Path, checkpoint_folder: str, cfg: Config) -> None:
    paths = [folder / name for name in (*OUTPUTS, checkpoint_folder)]
    # This run may start from the old run's outputs (init_from its hf export, say): keep them.
    inputs = {
        "[model] init_from": cfg.model.init_from,
        "[checkpoint] load_path": cfg.checkpoint.load_path,
        "[tokenizer] path": cfg.tokenizer.path,
    }
    for what, value in inputs.items():
        if value and any(Path(value).resolve().is_relative_to(p.resolve()) for p in paths):
            raise UserError(
                f"--job.overwrite true would delete {what} = {value}, which this run reads; copy it out of the dump "
                "folder first, or choose another --job.dump_folder"
            )
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def check_space(folder: Path, need: int, n_params: int) -> None:
    """Fail before training, not at the first checkpoint, when the disk cannot hold one of `need` bytes."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise UserError(
            f"dump folder {folder} has {free / 2**30:.2f} GiB free but a checkpoint of this {n_params / 1e6:.1f}M-"
            f"parameter run needs about {need / 2**30:.2f} GiB; free some space, choose another --job.dump_folder, "
            "or set [checkpoint] enable = false"
        )
