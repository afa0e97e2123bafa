"""Building a run's parts from their config sections: the model, the data and the data-parallel strategy."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from torchacco import data, faults, hf_io, materialize, user_model
from torchacco.config import Config, Data, Model, Tokenizer
from torchacco.device import Device
from torchacco.errors import UserError
from torchacco.parallel.diloco import DiLoCo, SharedLRClock, has_outer_step
from torchacco.parallel.dims import ParallelDims
from torchacco.parallel.process_groups import on_one_rank
from torchacco.parallel.registry import strategy_class
from torchacco.parallel.strategy import Strategy, UpdatePlan
from torchacco.spec import ModelSpec


@dataclass(frozen=True)
class ModelKind:
    """Whose model a run trains, decided once where the model enters: torchacco's own (a models/ folder: `.args`,
    parallel plans, a Hugging Face adapter) or a foreign one passed to train() (a Hugging Face causal LM, or any module
    giving logits), which torchacco/user_model.py adapts."""

    foreign: bool
    label: str  # for the run's first log line

    @staticmethod
    def of(model: nn.Module | None, model_cfg: Model) -> ModelKind:
        if model is not None and not hasattr(model, "args"):
            return ModelKind(True, type(model).__name__)
        return ModelKind(False, f"{model_cfg.name}/{model_cfg.flavor}")

    def flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        return user_model.flops_per_token(model, seq_len) if self.foreign else model.args.flops_per_token(seq_len)


def model_args(spec: ModelSpec, model: Model, vocab_size: int = 0):
    """The configured architecture: the flavor's, or that of the [model] init_from folder."""
    if model.init_from:
        hf_config = json.loads((Path(model.init_from) / "config.json").read_text())
        if spec.hf is None:
            raise UserError(
                f"model {model.name} has no Hugging Face adapter (models/{model.name}/hf.py); "
                "it cannot be initialised from [model] init_from"
            )
        return spec.hf.args_from_hf_config(hf_config)  # the weights fix the vocabulary
    return spec.args(model.flavor, vocab_size=model.vocab_size or vocab_size or None)


def build_model(spec: ModelSpec, model_cfg: Model, vocab_size: int, seed: int, device: Device) -> nn.Module:
    """Initialised from `seed` (or loaded from [model] init_from) on `device`."""
    model, init = build_on_meta(spec, model_cfg, vocab_size, seed, device)
    init()
    return model


def build_on_meta(spec: ModelSpec, model_cfg: Model, vocab_size: int, seed: int, device: Device):
    """(model on the meta device, the step that allocates it on `device` and initialises it): parallelism applied in
    between makes each rank allocate its own shards only (torchacco/materialize.py)."""
    args = model_args(spec, model_cfg, vocab_size)
    if vocab_size > args.vocab_size:
        raise UserError(
            f"the tokenizer has {vocab_size} tokens but the model's vocabulary is {args.vocab_size}; "
            f"set [model] vocab_size = {vocab_size} (or 0 to follow the tokenizer)"
        )
    with torch.device("meta"):
        model = spec.model_cls(args)

    def load(full: nn.Module) -> None:
        _, _, weights = hf_io.load_hf(model_cfg.init_from, model_cfg.name, lazy=True)
        hf_io.load_into(full, weights)

    return model, materialize.defer(model, device.torch, seed, load if model_cfg.init_from else None)


def build_data(data_cfg: Data, tokenizer_cfg: Tokenizer, seq_len: int, seed: int, dims: ParallelDims):
    """(tokenizer, train set, validation set) of this rank's data-parallel shard. Local rank 0 fetches and tokenizes
    first; the others read its cache."""

    def prepare() -> None:
        time.sleep(faults.data_delay(dims.rank))  # an injected slow corpus (TORCHACCO_FAULT=slow_data@...)
        data.prepare(data_cfg, tokenizer_cfg, seq_len)

    on_one_rank(dims, prepare, what="prepare the data (fetch, train the tokenizer, tokenize)")
    tokenizer = data.load_tokenizer(data_cfg, tokenizer_cfg)
    train_set, val_set = data.build_datasets(data_cfg, tokenizer_cfg, seq_len, dims.data_rank, dims.data_size, seed)
    return tokenizer, train_set, val_set


def build_strategy(
    model: nn.Module, cfg: Config, dims: ParallelDims, plan: UpdatePlan, device: Device, init=None
) -> Strategy:
    """The configured strategy over `model` (this rank's part of it, after tensor/pipeline parallelism), inside DiLoCo's
    outer step when the run has one (`plan` is then one replica's). `init`: the step allocating `model` (on meta)."""
    cls = strategy_class(cfg.parallelism.data_parallel)
    sections = {"parallelism": cfg.parallelism, "optimizer": cfg.optimizer, "options": cfg.options(cls.traits.options)}
    if not has_outer_step(dims.replicas, cfg.diloco):
        return cls.build(model, dims, plan, device, init, **sections)
    clock = SharedLRClock(plan.schedule) if cfg.diloco.balance_replicas else None
    if clock is not None:
        plan = dataclasses.replace(plan, schedule=clock)
    folder = Path(cfg.job.dump_folder)  # (a fault-tolerant replica's previous run logged there)
    return DiLoCo(cls.build(model, dims, plan, device, init, **sections), dims, cfg.diloco, device, clock, folder)
