"""torchacco: PyTorch-native LLM training with ACCO (Accumulate While You Communicate)."""

__version__ = "0.1.0"
