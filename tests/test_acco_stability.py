"""The linear model behind docs/acco.md's account of ACCO's per-token gap at a large lr
(benchmarks/acco_stability.py): the largest stable lr × curvature of DDP's and ACCO's updates."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from benchmarks.acco_stability import max_stable, noise_ratio  # noqa: E402


@pytest.mark.parametrize("beta1", [0.9, 0.95])
def test_acco_halves_are_stable_to_half_of_ddps_bound_and_a_larger_share_at_the_estimate_restores_it(beta1):
    ddp = max_stable(beta1, share=None)
    assert ddp == pytest.approx(2 * (1 + beta1) / (1 - beta1), abs=0.02)
    # The estimate's error feeds back as e' = −η(1 − β1)h(1 − s)e: unstable beyond η·h = 1 / ((1 − β1)(1 − s)).
    for share in (0.25, 0.5, 0.75, 0.875):
        bound = min(ddp, 1 / ((1 - beta1) * (1 - share)))
        assert max_stable(beta1, share=share) == pytest.approx(bound, abs=0.02)


def test_blending_the_first_moment_or_damping_the_estimate_lowers_the_bound():
    paper = max_stable(0.9, share=0.5)
    assert max_stable(0.9, share=0.5, w=0.5) < paper / 2
    assert max_stable(0.9, share=0.5, gamma=0.5) < paper / 2


def simulated_variance(
    a: float, share: float | None, k: float = 1.0, steps: int = 200_000, beta1: float = 0.9
) -> float:
    """E[x²] of the noisy linear update, by simulation: the reference for the Lyapunov solution."""
    g = torch.Generator().manual_seed(0)
    x = m = x_est = 0.0
    noise = torch.randn(steps, 2, generator=g, dtype=torch.float64).tolist()
    total = 0.0
    alpha = None if share is None else k * share / (k * share + 1 - share)  # the commit's weight at x̃
    for i, (n1, n2) in enumerate(noise):
        if share is None:
            m = beta1 * m + (1 - beta1) * (a * x + n1)
            x -= m
        else:
            g_est = a * x_est + n1 / share**0.5  # the share at x̃: variance σ² / s
            g_rest = a * x + n2 / (1 - share) ** 0.5
            m_est = beta1 * m + (1 - beta1) * g_est  # the estimate steps with its own part alone
            m = beta1 * m + (1 - beta1) * (alpha * g_est + (1 - alpha) * g_rest)
            x, x_est = x - m, x - m_est
        if i >= steps // 10:  # past the transient
            total += x * x
    return total / (steps - steps // 10)


@pytest.mark.parametrize("a, share, k", [(10, 0.5, 1.0), (15, 0.75, 1.0), (15, 0.5, 1.857)])
def test_the_noise_ratio_is_the_simulated_variance_over_ddps(a, share, k):
    expected = simulated_variance(a, share, k) / simulated_variance(a, None)
    assert noise_ratio(a, share=share, k=k) == pytest.approx(expected, rel=0.05)


def test_the_estimate_amplifies_gradient_noise_below_its_bound_and_a_larger_share_amplifies_it_less():
    assert noise_ratio(10, share=None) == pytest.approx(1.0)
    assert noise_ratio(1, share=0.5) == pytest.approx(1.0, abs=0.01)  # small steps: the estimate is exact
    assert noise_ratio(15, share=0.5) > 1.3
    assert noise_ratio(15, share=0.875) < noise_ratio(15, share=0.75) < noise_ratio(15, share=0.5)
    assert noise_ratio(25, share=0.5) == float("inf")  # beyond halves' bound of 20


def test_counting_the_tokens_at_the_estimate_more_raises_the_bound_as_the_commits_weight_there_says():
    k = 1.857  # 65% of the commit's weight at x̃ with halves
    alpha = k * 0.5 / (k * 0.5 + 0.5)
    assert max_stable(0.9, share=0.5, k=k) == pytest.approx(1 / ((1 - 0.9) * (1 - alpha)), abs=0.02)
    assert noise_ratio(15, share=0.5, k=k) < noise_ratio(15, share=0.5)
    assert noise_ratio(1, share=0.5, k=3.0) > 1.1  # an uneven mean costs variance where the estimate is exact
