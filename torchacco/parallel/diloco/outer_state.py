"""The outer state of each fragment: θ_global, the outer momentum m and top-k's residual e, flat fp32 over the pieces
of θ this rank holds (`Strategy.theta`), on the device or offloaded to pinned host memory."""

from __future__ import annotations

import torch

from torchacco.blocks import block_list, unwrap
from torchacco.errors import UserError


def fragment_of(module: torch.nn.Module, names: list[str], fragments: int) -> list[int]:
    """The fragment of each parameter name: block i of L goes to fragment ⌊i·P / L⌋; parameters outside the blocks go
    with the first fragment before them (embeddings) or the last after them (final norm, output head)."""
    blocks = block_list(module)
    if fragments > max(len(blocks), 1):
        raise UserError(f"[diloco] fragments = {fragments} exceeds the {len(blocks)} transformer blocks "
                        "of the model (on this rank's pipeline stage); use at most that many")  # fmt: skip
    index = {id(b): i for i, b in enumerate(blocks)}
    prefixes = [(name + ".", index[id(m)]) for name, m in module.named_modules() if id(m) in index]
    out, after_blocks = [], False
    for name in names:
        block = next((i for prefix, i in prefixes if name.startswith(prefix)), None)
        if block is None:
            out.append(fragments - 1 if after_blocks else 0)
        else:
            after_blocks = True
            out.append(block * fragments // len(blocks))
    return out


class OuterState:
    """Per fragment f: `by_fragment[f]` of this rank's θ, and θ_global, m and e of them (`global_params`, `momentum`,
    `residual`: with topk only)."""

    def __init__(self, inner, options, device):
        self.inner, self.device = inner, device
        named = inner.theta.named_tensors()
        which = fragment_of(unwrap(inner.model), [n for n, _ in named], options.fragments)
        self.by_fragment = [[p for (_, p), f in zip(named, which) if f == frag] for frag in range(options.fragments)]
        self.home = torch.device("cpu") if options.offload else device.torch
        pin = options.offload and device.type == "cuda"
        self.global_params = [self.gather(f).to(self.home).pin_memory() if pin else self.gather(f).to(self.home).clone()
                              for f in range(options.fragments)]  # fmt: skip
        self.momentum = [torch.zeros_like(b) for b in self.global_params]
        self.residual = [torch.zeros_like(b) for b in self.global_params] if options.topk else []  # not sent yet
        self.largest = max(b.numel() for b in self.global_params)

    @staticmethod
    def check(d) -> None:
        if d.outer_lr <= 0 or not 0.0 <= d.outer_momentum < 1.0:
            raise UserError(f"[diloco] outer_lr = {d.outer_lr:g} must be positive and outer_momentum = "
                            f"{d.outer_momentum:g} in [0, 1)")  # fmt: skip

    def gather(self, f: int) -> torch.Tensor:
        """This rank's θ for fragment f, flat (a one-element placeholder when the rank holds none of it)."""
        pieces = self.by_fragment[f]
        if not pieces:
            return torch.zeros(1, dtype=torch.float32, device=self.device.torch)
        return torch.cat([p.detach().reshape(-1).float() for p in pieces])

    def scatter(self, f: int, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.by_fragment[f]:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def write_all(self, flats: list[torch.Tensor]) -> None:
        for f, flat in enumerate(flats):
            self.scatter(f, flat.to(self.device.torch))
        self.inner.theta.refresh_copies()

    def delta(self, f: int) -> torch.Tensor:
        """Δ = θ_global − θ_r of fragment f."""
        return self.global_params[f].to(self.device.torch) - self.gather(f)

    def step(self, f: int, mean: torch.Tensor, mu: float, lr: float) -> torch.Tensor:
        """m ← μ·m + Δ̄; θ_global ← θ_global − η·(Δ̄ + μ·m), for a Δ̄ on `home`: θ_global on the device."""
        theta, momentum = self.global_params[f], self.momentum[f]
        momentum.mul_(mu).add_(mean)
        theta.sub_(mean.add(momentum, alpha=mu), alpha=lr)
        return theta.to(self.device.torch)

    def state_dict(self) -> dict:
        named = {"backup": self.global_params, "momentum": self.momentum, "residual": self.residual}
        return {f"{name}{f}": t for name, per_fragment in named.items() for f, t in enumerate(per_fragment)}
