"""Paired comparisons of two methods run with the same seeds: per-seed differences, the mean
difference with a percentile bootstrap 95% interval, and a two-sided sign test.

Pairing by seed removes what the seed alone decides (initial weights, prompts, samples), so a
few runs say more than two unpaired means would; the bootstrap makes no normality assumption,
and the sign test none on the size of the differences.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Paired", "bootstrap_interval", "paired", "sign_test"]


def bootstrap_interval(
    values: Sequence[float], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (seeded: the same values give
    the same interval)."""
    if not values:
        raise ValueError("bootstrap_interval needs at least one value")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistics.fmean(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1.0 - level) / 2
    lo = means[int(math.floor(tail * (resamples - 1)))]
    hi = means[int(math.ceil((1.0 - tail) * (resamples - 1)))]
    return lo, hi


def sign_test(differences: Sequence[float]) -> float:
    """Two-sided exact sign test: the probability, were either method as likely to come out
    ahead on a seed, of a split at least this uneven. Ties are left out; none left: 1."""
    wins = sum(d > 0 for d in differences)
    losses = sum(d < 0 for d in differences)
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class Paired:
    """``method - baseline`` on one figure, seed by seed."""

    differences: tuple[float, ...]
    mean: float
    low: float
    high: float
    wins: int
    losses: int
    p_sign: float

    @property
    def shown(self) -> bool:
        """Whether the interval leaves 0 out."""
        return self.low > 0 or self.high < 0

    def verdict(self, higher_is_better: bool = True) -> str:
        if not self.shown:
            return "no difference shown"
        better = (self.mean > 0) == higher_is_better
        return "better" if better else "worse"


def paired(method: Sequence[float], baseline: Sequence[float], *, seed: int = 0) -> Paired:
    """Compare two methods' figures taken seed by seed (same order, same seeds)."""
    if len(method) != len(baseline) or not method:
        raise ValueError(
            f"paired comparison needs the same seeds on both sides, got {len(method)} and "
            f"{len(baseline)} runs"
        )
    d = tuple(a - b for a, b in zip(method, baseline, strict=True))
    low, high = bootstrap_interval(d, seed=seed)
    return Paired(
        differences=d,
        mean=statistics.fmean(d),
        low=low,
        high=high,
        wins=sum(x > 0 for x in d),
        losses=sum(x < 0 for x in d),
        p_sign=sign_test(d),
    )
