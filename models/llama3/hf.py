"""Llama 3 <-> Hugging Face `LlamaForCausalLM` names and config.json.

Our RoPE uses HF's rotate-half layout, so q/k weights map unchanged (no permutation).
A tied head (Llama 3.2 1B/3B) is not written; an incoming `lm_head.weight` is dropped
for tied models, as are the `rotary_emb.inv_freq` buffers of old checkpoints.
"""

from __future__ import annotations

from torchacco.errors import UserError

from .model import ModelArgs, meta_ffn_dim

_BLOCK_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def name_map(args: ModelArgs) -> dict[str, str]:
    """Our name -> HF name for every tensor."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(args.n_layers):
        for ours, theirs in _BLOCK_KEYS.items():
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def ignored(hf_name: str, args: ModelArgs) -> bool:
    return hf_name.endswith("rotary_emb.inv_freq") or (args.tie_embeddings and hf_name == "lm_head.weight")


def hf_config(args: ModelArgs) -> dict:
    rope_scaling = None
    if args.rope_scaling_factor is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # the pre-5.0 spelling (as on the Hub); transformers 5 folds it into rope_parameters
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        # special token ids belong to the tokenizer; an exporter that knows it may fill them
        "bos_token_id": None,
        "eos_token_id": None,
    }


def args_from_hf_config(cfg: dict) -> ModelArgs:
    # transformers 5 writes rope_parameters (theta included); older configs rope_theta + rope_scaling
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"Llama config: rope_type '{rope_type}' is not supported ('default', 'llama3' are)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("hidden_act", "silu") != "silu":
        raise UserError("Llama config: attention_bias, mlp_bias and hidden_act other than 'silu' are unsupported")
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise UserError(f"Llama config: head_dim {cfg['head_dim']} != hidden_size / num_attention_heads")
    n_kv = cfg.get("num_key_value_heads") or n_heads
    ffn = cfg["intermediate_size"]
    scaled = rope_type == "llama3"
    off = ModelArgs()  # the scaling fields' defaults, kept when scaling is off
    return ModelArgs(
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg["max_position_embeddings"],
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=None if n_kv == n_heads else n_kv,
        ffn_hidden_dim=None if ffn == meta_ffn_dim(dim) else ffn,
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling_factor=float(rope["factor"]) if scaled else None,
        rope_low_freq_factor=float(rope["low_freq_factor"]) if scaled else off.rope_low_freq_factor,
        rope_high_freq_factor=float(rope["high_freq_factor"]) if scaled else off.rope_high_freq_factor,
        rope_original_max_seq_len=rope["original_max_position_embeddings"] if scaled else off.rope_original_max_seq_len,
        tie_embeddings=cfg.get("tie_word_embeddings", False),
    )
