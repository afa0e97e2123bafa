"""GPT-Neo <-> Hugging Face `GPTNeoForCausalLM` names and config.json.

Our module names mirror HF's, so the mapping is a prefix change. The tied head is not
written (HF re-ties lm_head to wte, and save_pretrained omits it too); on the way in,
`lm_head.weight` and the attention-mask buffers of old checkpoints are dropped.
"""

from __future__ import annotations

from torchacco.errors import UserError

from .model import ModelArgs

_TOP_KEYS = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
_BLOCK_KEYS = (
    "ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
    "attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight",
    "attn.out_proj.weight", "attn.out_proj.bias",
    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
)  # fmt: skip
_IGNORED_HF = ("lm_head.weight", ".attn.attention.bias", ".attn.attention.masked_bias")


def name_map(args: ModelArgs) -> dict[str, str]:
    """Our name -> HF name for every tensor."""
    names = {k: f"transformer.{k}" for k in _TOP_KEYS}
    for i in range(args.n_layers):
        for k in _BLOCK_KEYS:
            names[f"layers.{i}.{k}"] = f"transformer.h.{i}." + k.replace("attn.", "attn.attention.")
    return names


def ignored(hf_name: str, args: ModelArgs) -> bool:
    return hf_name.endswith(_IGNORED_HF)


def hf_config(args: ModelArgs) -> dict:
    repeats, rem = divmod(args.n_layers, len(args.attention_pattern))
    if rem:
        raise UserError(
            f"GPT-Neo: n_layers {args.n_layers} is not a multiple of the attention pattern "
            f"{list(args.attention_pattern)}; HF's attention_types cannot express it"
        )
    return {
        "model_type": "gpt_neo",
        "architectures": ["GPTNeoForCausalLM"],
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "hidden_size": args.dim,
        "num_layers": args.n_layers,
        "num_heads": args.n_heads,
        "attention_types": [[list(args.attention_pattern), repeats]],
        "window_size": args.window_size,
        "intermediate_size": args.ffn_hidden_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": args.norm_eps,
        "embed_dropout": 0.0,
        "attention_dropout": 0.0,
        "resid_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        # special token ids belong to the tokenizer; an exporter that knows it may fill them
        "bos_token_id": None,
        "eos_token_id": None,
    }


def args_from_hf_config(cfg: dict) -> ModelArgs:
    layers = [t for types, n in cfg["attention_types"] for _ in range(n) for t in types]
    if len(layers) != cfg["num_layers"]:
        raise UserError(
            f"GPT-Neo config: attention_types gives {len(layers)} layers, num_layers is {cfg['num_layers']}"
        )
    if cfg.get("activation_function", "gelu_new") != "gelu_new" or not cfg.get("tie_word_embeddings", True):
        raise UserError("GPT-Neo config: only activation 'gelu_new' with tied embeddings is supported")
    # the shortest unit that repeats to give every layer, e.g. ['global', 'local']
    period = next(p for p in range(1, len(layers) + 1) if layers == (layers[:p] * len(layers))[: len(layers)])
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_layers"],
        n_heads=cfg["num_heads"],
        window_size=cfg.get("window_size", 256),
        attention_pattern=tuple(layers[:period]),
        ffn_hidden_dim=cfg.get("intermediate_size"),
        norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
    )
