"""Typed configuration: small dataclass sections, loaded from TOML, overridden from the CLI.

`load_config(["--config", "x.toml", "--training.steps", "20"])` returns a `Config`. Each key is declared once, with its
type (`Literal[...]` for a fixed set of choices), its default and a line of help: the loader checks values against it
and `docs/configuration.md` is generated from it (`python -m torchacco config > docs/configuration.md`). Unknown
sections or keys list the valid ones; a wrong type names the file, the key and the expected type. Every error is a
`UserError` (one line for the user, no traceback)."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import sys
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from torchacco.errors import UserError
from torchacco.options import Options, key
from torchacco.parallel import registry


@dataclass
class Job:
    name: str = key("run", "a name for the run")
    dump_folder: str = key("outputs/run", "every output of the run goes here")
    description: str = key("", "free text, kept in config.toml")
    overwrite: bool = key(False, "replace a different run's outputs in dump_folder (the same run always resumes)")
    cluster: str = key("", "the cluster it is written for, NODESxGPUS (e.g. 4x8): what a bare `--dry-run` checks")


@dataclass
class Model:
    name: str = key("gpt_neo", "a folder of models/, or an importable module (pkg.module) whose `spec` is a ModelSpec")
    flavor: str = key("debug", "one of the model's flavors (sizes)")
    vocab_size: int = key(0, "0: the tokenizer's vocabulary size")
    compile: bool = key(False, "torch.compile each transformer block (a train() model without blocks: the whole model)")
    init_from: str = key("", "a Hugging Face folder (config.json + safetensors): its architecture and weights")


@dataclass
class Tokenizer:
    path: str = key("", "a tokenizer.json to load; empty: train a byte-level BPE on the training data")
    vocab_size: int = key(10_000, "vocabulary of the BPE trained when path is empty")


@dataclass
class Data:
    dataset: str = key("embedded", '"embedded" (Shakespeare, Milton, KJV) or a file, '
                       "folder, glob of .txt, .jsonl, Alpaca .json, .parquet")  # fmt: skip
    format: Literal["auto", "text", "jsonl", "alpaca", "parquet"] = key(
        "auto",
        "how to read the dataset files. auto: by suffix and content; .jsonl records and .parquet rows with "
        "instruction and output are Alpaca. parquet: the text_field column, needs pyarrow (torchacco[parquet])",
    )
    text_field: str = key("text", "the text's field of .jsonl records (column of .parquet, or of a train() Dataset)")
    validation: str = key("", "separate validation file, folder or glob pattern; empty: split off val_fraction")
    val_fraction: float = key(0.02, "share of the documents held out for validation")
    cache_dir: str = key("", "token caches and the embedded corpus; empty: $TORCHACCO_CACHE or ~/.cache/torchacco")


@dataclass
class Training:
    seq_len: int = key(256, "tokens per sequence")
    local_batch_size: int = key(8, "sequences per micro-batch on one rank")
    global_batch_size: int = key(0, "sequences per update, all ranks; 0: local × data-parallel ranks, no accumulation")
    steps: int = key(100, "optimizer updates")
    max_tokens: int = key(0, "stop after this many tokens (all ranks); 0: no limit")
    max_norm: float = key(1.0, "gradient clipping by global norm; 0 disables")
    seed: int = key(0, "initialisation and data order")
    device: Literal["auto", "cpu", "cuda"] = key("auto", "auto: CUDA when present")
    mixed_precision: Literal["auto", "bf16", "fp32"] = key("auto", "compute dtype; auto: bf16 on CUDA, fp32 on CPU")
    activation_checkpoint: Literal["none", "selective", "full"] = key(
        "none", "recompute activations in backward instead of keeping them: every block (full), or selectively"
    )
    selective_checkpoint: str = key("op", "selective: 'op' keeps matmul and attention outputs, "
                                    "recomputes the rest; k checkpoints every k-th block")  # fmt: skip
    loss_chunks: int = key(1, "pieces of the sequence the cross-entropy runs over (fp32 logits for one at a time)")
    num_threads: int = key(0, "CPU threads per rank; 0: cores / local ranks")
    collective_timeout_s: float = key(1800.0, "a collective waiting longer than this fails the run (a dead peer)")
    on_nonfinite: Literal["abort", "skip"] = key("abort", "NaN/Inf loss or gradient: abort the run, or skip the update")
    max_skips_in_a_row: int = key(3, "with on_nonfinite = skip: abort after this many consecutive skipped updates")


@dataclass
class Optimizer:
    name: Literal["adamw", "muon"] = key(
        "adamw", "the optimizer; muon: Muon on the blocks' matrices, AdamW on the rest, one lr (docs/optimizers.md)"
    )
    lr: float = key(1e-3, "peak learning rate")
    beta1: float = key(0.9, "AdamW β1")
    beta2: float = key(0.95, "AdamW β2")
    eps: float = key(1e-8, "AdamW ε")
    weight_decay: float = key(0.1, "decoupled weight decay; not applied to norms, biases and embeddings")
    slow_beta: float = key(0.0, "β of a second, slow first moment in the step (MT-DAO's, e.g. 0.99); 0: off")
    slow_weight: float = key(0.5, "with slow_beta: the slow moment's share of the step's direction; β1's has the rest")
    muon_momentum: float = key(0.95, "muon: the Nesterov momentum of the matrices' steps")
    ns_steps: int = key(5, "muon: Newton–Schulz iterations that orthogonalise each matrix's step")


@dataclass
class LRSchedule:
    warmup_steps: int = key(0, "warm-up, converted to tokens with the nominal tokens per update")
    decay: Literal["cosine", "linear", "constant"] = key("cosine", "shape after warm-up, indexed by tokens")
    min_lr_ratio: float = key(0.1, "final learning rate as a fraction of the peak")


@dataclass
class Parallelism:
    data_parallel: str = key(
        registry.default_name, "the data-parallel strategy (docs/parallelism.md)", choices=registry.names
    )
    reshard_after_forward: bool = key(True, "fsdp: free gathered parameters after forward")
    accumulate_unsharded: bool = key(False, "fsdp, hsdp: keep an unsharded gradient of every parameter (4 bytes each "
                                     "in fp32) across an update's micro-batches and reduce once, on the last (less "
                                     "traffic, for slow links); false: reduce-scatter every micro-batch (hsdp: "
                                     "inside a node, with the all-reduce across nodes once per update)")  # fmt: skip
    bucket_cap_mb: float = key(0.0, "ddp: gradient bucket size in MiB; 0: torch's default, 25 MiB "
                               "buckets after a first one of 1 MiB whose all-reduce starts early in the "
                               "backward (a model smaller than one bucket overlaps nothing)")  # fmt: skip
    reduce_dtype: Literal["fp32", "bf16"] = key(
        "fp32",
        "computing in bf16, fsdp, zero1, acco, dpu, wp: the dtype gradients are summed in over the dp ranks (a ring "
        "rounds at every hop; fp32 as FSDP2's default); acco, dpu, wp: fp32 costs 2 more bytes per parameter",
    )
    tensor_parallel_degree: int = key(1, "ranks sharing each layer's matmuls, in a node; dp = world / (replicas·tp·pp)")
    pipeline_parallel_degree: int = key(1, "pipeline stages, split by layer")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = key(
        "1f1b", "pipeline schedule; interleaved_1f1b runs two stages per rank"
    )
    pipeline_microbatches: int = key(0, "pieces each local batch is split into; 0: the number of stages")
    loss_parallel: bool = key(True, "tp without pp: logits stay split by vocabulary, the loss computed on the shards")
    balance_batches: bool = key(False, "split each update's micro-batches between the data-parallel ranks "
                                "by their measured speed, the global batch fixed (mixed or throttled "
                                "GPUs); ddp, zero1, acco, dpu, wp; not fsdp, nor with tp/pp")  # fmt: skip
    replicas: int = key(1, "model replicas that train apart and meet every [diloco] "
                        "sync_every updates (DiLoCo; docs/diloco.md); data_parallel then runs "
                        "inside each replica. 1: one replica, no outer step")  # fmt: skip


@dataclass
class DiLoCo:
    """The outer step of DiLoCo and Streaming DiLoCo across [parallelism] replicas (docs/diloco.md)."""

    sync_every: int = key(100, "H: inner updates between two outer steps of each fragment")
    outer_lr: float = key(0.7, "the outer Nesterov SGD's learning rate (1 with momentum 0: plain averaging)")
    outer_momentum: float = key(0.9, "the outer Nesterov SGD's momentum")
    outer_momentum_warmup: int = key(0, "W: the k-th outer step of a fragment has momentum "
                                     "outer_momentum · min(1, k / W) (Pier); 0: off")  # fmt: skip
    outer_momentum_decay: bool = key(False, "the outer momentum also follows the inner learning "
                                     "rate down (Pier): μ·η_t / η_peak at the outer step after "
                                     "an update at η_t, η_peak the largest so far")  # fmt: skip
    fragments: int = key(1, "P: Streaming DiLoCo's fragments (contiguous blocks), "
                         "one syncing every H/P updates in turn")  # fmt: skip
    overlap_steps: int = key(0, "τ: inner updates a fragment's all-reduce runs beside before its outer step; < H / P")
    mixing: float = key(0.0, "α: after an overlapped outer step, θ ← (1 − α)·θ_global + "
                        "α·θ_local (0 drops τ local updates; paper: 0.5)")  # fmt: skip
    outer_dtype: Literal["fp32", "bf16", "int8", "int4", "int2"] = key(
        "fp32",
        "the pseudo-gradient on the wire: fp32 (all-reduce), or bf16 / int8 / int4 / int2 with one scale per row "
        "of 256 (per chunk of 4096 with topk), all-gathered and summed in fp32",
    )
    topk: float = key(0.0, "fraction of each 4096-element chunk of the pseudo-gradient sent: its "
                      "largest magnitudes (Elias–Fano-coded offsets, outer_dtype values); the rest "
                      "is fed into the next outer step's (SparseLoCo). 0 sends all")  # fmt: skip
    error_decay: float = key(0.95, "β with topk: the residual not yet sent is multiplied by β at each outer step")
    topk_mean: Literal["senders", "replicas"] = key(
        "senders",
        "with topk, each element's token-weighted mean over the replicas that sent it, counted as at least half of "
        "all tokens (an element moves by at most twice its share; less loss per token with 2 and 4 replicas), or "
        "over every replica (0 for one that did not send it: SparseLoCo's rule)",
    )
    warm_start: int = key(0, "inner updates at the start after each of which the replicas "
                          "average θ (fp32, all fragments; post-local SGD) before the outer "
                          "steps begin; a multiple of sync_every / fragments")  # fmt: skip
    sync_every_max: int = key(0, "QSR (arXiv 2310.14423): above sync_every, H grows as the learning "
                              "rate decays, H_t = min(sync_every_max, max(H, ⌊H·(η_peak / η_t)²⌋)) "
                              "from the lr of each outer step's update; 0 keeps H fixed")  # fmt: skip
    offload: bool = key(False, "keep θ_global and the outer momentum in CPU memory (pinned with CUDA)")
    eager: bool = key(False, "with overlap_steps: while a fragment's all-reduce is in flight, "
                      "continue from the outer step of this replica's own pseudo-gradient, then "
                      "move the local updates onto the true one (arXiv 2502.12996)")  # fmt: skip
    balance_replicas: bool = key(False, "mixed replicas: each replica runs as many of a period's H / fragments "
                                 "inner updates as it can in the time the fastest takes for them (measured each "
                                 "period, agreed at the outer step) and idles the rest; the merge weighs them by "
                                 "tokens. Needs [training] max_tokens and ddp, zero1 or fsdp inside")  # fmt: skip
    fault_tolerant: bool = key(False, "each replica its own job, met through torchft's lighthouse: a lost "
                               "replica does not stop the others, and it rejoins at an outer step with "
                               "the live state copied from a peer (docs/reliability.md)")  # fmt: skip
    lighthouse: str = key("", "with fault_tolerant: the lighthouse (http://host:port); "
                          "empty: $TORCHFT_LIGHTHOUSE, or run_train.sh's own")  # fmt: skip
    min_replicas: int = key(1, "with fault_tolerant: the replicas an outer step needs to commit")
    join_timeout_s: float = key(60.0, "with fault_tolerant: how long an outer step waits for "
                                "a late live replica, then goes on without it")  # fmt: skip
    round_timeout_s: float = key(300.0, "with fault_tolerant: an outer step's exchange waiting longer than this "
                                 "fails; the round runs again without the stalled replica (a frozen machine, a cut "
                                 "link); set it above the pseudo-gradient's time on the worst link")  # fmt: skip


@dataclass
class Eval:
    every: int = key(50, "updates between validation passes; 0 disables")
    batches: int = key(8, "micro-batches per validation pass and rank")


@dataclass
class Metrics:
    log_every: int = key(10, "updates between log records")
    tensorboard: bool = key(True, "write TensorBoard events to <dump_folder>/tb")
    progress_bar: bool = key(True, "a progress line on the console between log records")


@dataclass
class Checkpoint:
    enable: bool = key(False, "save DCP checkpoints")
    every: int = key(0, "updates between checkpoints; 0: only at the end of training")
    folder: str = key("checkpoint", "inside the dump folder (shared by all nodes)")
    keep: int = key(2, "the most recent checkpoints kept; 0 keeps all")
    resume: bool = key(True, "continue from the latest checkpoint in the folder, if there is one")
    load_path: str = key("", "resume from this step-N folder instead (e.g. another run's)")
    async_save: bool = key(False, "write in the background while training continues")
    export_hf: bool = key(False, "at the end, write θ as a Hugging Face folder (<dump_folder>/hf)")
    export_dtype: Literal["fp32", "bf16"] = key("fp32", "dtype of the exported weights")


@dataclass
class Preemption:
    """A stop signal (SLURM `--signal=USR1@120`, a preemption's SIGTERM): save at the next update, exit to requeue."""

    enable: bool = key(True, "handle `signals` as a preemption (false: SIGTERM stops at once, without a checkpoint)")
    signals: str = key("SIGTERM,SIGUSR1", "comma-separated: any of SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP")
    grace_s: float = key(90.0, "from the signal, the most time to finish the update and save; "
                         "past it a rank exits without the checkpoint (the previous one stays). "
                         "Keep it below the time your scheduler gives before SIGKILL")  # fmt: skip
    exit_code: int = key(75, "exit code after a preemption with checkpoints on (75: EX_TEMPFAIL); requeue on it")


@dataclass
class Profiling:
    enable: bool = key(False, "write torch.profiler traces of chosen updates, per rank, to <dump_folder>/<folder>")
    start_step: int = key(5, "the first traced update (the one before it warms the profiler up)")
    active_steps: int = key(2, "updates per trace")
    every: int = key(0, "trace again every this many updates; 0: once")
    memory_snapshot: bool = key(False, "CUDA: the allocator's history over the first trace too "
                                "(memory_step<N>.pickle, pytorch.org/memory_viz)")  # fmt: skip
    folder: str = key("profile", "inside the dump folder")


@dataclass
class Emulation:
    """Speed on the emulated cluster as on GPUs (torchacco/emulation.py; the benchmarks' --virtual-compute)."""

    virtual_compute: bool = key(False, "forward, backward, AdamW: timed waits holding no CPU (speed only: no losses)")
    forward_s: float = key(0.0, "one micro-batch's forward, in seconds (`torchacco calibrate` measures it)")
    backward_s: float = key(0.0, "one micro-batch's backward, in seconds")
    block_share: float = key(0.5, "the share of forward and backward in the blocks; the rest is embedding, head, loss")
    optimizer_s_per_param: float = key(0.0, "AdamW's seconds per parameter element")
    slow_ranks: str = key("", "comma-separated ranks whose waits last slow_factor times as long (a slower GPU)")
    slow_factor: float = key(1.0, "how much longer the slow ranks' waits last")


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
    diloco: DiLoCo = field(default_factory=DiLoCo)
    eval: Eval = field(default_factory=Eval)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    preemption: Preemption = field(default_factory=Preemption)
    profiling: Profiling = field(default_factory=Profiling)
    emulation: Emulation = field(default_factory=Emulation)
    # The registered strategies' own sections ([acco], [hsdp], ...) by name, listed after [parallelism].
    strategy_options: dict[str, Options] = field(
        default_factory=lambda: {name: cls() for name, cls in registry.option_sections().items()}
    )

    def section(self, name: str):
        """A section by its TOML name, a strategy's included (one registered after this config gets its defaults)."""
        strategy = registry.option_sections().get(name)
        return getattr(self, name) if strategy is None else self.strategy_options.setdefault(name, strategy())

    def options(self, options: type[Options] | None) -> Options | None:
        """The section a strategy's options dataclass is read from (None for a strategy without one)."""
        return None if options is None else self.section(options.section)

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(self.section(name)) for name in _sections()}

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            # JSON's literals and escapes are TOML's; non-ASCII text stays as it is (TOML has no \ud83d pairs).
            lines += [f"[{section}]", *(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in values.items()), ""]
        return "\n".join(lines)


def _sections() -> dict[str, type]:
    """Every section in the reference's order: the fixed ones, with the strategies' after [parallelism]."""
    hints = typing.get_type_hints(Config)
    fixed = [(f.name, hints[f.name]) for f in dataclasses.fields(Config) if f.name != "strategy_options"]
    at = next(i for i, (name, _) in enumerate(fixed) if name == "parallelism") + 1
    return dict(fixed[:at] + list(registry.option_sections().items()) + fixed[at:])


def _key_types(section_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def choices(section: str, name: str) -> tuple | None:
    """The values a `Literal[...]` (or `choices=`) key accepts (None for a free value)."""
    cls = _sections()[section]
    listed = next(f.metadata.get("choices") for f in dataclasses.fields(cls) if f.name == name)
    if listed is not None:
        return tuple(listed())
    expected = _key_types(cls)[name]
    return typing.get_args(expected) if typing.get_origin(expected) is Literal else None


def _convert(value, expected: type, where: str, from_cli: bool):
    """Check a TOML value's type, or convert a CLI string to the field's type."""
    if typing.get_origin(expected) is Literal:  # `_set` checks the choices
        return value
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


def did_you_mean(word: str, known) -> str:
    """'; did you mean 'x'?' for the closest of `known` to a mistyped `word` (difflib's, any case), or ''."""
    by_lower = {str(k).lower(): str(k) for k in known}
    close = difflib.get_close_matches(str(word).lower(), by_lower, n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def _set(cfg: Config, section: str, key: str, value, origin: str, from_cli: bool = False) -> None:
    sections = _sections()
    if section not in sections:
        hint = did_you_mean(section, sections) or ";"
        raise UserError(f"{origin}: unknown section [{section}]{hint} valid sections: {', '.join(sections)}")
    keys = _key_types(sections[section])
    if key not in keys:
        elsewhere = [f"[{other}] {key}" for other, cls in sections.items() if key in _key_types(cls)]
        hint = did_you_mean(key, keys) or (f"; did you mean {' or '.join(elsewhere)}?" if elsewhere else ";")
        raise UserError(f"{origin}: unknown key '{key}' in [{section}]{hint} valid keys: {', '.join(keys)}")
    value = _convert(value, keys[key], f"{origin}: [{section}] {key}", from_cli)
    allowed = choices(section, key)
    if allowed is not None and value not in allowed:
        hint = did_you_mean(value, allowed)
        raise UserError(f"{origin}: [{section}] {key} = {value!r} is not one of: {', '.join(allowed)}{hint}")
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{origin}: [{section}] {key} = {value} is not a finite number; give a finite value")
    setattr(cfg.section(section), key, value)


def config_from_dict(data: dict, origin: str = "config") -> Config:
    cfg = Config()
    for section, values in data.items():
        if not isinstance(values, dict):
            raise UserError(f"{origin}: '{section}' must be a [section] table, not a plain value")
        for name, value in values.items():
            _set(cfg, section, name, value, origin)
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
        if arg in ("-h", "--help"):
            raise UserError(f"{arg}: run ./run_train.sh --help [SECTION] (or torchacco config --help)")
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
    for section, name, value in overrides:
        _set(cfg, section, name, value, f"--{section}.{name}", from_cli=True)
    return cfg


def _keys(section: str, cls: type):
    """(name, type, default, help) of each key of a section: what docs/configuration.md and `--help` show. The type is
    a name, or for a key with fixed choices the tuple of them."""
    types_ = _key_types(cls)
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        yield f.name, choices(section, f.name) or types_[f.name].__name__, default, f.metadata["help"]


def _about(cls: type) -> str:
    """A section's docstring, when it has one of its own (a dataclass's default one repeats its fields)."""
    doc = cls.__doc__ or ""
    return "" if doc.startswith(cls.__name__ + "(") else " ".join(doc.split())


def reference_markdown() -> str:
    """docs/configuration.md: every section and key with its type, default and help."""
    out = [
        "# Configuration reference",
        "",
        "Generated from `torchacco/config.py` by `python -m torchacco config > docs/configuration.md` (a test",
        "fails when the two disagree; `./run_train.sh --help SECTION` prints the same rows). A config is a TOML file",
        "of these sections; any key can be overridden on the command line: `--section.key VALUE`.",
        "",
    ]
    for section, cls in _sections().items():
        out += [f"## [{section}]", ""] + ([_about(cls), ""] if _about(cls) else [])
        out += ["| key | type | default | what it does |", "|---|---|---|---|"]
        for name, kind, default, help_ in _keys(section, cls):
            kind = " \\| ".join(f"`{c}`" for c in kind) if isinstance(kind, tuple) else kind
            default, help_ = json.dumps(default, ensure_ascii=False), help_.replace("|", "\\|")
            out.append(f"| `{name}` | {kind} | `{default}` | {help_} |")
        out.append("")
    return "\n".join(out)


def help_text(section: str | None = None) -> str:
    """`--help`: the sections, each with its keys' names; `--help SECTION`: its keys with type, default and help."""
    sections = _sections()
    if section is None:
        lines = ["Config sections (`--help SECTION` lists one's keys, types, defaults; docs/configuration.md all):"]
        width = max(map(len, sections)) + 4
        for name, cls in sections.items():
            keys = ", ".join(f.name for f in dataclasses.fields(cls))
            lines.append(
                textwrap.fill(keys, 118, initial_indent=f"  {name:<{width - 2}}", subsequent_indent=" " * width)
            )
        return "\n".join(lines)
    name = section.strip("[]-").removesuffix(".")
    if name not in sections:
        hint = did_you_mean(name, sections) or ";"
        raise UserError(f"--help {section}: no section [{name}]{hint} sections: {', '.join(sections)}")
    rows = [
        (key, "|".join(kind) if isinstance(kind, tuple) else kind, json.dumps(default, ensure_ascii=False), help_)
        for key, kind, default, help_ in _keys(name, sections[name])
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    about = _about(sections[name])
    lines = [f"[{name}]" + (f": {about}" if about else ""), f"(in a TOML file's [{name}] table, or --{name}.KEY VALUE)"]
    lines += [f"  {k:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}" for k, t, d, h in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`torchacco config`: the reference as markdown; `--help [SECTION]` (or `-h`): the help above."""
    asks = [i for i, arg in enumerate(argv) if arg in ("--help", "-h")]
    if not asks:
        sys.stdout.write(reference_markdown())
        return 0
    after = argv[asks[0] + 1 : asks[0] + 2]
    print(help_text(after[0] if after and not after[0].startswith("-") else None))
    return 0
