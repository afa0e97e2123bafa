"""What a model folder in `models/` provides, and how torchacco finds it.

A model folder `models/<name>/` plugs in by exposing `spec = ModelSpec(...)` from its `__init__.py`;
`get_model_spec(name)` imports `torchacco.models.<name>` on demand (or, for a dotted name such as `my_package.my_model`,
that module from the Python path), so adding a model — its tensor-parallel plan and pipeline split included — never
means editing `torchacco/`. docs/adding_a_model.md walks through one and states the model class's contract (built on
meta, `init_weights()`, `layers`, `args`). A model passed to `train(cfg, model=...)` without `.args` (a Hugging Face
causal LM, say) is adapted from outside by torchacco/user_model.py and trains under data parallelism only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch.nn as nn

from torchacco.config import did_you_mean
from torchacco.errors import UserError


@dataclass(frozen=True)
class HFAdapter:
    """Maps a model's state dict to and from Hugging Face `transformers` names."""

    to_hf: Callable[[dict, Any], dict]  # (our state dict, args) -> HF state dict
    from_hf: Callable[[dict, Any], dict]  # (HF state dict, args) -> our state dict
    hf_config: Callable[[Any], dict]  # args -> HF config.json contents
    args_from_hf_config: Callable[[dict], Any]  # HF config.json -> args


def renaming_adapter(
    label: str,
    name_map: Callable[[Any], dict[str, str]],
    ignored: Callable[[str, Any], bool],
    hf_config: Callable[[Any], dict],
    args_from_hf_config: Callable[[dict], Any],
) -> HFAdapter:
    """The adapter of a model whose Hugging Face checkpoint is its own tensors under other names: `name_map(args)` gives
    ours -> theirs; `ignored(hf_name, args)` names HF tensors to drop on the way in (a tied head, old buffers)."""

    def to_hf(state_dict: dict, args) -> dict:
        names = name_map(args)
        if unknown := set(state_dict) - set(names):
            raise UserError(f"{label} to_hf: tensors not in the model: {sorted(unknown)[:5]}")
        return {names[k]: v for k, v in state_dict.items()}

    def from_hf(hf_state_dict: dict, args) -> dict:
        ours = {theirs: k for k, theirs in name_map(args).items()}
        if unexpected := [k for k in hf_state_dict if k not in ours and not ignored(k, args)]:
            raise UserError(f"{label} from_hf: unexpected tensor '{unexpected[0]}' for a {args.n_layers}-layer model")
        return {ours[k]: v for k, v in hf_state_dict.items() if k in ours}

    return HFAdapter(to_hf, from_hf, hf_config, args_from_hf_config)


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism splits the model (applied by torchacco/parallel/tensor.py).

    `plans(model, loss_parallel)` returns (the plan of top-level modules, the plan of one block): dicts of module path
    -> DTensor ParallelStyle, as `parallelize_module` takes; an untied output head uses
    `tensor.head_layouts(loss_parallel)` (logits split by vocabulary for the loss). `split_sizes(args)` lists the (name,
    size) of every dimension split tp ways, so each is checked before launch."""

    plans: Callable[[nn.Module, bool], tuple[dict, dict]]
    split_sizes: Callable[[Any], list[tuple[str, int]]]


@dataclass(frozen=True)
class PipelinePlan:
    """How pipeline parallelism cuts the model into stages (applied by torchacco/parallel/pipeline.py).

    `unsupported(args)` says why a configuration cannot be split (None: it can). `prune(model, first, last)` removes the
    modules that a rank holding no first (or no last) stage does not need; `stage(model, layer_ids, first, last,
    seq_shards)` is a module running one stage over the model's own submodules (`seq_shards`: tp under sequence
    parallelism, the factor by which activations between stages are shorter than the sequence)."""

    unsupported: Callable[[Any], str | None]
    prune: Callable[[nn.Module, bool, bool], None] | None = None
    stage: Callable[..., nn.Module] | None = None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    hf: HFAdapter | None = None
    tensor_parallel: TensorParallelPlan | None = None
    pipeline: PipelinePlan | None = None

    def args(self, flavor: str, **overrides) -> Any:
        if flavor not in self.flavors:
            raise UserError(
                f"model '{self.name}' has no flavor '{flavor}'{did_you_mean(flavor, self.flavors) or ';'} choose one "
                f"of: {', '.join(sorted(self.flavors))}"
            )
        return replace(self.flavors[flavor], **{k: v for k, v in overrides.items() if v is not None})


def available_models() -> list[str]:
    from torchacco import models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


def get_model_spec(name: str) -> ModelSpec:
    """The spec of `models/<name>/`, or of the module `name` when it is a dotted path."""
    if "." in name:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise UserError(
                f"[model] name = '{name}': cannot import it ({e}); put its package on PYTHONPATH, or "
                f"use a folder of models/ ({', '.join(available_models())})"
            ) from None
        where = f"module {name}"
    else:
        names = available_models()
        if name not in names:
            raise UserError(
                f"unknown model '{name}' ([model] name){did_you_mean(name, names) or ';'} available: "
                f"{', '.join(names)}, or a module path (my_package.my_model) whose `spec` is a ModelSpec"
            )
        module = importlib.import_module(f"torchacco.models.{name}")
        where = f"models/{name}/__init__.py"
    spec = getattr(module, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise UserError(f"{where} must define `spec = ModelSpec(...)`")
    return spec
