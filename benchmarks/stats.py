"""Intervals for paired differences over seeds: Student's t, two-sided 95%."""

from __future__ import annotations

import statistics

# by degrees of freedom; a dof between two keys takes the smaller key's (wider) value; 1.96 from 30 on
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
       15: 2.13, 20: 2.09, 25: 2.06}  # fmt: skip


def t95(dof: int) -> float:
    return T95[max(d for d in T95 if d <= dof)] if dof < 30 else 1.96


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% t-interval (nan for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
