"""The largest stable step of DDP's and ACCO's updates along one curvature direction (a linear model).

    .venv/bin/python -m benchmarks.acco_stability

Along an eigen-direction of the (Adam-preconditioned) Hessian with curvature h, with the second moment frozen,
AdamW is heavy-ball momentum: m' = β1·m + (1 − β1)·g, x' = x − η·m'. DDP takes g = h·x and is stable while
η·h < 2(1 + β1)/(1 − β1) (38 at β1 = 0.9). ACCO takes a share s of its gradient at the estimate x̃ and the rest at x:

    g  = h·(s·x̃ + (1 − s)·x)                      the commit's gradient
    x̃' = x + γ·(−η·(β1·m + (1 − β1)·ĝ)),  ĝ = w·h·x̃ + (1 − w)·m̂      the estimate (w = γ = 1: Opt(x, g̃))

so the estimate's error e = x̃ − x obeys e' = −η·(1 − β1)·h·(1 − s)·e + …: it feeds back through the curvature.
This prints the largest stable η·h of each variant: where Adam trains at the edge of stability (a large lr), that
bound is the sharpness the optimizer can follow, and a lower one behaves like a larger lr.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.names import DDP


def update_matrix(a: float, beta1: float, share: float | None, w: float = 1.0, gamma: float = 1.0) -> torch.Tensor:
    """The linear map of one update at η·h = a (η = 1): on (x, m) for DDP (share None), on (x, m, x̃) for ACCO."""
    b = beta1
    if share is None:
        return torch.tensor([[1 - (1 - b) * a, -b], [(1 - b) * a, b]], dtype=torch.float64)
    m_new = torch.tensor([(1 - b) * a * (1 - share), b, (1 - b) * a * share], dtype=torch.float64)
    x_new = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) - m_new
    m_est = torch.tensor([0.0, b + (1 - b) * (1 - w), (1 - b) * w * a], dtype=torch.float64)
    x_est = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64) - gamma * m_est
    return torch.stack([x_new, m_new, x_est])


def max_stable(beta1: float = 0.9, share: float | None = 0.5, w: float = 1.0, gamma: float = 1.0) -> float:
    """The largest η·h (to 0.01) at which the update's spectral radius stays ≤ 1."""
    radius = lambda a: torch.linalg.eigvals(update_matrix(a, beta1, share, w, gamma)).abs().max().item()  # noqa: E731
    lo, hi = 1e-3, 1e3  # stable at lo, unstable at hi
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if radius(mid) <= 1 + 1e-12 else (lo, mid)
    return round(lo, 2)


VARIANTS = {
    DDP: dict(share=None),
    "acco (paper: halves, Opt(θ, g̃))": dict(share=0.5),
    "acco estimate_share 0.75": dict(share=0.75),
    "acco estimate_grad_weight 0.5": dict(share=0.5, w=0.5),
    "acco estimate_grad_weight 0 (moments alone)": dict(share=0.5, w=0.0),
    "acco estimate_damping 0.5": dict(share=0.5, gamma=0.5),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beta1", type=float, default=0.9)
    args = parser.parse_args(argv)
    print(f"largest stable lr × curvature (β1 = {args.beta1:g}):")
    for name, kw in VARIANTS.items():
        print(f"  {name:45s} {max_stable(args.beta1, **kw):6.2f}")


if __name__ == "__main__":
    main()
