"""A small pre-norm decoder: RMSNorm, causal attention with learned positions, a ReLU² MLP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ToyArgs:
    vocab_size: int = 400
    max_seq_len: int = 64
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 128

    def flops_per_token(self, seq_len: int) -> float:
        per_layer = 4 * self.dim * self.dim + 2 * self.dim * self.hidden_dim
        return 6 * (self.n_layers * per_layer + self.vocab_size * self.dim) + 12 * self.n_layers * self.dim * seq_len


class Attention(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.n_heads = args.n_heads  # divided by tp when the projections are split
        self.q, self.k, self.v = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(3))
        self.o = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, self.n_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.up = nn.Linear(args.dim, args.hidden_dim, bias=False)
        self.down = nn.Linear(args.hidden_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
        self.attn, self.mlp = Attention(args), MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Toy(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.tokens = nn.Embedding(args.vocab_size, args.dim)
        self.positions = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.ndim == 1:
                nn.init.ones_(p)
            else:
                nn.init.normal_(
                    p,
                    std=0.02
                    / (math.sqrt(2 * self.args.n_layers) if name.endswith(("o.weight", "down.weight")) else 1.0),
                )
