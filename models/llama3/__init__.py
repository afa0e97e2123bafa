"""Llama 3: debug model for CPU, and the Llama 3.2 1B / 3.1 8B / 3.1 70B shapes."""

from torchacco.spec import ModelSpec, renaming_adapter

from . import hf, parallelize
from .model import Llama3, ModelArgs, meta_ffn_dim

# Meta's released models: 128k tokenizer, rope_theta 500k, RoPE scaling for long context.
# max_seq_len is the RoPE table we build (override it per run); 8192 is the original context.
_META = dict(vocab_size=128256, max_seq_len=8192, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0)

flavors = {
    # ~6.2M with the embedded 10k tokenizer (embedding + head are 3.8M of it); GQA 3:1
    "debug": ModelArgs(vocab_size=10000, max_seq_len=2048, dim=192, n_layers=6, n_heads=6, n_kv_heads=2),
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=meta_ffn_dim(2048, 256, 1.5),
        rope_scaling_factor=32.0, tie_embeddings=True, **_META,
    ),
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=meta_ffn_dim(4096, 1024, 1.3),
        rope_scaling_factor=8.0, **_META,
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=meta_ffn_dim(8192, 4096, 1.3),
        rope_scaling_factor=8.0, **_META,
    ),
}  # fmt: skip

spec = ModelSpec(
    name="llama3",
    model_cls=Llama3,
    flavors=flavors,
    hf=renaming_adapter("Llama", hf.name_map, hf.ignored, hf.hf_config, hf.args_from_hf_config),
    tensor_parallel=parallelize.tensor_parallel,
    pipeline=parallelize.pipeline,
)
