"""Llama 3 / 3.1 / 3.2 (Meta), as in Hugging Face's LlamaForCausalLM.

Pre-norm decoder: RMSNorm, grouped-query attention with rotary positions (optionally with
Llama 3.1's long-context frequency scaling), SwiGLU feed-forward, no biases. RoPE uses
HF's rotate-half layout, so HF q/k weights load without permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def meta_ffn_dim(dim: int, multiple_of: int = 256, multiplier: float | None = None) -> int:
    """Meta's SwiGLU width: 2/3 of 4*dim (same FLOPs as a 4*dim GELU MLP), scaled, rounded up."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass
class ModelArgs:
    vocab_size: int = 10000
    max_seq_len: int = 2048  # size of the RoPE table
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: n_heads (no grouping)
    ffn_hidden_dim: int | None = None  # None: meta_ffn_dim(dim)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 RoPE scaling; None turns it off
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = False  # Llama 3.2 1B/3B share the head with the embedding

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.kv_heads:
            raise ValueError(f"need dim % n_heads == 0 and n_heads % n_kv_heads == 0, got {self}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or meta_ffn_dim(self.dim)

    def num_params(self, embeddings: bool = True) -> int:
        d, kv_dim = self.dim, self.kv_heads * self.head_dim
        block = 2 * d * d + 2 * d * kv_dim + 3 * d * self.hidden_dim + 2 * d
        n = self.n_layers * block + d
        if not self.tie_embeddings:
            n += self.vocab_size * d  # the head
        if embeddings:
            n += self.vocab_size * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token: 6 * N + 12 * n_layers * dim * seq_len.

        N counts the weights used in matmuls: all non-embedding parameters plus the head
        (vocab * dim, also when tied); the embedding lookup is free. The second term is
        attention scores and values (2 * 2 * dim * seq_len per layer forward, x3 with
        backward; the PaLM convention that ignores the causal halving).
        """
        n = self.num_params(embeddings=False) + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        return 6 * n + 12 * self.n_layers * self.dim * seq_len


def rope_table(args: ModelArgs, device=None) -> torch.Tensor:
    """cos and sin per position, [max_seq_len, 2, head_dim], fp32, rotate-half layout."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
    if args.rope_scaling_factor is not None:
        # Llama 3.1: frequencies with few periods in the original context are slowed down by
        # `factor`, those with many are kept, and the ones in between are interpolated.
        periods = args.rope_original_max_seq_len * inv_freq / (2 * math.pi)
        keep = (periods - args.rope_low_freq_factor) / (args.rope_high_freq_factor - args.rope_low_freq_factor)
        keep = keep.clamp(0.0, 1.0)
        inv_freq = inv_freq * keep + inv_freq / args.rope_scaling_factor * (1 - keep)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, head_dim]; rope: [T, 2, head_dim]."""
    cos, sin = rope.to(x.dtype).unbind(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, hd = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * hd, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(self.n_heads * hd, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, -1).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, -1).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        gqa = self.n_kv_heads != self.n_heads  # SDPA shares each kv head among n_heads/n_kv_heads queries
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # gate
        self.w2 = nn.Linear(args.hidden_dim, args.dim, bias=False)  # down
        self.w3 = nn.Linear(args.dim, args.hidden_dim, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama3(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        # a tied head reuses tok_embeddings.weight in forward (a shared Parameter would be
        # split in two by to_empty())
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}")
        x = self.tok_embeddings(tokens)
        rope = self.rope[:T]
        for block in self.layers:
            x = block(x, rope)
        x = self.norm(x)
        return F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02); residual projections (wo, w2) scaled by 1/sqrt(2 * n_layers); RoPE table rebuilt."""
        self.rope.copy_(rope_table(self.args))  # on CPU, so every device gets the same table
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=resid_std if name.endswith(("wo", "w2")) else std)
            elif isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
