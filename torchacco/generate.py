"""Sample text from an exported model: `torchacco generate --model DIR --prompt "To be, or not"`.

DIR is a Hugging Face folder as `torchacco.hf_io.save_hf` writes it (config.json, safetensors,
tokenizer.json). Each new token recomputes the whole (truncated) context: no KV cache, since
this is a tool for looking at what a run learned, not a server.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import tokenizers
import torch
import torch.nn as nn

from torchacco.data.tokenizer import EOS_CANDIDATES
from torchacco.errors import UserError, run_cli
from torchacco.hf_io import load_hf, load_into
from torchacco.spec import get_model_spec


@torch.no_grad()
def generate(
    model: nn.Module,
    token_ids: list[int],
    max_tokens: int,
    temperature: float,
    top_k: int | None,
    eos_id: int | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens that follow `token_ids`, at most `max_tokens`, up to EOS (excluded). temperature 0 is greedy;
    else sample logits / temperature on the CPU with `generator`, from the `top_k` largest (None or 0: all).
    The model sees the last `model.args.max_seq_len` tokens."""
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {temperature}")
    model.eval()
    device = next(model.parameters()).device
    window = model.args.max_seq_len
    ids = list(token_ids)
    for _ in range(max_tokens):
        context = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        logits = model(context)[0, -1].float().cpu()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if token == eos_id:
            break
        ids.append(token)
    return ids[len(token_ids) :]


def _device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but no CUDA GPU is available; use --device cpu")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def _eos_id(tokenizer, config_eos) -> int | None:
    """config.json's eos_token_id, else the tokenizer's end-of-text token, else None (no stop)."""
    if isinstance(config_eos, list):  # Llama 3.1 lists several; the first ends plain text
        config_eos = config_eos[0] if config_eos else None
    if isinstance(config_eos, int):
        return config_eos
    ids = (tokenizer.token_to_id(t) for t in EOS_CANDIDATES)
    return next((i for i in ids if i is not None), None)


def run(opts: argparse.Namespace) -> str:
    folder = Path(opts.model).expanduser()
    if not folder.is_dir():
        raise UserError(f"model folder not found: {folder}")
    if not (folder / "tokenizer.json").is_file():
        raise UserError(f"{folder} has no tokenizer.json; pass a folder exported with its tokenizer")
    if not opts.prompt:
        raise UserError("--prompt is empty; give some text to continue")
    if opts.max_tokens < 0 or opts.top_k < 0:
        raise UserError("--max-tokens and --top-k must be >= 0")
    device = _device(opts.device)
    tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    name, args, state_dict = load_hf(folder)
    if tokenizer.get_vocab_size(with_added_tokens=True) > args.vocab_size:
        raise UserError(f"{folder}/tokenizer.json has {tokenizer.get_vocab_size()} "
                        f"tokens, more than the model's vocab_size {args.vocab_size}; it "
                        "is not the tokenizer the model was trained with")  # fmt: skip
    with torch.device("meta"):
        model = get_model_spec(name).model_cls(args)
    model.to_empty(device=device)
    model.init_weights()  # rebuilds the non-persistent buffers (RoPE table); the weights come next
    load_into(model, state_dict)

    prompt_ids = tokenizer.encode(opts.prompt).ids  # special tokens as the tokenizer's template adds them
    if not prompt_ids:
        raise UserError(f"the prompt {opts.prompt!r} encodes to no tokens; give some text to continue")
    eos_id = _eos_id(tokenizer, json.loads((folder / "config.json").read_text()).get("eos_token_id"))
    generator = torch.Generator().manual_seed(opts.seed)
    new = generate(model, prompt_ids, opts.max_tokens, opts.temperature, opts.top_k, eos_id, generator)

    # decode together so that merges and multi-byte characters across the boundary come out right
    full = tokenizer.decode(prompt_ids + new, skip_special_tokens=True)
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    continuation = full[len(head) :] if full.startswith(head) else tokenizer.decode(new, skip_special_tokens=True)
    return opts.prompt + continuation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchacco generate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="Hugging Face folder written by the export (with tokenizer.json)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 keeps the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    opts = p.parse_args(argv)
    return run_cli(lambda: print(run(opts), flush=True))
