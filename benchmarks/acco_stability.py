"""The largest stable step of DDP's and ACCO's updates along one curvature direction (a linear model).

    .venv/bin/python -m benchmarks.acco_stability

Along an eigen-direction of the (Adam-preconditioned) Hessian with curvature h, with the second moment frozen,
AdamW is heavy-ball momentum: m' = β1·m + (1 − β1)·g, x' = x − η·m'. DDP takes g = h·x and is stable while
η·h < 2(1 + β1)/(1 − β1) (38 at β1 = 0.9). ACCO computes a share s of its batch at the estimate x̃ and the rest at
x, and weighs the part at x̃ by α (α = s for the plain token mean; k·s / (k·s + 1 − s) when those tokens count k
times, `[acco] estimate_token_weight`):

    g  = h·(α·x̃ + (1 − α)·x)                      the commit's gradient
    x̃' = x + γ·(−η·(β1·m + (1 − β1)·ĝ)),  ĝ = w·h·x̃ + (1 − w)·m̂      the estimate (w = γ = 1: Opt(x, g̃))

so the estimate's error e = x̃ − x obeys e' = −η·(1 − β1)·h·(1 − α)·e + …: it feeds back through the curvature.
This prints the largest stable η·h of each variant: where Adam trains at the edge of stability (a large lr), that
bound is the sharpness the optimizer can follow, and a lower one behaves like a larger lr.

Below the bound the estimate still costs loss: with gradient noise (ξ̃ on the share s of the batch at x̃, ξ on the
rest, variances σ²/s and σ²/(1 − s) for a batch whose mean has σ²) the estimate steps with ξ̃ alone, and the next
commit's gradient at x̃ carries h·e, noise of the estimate's making; weighing the tokens unevenly (α ≠ s) adds
variance of its own. It also prints the stationary E[x²] of each
variant over DDP's at a few η·h (loss above the minimum along that direction is h·E[x²] / 2).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from benchmarks.names import DDP


@dataclass(frozen=True)
class Variant:
    """An update in the model: DDP (share None), or ACCO with `[acco]`'s estimate options."""

    share: float | None = 0.5  # estimate_share: the batch's share computed at x̃
    w: float = 1.0  # estimate_grad_weight
    gamma: float = 1.0  # estimate_damping
    k: float = 1.0  # estimate_token_weight: the commit counts the tokens at x̃ k times

    @property
    def alpha(self) -> float:
        """The commit's weight on the gradient at x̃."""
        return self.k * self.share / (self.k * self.share + 1 - self.share)


def update_matrix(a: float, beta1: float, v: Variant) -> torch.Tensor:
    """The linear map of one update at η·h = a (η = 1): on (x, m) for DDP, on (x, m, x̃) for ACCO."""
    b = beta1
    if v.share is None:
        return torch.tensor([[1 - (1 - b) * a, -b], [(1 - b) * a, b]], dtype=torch.float64)
    m_new = torch.tensor([(1 - b) * a * (1 - v.alpha), b, (1 - b) * a * v.alpha], dtype=torch.float64)
    x_new = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) - m_new
    m_est = torch.tensor([0.0, b + (1 - b) * (1 - v.w), (1 - b) * v.w * a], dtype=torch.float64)
    x_est = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) - v.gamma * m_est
    return torch.stack([x_new, m_new, x_est])


def noise_input(beta1: float, v: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Q): how the update's gradient noise enters the state of `update_matrix`, and its covariance (σ² = 1)."""
    b = beta1
    if v.share is None:
        return torch.tensor([[-(1 - b)], [1 - b]], dtype=torch.float64), torch.eye(1, dtype=torch.float64)
    m_new = torch.tensor([(1 - b) * v.alpha, (1 - b) * (1 - v.alpha)], dtype=torch.float64)  # from (ξ̃, ξ)
    x_est = torch.tensor([-v.gamma * (1 - b) * v.w, 0.0], dtype=torch.float64)  # the estimate steps with ξ̃ alone
    q = torch.diag(torch.tensor([1 / v.share, 1 / (1 - v.share)], dtype=torch.float64))
    return torch.stack([-m_new, m_new, x_est]), q


def stationary_variance(a: float, beta1: float, v: Variant) -> float:
    """E[x²] once the noisy update has settled (inf where it is unstable): Σ = AΣAᵀ + BQBᵀ."""
    a_ = update_matrix(a, beta1, v)
    if torch.linalg.eigvals(a_).abs().max().item() >= 1:
        return float("inf")
    b_, q = noise_input(beta1, v)
    n = a_.shape[0]
    vec = torch.linalg.solve(torch.eye(n * n, dtype=torch.float64) - torch.kron(a_, a_), (b_ @ q @ b_.T).reshape(-1))
    return vec.reshape(n, n)[0, 0].item()


def noise_ratio(a: float, beta1: float = 0.9, **variant) -> float:
    """The variant's stationary E[x²] over DDP's at η·h = a."""
    return stationary_variance(a, beta1, Variant(**variant)) / stationary_variance(a, beta1, Variant(share=None))


def max_stable(beta1: float = 0.9, **variant) -> float:
    """The largest η·h (to 0.01) at which the update's spectral radius stays ≤ 1."""
    v = Variant(**variant)
    radius = lambda a: torch.linalg.eigvals(update_matrix(a, beta1, v)).abs().max().item()  # noqa: E731
    lo, hi = 1e-3, 1e3  # stable at lo, unstable at hi
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) <= 1 + 1e-12 else (lo, mid)
    return round(lo, 2)


VARIANTS = {
    DDP: dict(share=None),
    "acco (paper: halves, Opt(θ, g̃))": dict(share=0.5),
    "acco estimate_share 0.75": dict(share=0.75),
    "acco estimate_share 0.875": dict(share=0.875),
    "acco estimate_grad_weight 0.5": dict(share=0.5, w=0.5),
    "acco estimate_grad_weight 0 (moments alone)": dict(share=0.5, w=0.0),
    "acco estimate_damping 0.5": dict(share=0.5, gamma=0.5),
    "acco estimate_token_weight 1.857 (65% at θ̃)": dict(share=0.5, k=1.857),
}


AT = (5, 10, 15, 20, 30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beta1", type=float, default=0.9)
    args = parser.parse_args(argv)
    print(f"largest stable lr × curvature (β1 = {args.beta1:g}), and E[x²] over DDP's at lr × curvature {AT}:")
    for name, kw in VARIANTS.items():
        ratios = "  ".join(f"{noise_ratio(a, args.beta1, **kw):6.2f}" for a in AT)
        print(f"  {name:45s} {max_stable(args.beta1, **kw):6.2f}   {ratios}")


if __name__ == "__main__":
    main()
