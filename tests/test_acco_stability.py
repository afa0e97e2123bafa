"""The linear model behind docs/acco.md's account of ACCO's per-token gap at a large lr
(benchmarks/acco_stability.py): the largest stable lr × curvature of DDP's and ACCO's updates."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))
from benchmarks.acco_stability import max_stable  # noqa: E402


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
