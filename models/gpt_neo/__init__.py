"""GPT-Neo: the ACCO paper's model family (TinyStories 36M, OpenWebText 125M, Alpaca 2.7B)."""

from torchacco.spec import ModelSpec, renaming_adapter

from . import hf, parallelize
from .model import GPTNeo, ModelArgs

_HF_SIZES = dict(vocab_size=50257, max_seq_len=2048, window_size=256)  # EleutherAI checkpoints

flavors = {
    # fast CPU runs; small window so that local attention matters at short sequences
    "debug": ModelArgs(vocab_size=10000, max_seq_len=512, dim=128, n_layers=2, n_heads=4, window_size=64),
    # ~5.9M with the embedded 10k tokenizer
    "tiny": ModelArgs(vocab_size=10000, max_seq_len=512, dim=256, n_layers=4, n_heads=8, window_size=256),
    # TinyStories-33M's shape (Eldan & Li) with a 10k vocab and 512 positions: 36.4M, the
    # ACCO paper's TinyStories model
    "36M": ModelArgs(vocab_size=10000, max_seq_len=512, dim=768, n_layers=4, n_heads=16, window_size=256),
    "125M": ModelArgs(dim=768, n_layers=12, n_heads=12, **_HF_SIZES),
    "1.3B": ModelArgs(dim=2048, n_layers=24, n_heads=16, **_HF_SIZES),
    "2.7B": ModelArgs(dim=2560, n_layers=32, n_heads=20, **_HF_SIZES),
}

spec = ModelSpec(
    name="gpt_neo",
    model_cls=GPTNeo,
    flavors=flavors,
    hf=renaming_adapter("GPT-Neo", hf.name_map, hf.ignored, hf.hf_config, hf.args_from_hf_config),
    tensor_parallel=parallelize.tensor_parallel,
    pipeline=parallelize.pipeline,
)
