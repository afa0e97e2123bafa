"""Hugging Face model folders: config.json + safetensors (+ tokenizer.json), written and read.

    save_hf(folder, "gpt_neo", args, model.state_dict(), dtype=torch.bfloat16, tokenizer_path=..., eos_id=...)
    name, args, state_dict = load_hf(folder)       # torchacco names, fp32
    load_into(model, state_dict)                   # strict, with shape errors that name the tensor

A folder written here loads with `transformers.AutoModelForCausalLM.from_pretrained(folder)`, and one from the
Hub or `save_pretrained` loads here, for models whose `ModelSpec` has an `HFAdapter` (which owns names and
config.json). Layout as `save_pretrained` writes it: `model.safetensors`, or above `max_shard_bytes`
`model-00001-of-0000N.safetensors` + `model.safetensors.index.json`; a tied head is re-tied, not written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import tokenizers
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

from torchacco.errors import UserError
from torchacco.materialize import copy_shard
from torchacco.spec import ModelSpec, get_model_spec

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
_HF_MODEL_TYPES = {"gpt_neo": "gpt_neo", "llama": "llama3"}  # config.json model_type -> models/<name>
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def save_hf(
    folder,
    model_name: str,
    args,
    state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_path: str | None = None,
    eos_id: int | None = None,
) -> Path:
    """Write `state_dict` (torchacco names, full tensors) as a Hugging Face folder; returns its path. The folder
    appears complete or not at all (written beside it, then renamed); it replaces an earlier export only."""
    spec = _adapter_spec(model_name)
    folder = Path(folder).expanduser()
    dtype_name = next((name for name, d in _DTYPES.items() if d == dtype), None)
    if dtype_name is None:
        raise UserError(f"cannot export in {dtype}; choose one of: {', '.join(_DTYPES)}")
    if tokenizer_path is not None and not Path(tokenizer_path).expanduser().is_file():
        raise UserError(f"tokenizer not found: {tokenizer_path}; pass the tokenizer.json the model was trained with")
    _check_replaceable(folder)

    config = dict(spec.hf.hf_config(args))
    # "dtype" is transformers 5's name for it, "torch_dtype" the one older versions (and the Hub) read
    config.update(torch_dtype=dtype_name, dtype=dtype_name)
    if eos_id is not None:  # GPT-2 style: one end-of-text token that also starts a sequence
        config.update(bos_token_id=eos_id, eos_token_id=eos_id)

    hf_sd = _contiguous_unshared({k: v.detach().to("cpu", dtype) for k, v in spec.hf.to_hf(state_dict, args).items()})
    shards = _split(hf_sd, max_shard_bytes)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")  # mkdir, not mkdtemp: umask permissions
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed export with our pid
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        n = len(shards)
        names = [WEIGHTS] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        for shard, name in zip(shards, names):
            save_file(shard, tmp / name, metadata={"format": "pt"})
        if n > 1:
            weight_map = {key: name for shard, name in zip(shards, names) for key in shard}
            total = sum(t.numel() * t.element_size() for t in hf_sd.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(Path(tokenizer_path).expanduser(), tmp / TOKENIZER)
            (tmp / TOKENIZER_CONFIG).write_text(json.dumps(_tokenizer_config(tmp / TOKENIZER, eos_id), indent=2))
        _swap_into_place(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _adapter_spec(model_name: str) -> ModelSpec:
    spec = get_model_spec(model_name)
    if spec.hf is None:
        raise UserError(f"model {model_name} has no Hugging Face adapter "
                        f"(models/{model_name}/hf.py); export is unavailable")  # fmt: skip
    return spec


def _check_replaceable(folder: Path) -> None:
    """Refuse to overwrite anything but an earlier export (or an empty folder)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise UserError(f"export folder {folder} is a file; choose a folder path")
    ours = {CONFIG, WEIGHTS, INDEX, TOKENIZER, TOKENIZER_CONFIG, "generation_config.json"}
    other = [p.name for p in folder.iterdir() if p.name not in ours and not p.name.endswith(".safetensors")]
    if other:
        raise UserError(f"export folder {folder} exists and holds other files "
                        f"({', '.join(sorted(other)[:3])}); choose a new or empty folder")  # fmt: skip


def _swap_into_place(tmp: Path, folder: Path) -> None:
    """Replace `folder` by `tmp`, restoring the old one if the second rename fails."""
    if not folder.exists():
        os.replace(tmp, folder)
        return
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.replace(folder, old)
    try:
        os.replace(tmp, folder)
    except OSError:
        os.replace(old, folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _contiguous_unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses views and tensors sharing storage: give each its own contiguous copy."""
    seen, out = set(), {}
    for k, t in sd.items():
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def _split(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, a new shard whenever the next one would overflow (one tensor may exceed it)."""
    shards, size = [{}], 0
    for k, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    return shards


def _tokenizer_config(tokenizer_json: Path, eos_id: int | None) -> dict:
    """What `AutoTokenizer.from_pretrained(folder)` needs besides tokenizer.json."""
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if eos_id is not None:
        token = tokenizers.Tokenizer.from_file(str(tokenizer_json)).id_to_token(eos_id)
        if token is not None:
            cfg.update(bos_token=token, eos_token=token)
    return cfg


class OnDisk:
    """A safetensors tensor not read yet: its shape now, its fp32 values on `load()` (a rank filling its shard
    of a large model holds one whole tensor at a time, never the model)."""

    def __init__(self, path: Path, name: str, shape: tuple[int, ...]):
        self.path, self.name, self.shape = path, name, torch.Size(shape)

    def load(self) -> torch.Tensor:
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(self.name).to(torch.float32)


def load_hf(folder, model_name: str | None = None, lazy: bool = False) -> tuple[str, Any, dict[str, torch.Tensor]]:
    """Read a Hugging Face folder: (model name, args, fp32 state dict in torchacco names); `lazy`: its values
    are `OnDisk` tensors, read one by one as `load_into` fills the model."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise UserError(f"Hugging Face model folder not found: {folder}")
    config_path = folder / CONFIG
    if not config_path.is_file():
        raise UserError(f"{folder} has no {CONFIG}; point at a Hugging Face model folder (config.json + safetensors)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{config_path} is not valid JSON ({e}); re-export the model") from None

    model_type = config.get("model_type")
    name = _HF_MODEL_TYPES.get(model_type)
    if name is None:
        raise UserError(f"{config_path}: model_type {model_type!r} is not supported; "
                        f"torchacco reads: {', '.join(_HF_MODEL_TYPES)}")  # fmt: skip
    if model_name not in (None, name):
        raise UserError(f"{folder} holds a {model_type} model ({name}), but the config asks for '{model_name}'; "
                        f'set [model] name = "{name}" or point at a {model_name} folder')  # fmt: skip
    spec = _adapter_spec(name)
    try:
        args = spec.hf.args_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{config_path} cannot be read as a {name} config ({type(e).__name__}: {e})") from None

    sd = spec.hf.from_hf(_read_safetensors(folder, lazy), args)
    order = _check_against_args(spec, args, sd, folder)
    return name, args, {k: sd[k] if lazy else sd[k].to(torch.float32) for k in order}


def _read_safetensors(folder: Path, lazy: bool) -> dict[str, torch.Tensor]:
    def on_disk(path: Path) -> dict[str, OnDisk]:
        with safe_open(path, framework="pt") as f:
            return {k: OnDisk(path, k, tuple(f.get_slice(k).get_shape())) for k in f.keys()}

    index_path = folder / INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index_path} is not a valid safetensors index ({e}); re-export the model") from None
        files = list(dict.fromkeys(weight_map.values()))
        if lost := [f for f in files if not (folder / f).is_file()]:
            raise UserError(f"{index_path} lists shard {lost[0]}, which is missing from "
                            f"{folder}; copy the whole folder or re-export it")  # fmt: skip
    elif (folder / WEIGHTS).is_file():
        files, weight_map = [WEIGHTS], None
    else:
        files, weight_map = sorted(p.name for p in folder.glob("*.safetensors")), None
        if not files:
            raise UserError(f"{folder} has no safetensors weights ({WEIGHTS} or {INDEX}); export the "
                            "model with safetensors (PyTorch .bin files are not read)")  # fmt: skip

    sd = {}
    for f in files:
        try:
            tensors = on_disk(folder / f) if lazy else load_file(folder / f)
        except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
            raise UserError(f"cannot read {folder / f} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "the file is corrupted or incomplete: re-export or re-download it") from None  # fmt: skip
        if dup := sd.keys() & tensors.keys():
            raise UserError(f"tensor '{sorted(dup)[0]}' appears in more than one shard of {folder}; re-export it")
        sd.update(tensors)
    if weight_map is not None and (missing := set(weight_map) - set(sd)):
        raise UserError(f"{index_path} maps tensor '{sorted(missing)[0]}' to a shard "
                        "that does not hold it; re-export the model")  # fmt: skip
    return sd


def _check_against_args(spec: ModelSpec, args, sd: dict[str, torch.Tensor], folder: Path) -> list[str]:
    """Names and shapes as a model built from config.json has them; returns its names in order."""
    with torch.device("meta"):
        expected = spec.model_cls(args).state_dict()
    if missing := [k for k in expected if k not in sd]:
        raise UserError(f"{folder} lacks tensor '{missing[0]}' (and {len(missing) - 1} more) "
                        "that its config.json implies; the export is incomplete")  # fmt: skip
    if unexpected := [k for k in sd if k not in expected]:
        raise UserError(f"{folder} has tensor '{unexpected[0]}' that a model with its config.json has no place for")
    for k, t in expected.items():
        if sd[k].shape != t.shape:
            raise UserError(f"{folder}: tensor '{k}' has shape {tuple(sd[k].shape)}, but config.json "
                            f"implies {tuple(t.shape)}; the folder is inconsistent")  # fmt: skip
    return list(expected)


def load_into(model: nn.Module, state_dict: dict) -> None:
    """`model.load_state_dict(state_dict)` (strict), with errors that name the tensor and the fix;
    into a sharded model (tensor parallel, FSDP, pipeline stages) each rank writes its own part."""
    expected = model.state_dict(keep_vars=True)
    for k, t in expected.items():  # in the model's order: the first mismatch is the earliest tensor
        if k in state_dict and tuple(state_dict[k].shape) != tuple(t.shape):
            raise UserError(f"weights tensor '{k}' has shape {tuple(state_dict[k].shape)}, which does not match the "
                            f"configured model: {tuple(t.shape)}; check [model] flavor / vocab_size")  # fmt: skip
    if missing := [k for k in expected if k not in state_dict]:
        raise UserError(f"the weights lack tensor '{missing[0]}' ({len(missing)} missing) that "
                        "the configured model has; check [model] name / flavor")  # fmt: skip
    if unexpected := [k for k in state_dict if k not in expected]:
        raise UserError(f"the weights have tensor '{unexpected[0]}' ({len(unexpected)} unexpected) that "
                        "the configured model lacks; check [model] name / flavor / n_layers")  # fmt: skip
    with torch.no_grad():
        for k, t in expected.items():
            if t.is_meta:  # a layer another pipeline stage holds
                continue
            value = state_dict[k].load() if isinstance(state_dict[k], OnDisk) else state_dict[k]
            if isinstance(t, DTensor):
                copy_shard(t, value)  # this rank's part of a tensor-parallel or FSDP shard
            else:
                t.copy_(value)
