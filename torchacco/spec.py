"""What a model folder in `models/` provides, and how torchacco finds it.

A model folder `models/<name>/` plugs in by exposing `spec = ModelSpec(...)` from its
`__init__.py`; `get_model_spec(name)` imports `models.<name>` on demand, so adding a
model never means editing `torchacco/`.

The model class contract (kept small so parallelism can be applied from outside):
- `ModelCls(args)` builds on the meta device without allocating;
- `model.init_weights()` initialises every parameter and buffer after `to_empty()`,
  deterministically given torch's RNG state;
- `model.layers` is an `nn.ModuleList` of transformer blocks: the unit of
  `torch.compile`, activation checkpointing and `fully_shard`;
- `model(tokens[B, T]) -> logits[B, T, vocab]`.

The args dataclass provides `vocab_size`, `max_seq_len`, `dim`, `n_layers` and
`flops_per_token(seq_len) -> float` (forward + backward, for MFU).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch.nn as nn

from torchacco.errors import UserError


@dataclass(frozen=True)
class HFAdapter:
    """Maps a model's state dict to and from Hugging Face `transformers` names."""

    to_hf: Callable[[dict, Any], dict]  # (our state dict, args) -> HF state dict
    from_hf: Callable[[dict, Any], dict]  # (HF state dict, args) -> our state dict
    hf_config: Callable[[Any], dict]  # args -> HF config.json contents
    args_from_hf_config: Callable[[dict], Any]  # HF config.json -> args


def renaming_adapter(label: str, name_map: Callable[[Any], dict[str, str]], ignored: Callable[[str, Any], bool],
                     hf_config: Callable[[Any], dict], args_from_hf_config: Callable[[dict], Any]) -> HFAdapter:
    """The adapter of a model whose Hugging Face checkpoint is its own tensors under other
    names: `name_map(args)` gives ours -> theirs; `ignored(hf_name, args)` names HF tensors
    to drop on the way in (a tied head, old buffers)."""

    def to_hf(state_dict: dict, args) -> dict:
        names = name_map(args)
        if unknown := set(state_dict) - set(names):
            raise UserError(f"{label} to_hf: tensors not in the model: {sorted(unknown)[:5]}")
        return {names[k]: v for k, v in state_dict.items()}

    def from_hf(hf_state_dict: dict, args) -> dict:
        ours = {theirs: k for k, theirs in name_map(args).items()}
        out = {}
        for k, v in hf_state_dict.items():
            if k in ours:
                out[ours[k]] = v
            elif not ignored(k, args):
                raise UserError(f"{label} from_hf: unexpected tensor '{k}' for a {args.n_layers}-layer model")
        return out

    return HFAdapter(to_hf, from_hf, hf_config, args_from_hf_config)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    args_cls: type
    flavors: dict[str, Any]
    hf: HFAdapter | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def args(self, flavor: str, **overrides) -> Any:
        if flavor not in self.flavors:
            raise UserError(
                f"model '{self.name}' has no flavor '{flavor}'; "
                f"choose one of: {', '.join(sorted(self.flavors))}"
            )
        overrides = {k: v for k, v in overrides.items() if v is not None}
        return replace(self.flavors[flavor], **overrides)


def available_models() -> list[str]:
    import models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg)


def get_model_spec(name: str) -> ModelSpec:
    names = available_models()
    if name not in names:
        raise UserError(f"unknown model '{name}' ([model] name); available: {', '.join(names)}")
    module = importlib.import_module(f"models.{name}")
    spec = getattr(module, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise UserError(f"models/{name}/__init__.py must define `spec = ModelSpec(...)`")
    return spec
