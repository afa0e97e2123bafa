"""Typed configuration: small dataclass sections, loaded from TOML, overridden from the CLI.

`load_config(["--config", "x.toml", "--training.steps", "20"])` returns a `Config`.
Unknown sections or keys list the valid ones; a wrong type names the file, the key and
the expected type. Every error is a `UserError` (one line for the user, no traceback).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from torchacco.errors import UserError

DATA_PARALLEL = ("ddp", "zero1", "fsdp", "acco", "dpu", "wp")


@dataclass
class Job:
    name: str = "run"
    dump_folder: str = "outputs/run"  # every output of the run goes here
    description: str = ""
    overwrite: bool = False  # replace a different run's outputs in dump_folder (the same run always resumes)


@dataclass
class Model:
    name: str = "gpt_neo"  # a folder in models/
    flavor: str = "debug"
    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    compile: bool = False  # torch.compile each transformer block
    init_from: str = ""  # a Hugging Face folder (config.json + safetensors): its architecture and weights


@dataclass
class Tokenizer:
    path: str = ""  # a tokenizer.json to load; empty: train a byte-level BPE on the training data
    vocab_size: int = 10_000  # when training one


@dataclass
class Data:
    dataset: str = "embedded"  # "embedded" (Shakespeare, Milton, KJV bible) or a file / directory
    format: str = "auto"  # auto | text | jsonl | alpaca
    text_field: str = "text"  # the field of .jsonl records holding the text
    validation: str = ""  # separate validation file/dir; empty: split off val_fraction
    val_fraction: float = 0.02
    cache_dir: str = ""  # token caches and the embedded corpus; empty: $TORCHACCO_CACHE or ~/.cache/torchacco


@dataclass
class Training:
    seq_len: int = 256
    local_batch_size: int = 8  # sequences per micro-batch on one rank
    global_batch_size: int = 0  # sequences per optimizer step over all ranks; 0: local × world (no accumulation)
    steps: int = 100  # optimizer steps
    max_tokens: int = 0  # stop after this many tokens (all ranks); 0: no limit
    max_norm: float = 1.0  # gradient clipping; 0 disables
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    mixed_precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    num_threads: int = 0  # CPU threads per rank; 0: cores / local ranks
    collective_timeout_s: float = 1800.0  # a collective waiting longer than this fails the run (a dead peer)
    on_nonfinite: str = "abort"  # a NaN/Inf loss or gradient: "abort" the run, or "skip" the update
    max_skips_in_a_row: int = 3  # with "skip": abort after this many consecutive skipped updates


@dataclass
class Optimizer:
    name: str = "adamw"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases and embeddings


@dataclass
class LRSchedule:
    warmup_steps: int = 0  # converted to tokens with the nominal tokens per step
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1


@dataclass
class Parallelism:
    data_parallel: str = "ddp"  # ddp | zero1 | fsdp | acco | dpu | wp
    reshard_after_forward: bool = True  # fsdp
    bucket_cap_mb: float = 25.0  # ddp
    reduce_dtype: str = "fp32"  # fsdp gradient reduction: fp32 | bf16 (zero1 reduces in the compute dtype)
    tensor_parallel_degree: int = 1  # ranks sharing each layer's matmuls (inside a node); dp = world / (tp × pp)
    pipeline_parallel_degree: int = 1  # pipeline stages, split by layer
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b (two stages per rank)
    pipeline_microbatches: int = 0  # pieces each local batch is split into; 0: the number of stages


@dataclass
class Acco:
    """The overlapped schedules: acco, dpu and wp."""

    mode: str = "deterministic"  # deterministic: accumulation micro-batches per period, then wait for the job;
    # adaptive: at least that many, then keep accumulating until the job is done
    accumulator_dtype: str = "fp32"  # fp32 | bf16 (the paper's choice)
    max_micro_batches: int = 0  # adaptive: at most this many micro-batches per period and rank; 0: no cap
    dpu_warmup_steps: int = 0  # dpu: synchronous updates before the one-step delay starts
    drift_every: int = 10  # log ‖θ̃ − θ‖ / ‖θ‖ every this many commits (acco); 0 disables


@dataclass
class Eval:
    every: int = 50  # steps between validation passes; 0 disables
    batches: int = 8  # micro-batches per validation pass and rank


@dataclass
class Metrics:
    log_every: int = 10
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class Checkpoint:
    enable: bool = False
    every: int = 0  # steps between checkpoints; 0: only at the end of training
    folder: str = "checkpoint"  # inside the dump folder (shared by all nodes)
    keep: int = 2  # the most recent checkpoints kept; 0 keeps all
    resume: bool = True  # continue from the latest checkpoint in the folder, if there is one
    load_path: str = ""  # resume from this step-N folder instead (e.g. another run's)
    async_save: bool = False  # write in the background while training continues
    export_hf: bool = False  # at the end, write θ as a Hugging Face folder (<dump_folder>/hf)
    export_dtype: str = "fp32"  # fp32 | bf16


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    tokenizer: Tokenizer = field(default_factory=Tokenizer)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    parallelism: Parallelism = field(default_factory=Parallelism)
    acco: Acco = field(default_factory=Acco)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            # JSON's literals and escapes are TOML's; non-ASCII text stays as it is (TOML has no \ud83d pairs).
            lines += [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in values.items()]
            lines.append("")
        return "\n".join(lines)


CHOICES = {
    ("parallelism", "data_parallel"): DATA_PARALLEL,
    ("training", "device"): ("auto", "cpu", "cuda"),
    ("training", "mixed_precision"): ("auto", "bf16", "fp32"),
    ("training", "on_nonfinite"): ("abort", "skip"),
    ("lr_schedule", "decay"): ("cosine", "linear", "constant"),
    ("data", "format"): ("auto", "text", "jsonl", "alpaca"),
    ("parallelism", "reduce_dtype"): ("fp32", "bf16"),
    ("parallelism", "pipeline_schedule"): ("gpipe", "1f1b", "interleaved_1f1b"),
    ("optimizer", "name"): ("adamw",),
    ("acco", "mode"): ("deterministic", "adaptive"),
    ("checkpoint", "export_dtype"): ("fp32", "bf16"),
    ("acco", "accumulator_dtype"): ("fp32", "bf16"),
}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def _key_types(section_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _convert(value, expected: type, where: str, from_cli: bool):
    """Check a TOML value's type, or convert a CLI string to the field's type."""
    if isinstance(expected, types.UnionType):
        expected = next(t for t in typing.get_args(expected) if t is not type(None))
    if from_cli and expected is not str:
        text = value.strip()
        try:
            if expected is bool:
                if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return text.lower() in ("true", "1", "yes")
            if expected is int:
                number = float(text)  # accepts "1e6" for token counts, but only whole numbers
                if not number.is_integer():
                    raise ValueError
                return int(number)
            return expected(text)
        except ValueError:
            raise UserError(f"{where}: expected {expected.__name__}, got '{value}'") from None
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise UserError(f"{where}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, section: str, key: str, value, origin: str, from_cli: bool = False) -> None:
    sections = _sections()
    if section not in sections:
        raise UserError(f"{origin}: unknown section [{section}]; valid sections: {', '.join(sections)}")
    keys = _key_types(sections[section])
    if key not in keys:
        raise UserError(f"{origin}: unknown key '{key}' in [{section}]; valid keys: {', '.join(keys)}")
    value = _convert(value, keys[key], f"{origin}: [{section}] {key}", from_cli)
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{origin}: [{section}] {key} = {value} is not a finite number; give a finite value")
    choices = CHOICES.get((section, key))
    if choices is not None and value not in choices:
        raise UserError(f"{origin}: [{section}] {key} = {value!r} is not one of: {', '.join(choices)}")
    setattr(getattr(cfg, section), key, value)


def config_from_dict(data: dict, origin: str = "config") -> Config:
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise UserError(f"{origin}: '{section}' must be a [section] table, not a plain value")
        for key, value in values.items():
            _set(cfg, section, key, value, origin)
    return cfg


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path} (pass --config train_configs/<name>.toml)")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: TOML syntax error: {e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not a UTF-8 text file (byte {e.start}); a config is a TOML text file") from None


def parse_overrides(argv: list[str]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """Split `--config FILE --section.key VALUE ...` into the file and the overrides."""
    config_file, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise UserError(f"unexpected argument {arg!r}; use --config FILE and --section.key VALUE")
        name, eq, inline = arg[2:].partition("=")
        if eq:
            value, i = inline, i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:
            raise UserError(f"{arg!r} needs a value")
        if name in ("config", "job.config_file"):
            config_file = value
            continue
        section, dot, key = name.partition(".")
        if not dot or not key:
            raise UserError(f"{arg!r}: overrides are written --section.key VALUE (e.g. --training.steps 20)")
        overrides.append((section, key, value))
    return config_file, overrides


def load_config(argv: list[str]) -> Config:
    config_file, overrides = parse_overrides(argv)
    cfg = config_from_dict(load_toml(config_file), str(config_file)) if config_file else Config()
    for section, key, value in overrides:
        _set(cfg, section, key, value, f"--{section}.{key}", from_cli=True)
    return cfg
