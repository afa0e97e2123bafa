"""GPT-Neo (EleutherAI), as in Hugging Face's GPTNeoForCausalLM.

A GPT-2-like decoder with learned absolute positions, LayerNorm, a gelu (tanh) MLP, a head
tied to the token embedding, and attention that alternates between global (causal) and
local (causal, sliding window) layers. Two quirks to keep for checkpoint parity: attention
scores are not scaled by 1/sqrt(head_dim), and q/k/v projections have no bias.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int = 10000
    max_seq_len: int = 512  # size of the learned position table
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    window_size: int = 256  # local layers see this many tokens, themselves included
    attention_pattern: tuple[str, ...] = ("global", "local")  # repeated over the layers
    ffn_hidden_dim: int | None = None  # None: 4 * dim
    norm_eps: float = 1e-5

    def __post_init__(self):
        self.attention_pattern = tuple(self.attention_pattern)  # TOML/JSON give lists
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if not set(self.attention_pattern) <= {"global", "local"}:
            raise ValueError(f"attention_pattern must hold 'global'/'local', got {self.attention_pattern}")

    @property
    def hidden_dim(self) -> int:
        return self.ffn_hidden_dim or 4 * self.dim

    def layer_type(self, i: int) -> str:
        return self.attention_pattern[i % len(self.attention_pattern)]

    def num_params(self, embeddings: bool = True) -> int:
        d, h = self.dim, self.hidden_dim
        block = 2 * 2 * d + 4 * d * d + d + 2 * d * h + h + d  # 2 LayerNorms, attn, MLP
        n = self.n_layers * block + 2 * d  # + final LayerNorm
        if embeddings:
            n += (self.vocab_size + self.max_seq_len) * d  # head is tied: counted once
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Forward + backward FLOPs per token: 6 * N + 6 * sum over layers of 2 * dim * span.

        N counts the weights used in matmuls: every non-embedding parameter plus the tied
        head (vocab * dim); the wte/wpe lookups are free. Per layer, scores and the weighted
        sum of values cost 2 * 2 * dim * span forward (x3 with backward), where span is
        seq_len for global layers and min(seq_len, window_size) for local ones (useful work,
        the PaLM convention that ignores the causal halving).
        """
        n = self.num_params(embeddings=False) + self.vocab_size * self.dim
        spans = sum(
            seq_len if self.layer_type(i) == "global" else min(seq_len, self.window_size) for i in range(self.n_layers)
        )
        return 6 * n + 12 * self.dim * spans


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, local: bool):
        super().__init__()
        self.n_heads = args.n_heads
        self.window = args.window_size if local else None
        self.q_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.dim, bias=False)
        self.out_proj = nn.Linear(args.dim, args.dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_heads, -1).transpose(1, 2)
        # GPT-Neo uses unscaled scores (scale=1). HF upcasts q, k to fp32 for them; SDPA kernels
        # already form scores and softmax in fp32 from bf16/fp16 inputs, so no upcast is needed.
        if self.window is None or T <= self.window:  # plain causal: the fast kernels apply
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
        else:
            # causal band: key j is visible from query i when i - window < j <= i
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().triu(1 - self.window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))  # -1: local heads under tensor parallelism


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.c_fc = nn.Linear(args.dim, args.hidden_dim)
        self.c_proj = nn.Linear(args.hidden_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # HF's "gelu_new"


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args, local=args.layer_type(layer_id) == "local")
        self.ln_2 = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTNeo(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.wte = nn.Embedding(args.vocab_size, args.dim)
        self.wpe = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.ln_f = nn.LayerNorm(args.dim, eps=args.norm_eps)
        # The head is wte.weight used in forward, not a second module sharing it: a shared
        # Parameter would be split in two by to_empty() and counted twice by sharding.

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}")
        x = self.wte(tokens) + self.wpe(torch.arange(T, device=tokens.device))
        for block in self.layers:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers)."""
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.wte.weight, std=std)
        nn.init.normal_(self.wpe.weight, std=std)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                is_resid = name.endswith(("attn.out_proj", "mlp.c_proj"))
                nn.init.normal_(m.weight, std=resid_std if is_resid else std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
