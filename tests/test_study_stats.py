"""The statistics the studies report: the paired bootstrap interval and the sign test, against
closed forms and known cases."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.paired import bootstrap_interval, paired, sign_test


def test_the_sign_test_matches_the_binomial_tails():
    assert sign_test([1.0] * 10) == pytest.approx(2 / 2**10)
    # 8 of 10: 2 * P(X >= 8) = 2 * (45 + 10 + 1) / 1024.
    assert sign_test([1.0] * 8 + [-1.0] * 2) == pytest.approx(2 * 56 / 1024)
    assert sign_test([-1.0] * 8 + [1.0] * 2) == sign_test([1.0] * 8 + [-1.0] * 2)
    assert sign_test([1.0] * 5 + [-1.0] * 5) == 1.0
    assert sign_test([0.0, 0.0, 2.0]) == 1.0  # ties left out: one win of one
    assert sign_test([]) == 1.0


def test_the_bootstrap_interval_brackets_the_mean_and_narrows_with_more_seeds():
    assert bootstrap_interval([0.3] * 10) == (0.3, 0.3)
    rng = random.Random(1)
    few = [rng.gauss(1.0, 1.0) for _ in range(10)]
    many = [rng.gauss(1.0, 1.0) for _ in range(200)]
    lo, hi = bootstrap_interval(few)
    assert lo < statistics.fmean(few) < hi
    lo2, hi2 = bootstrap_interval(many)
    assert lo2 < 1.0 < hi2 and hi2 - lo2 < hi - lo
    assert bootstrap_interval(few) == bootstrap_interval(few)  # seeded


@pytest.mark.parametrize("level, z", [(0.95, 1.959964), (0.90, 1.644854), (0.99, 2.575829)])
def test_the_bootstrap_interval_has_the_width_of_its_level(level, z):
    """For the mean of 200 normal draws the bootstrap distribution is the normal one with the
    sample's standard error, so the interval is 2 z(level) standard errors wide: within 5%,
    which tells 95% (1.96) from 90% (1.64) and 99% (2.58)."""
    rng = random.Random(1)
    values = [rng.gauss(1.0, 1.0) for _ in range(200)]
    lo, hi = bootstrap_interval(values, level=level)
    se = statistics.pstdev(values) / len(values) ** 0.5
    assert hi - lo == pytest.approx(2 * z * se, rel=0.05), (level, (hi - lo) / (2 * se))


def test_a_paired_comparison_says_no_difference_where_the_interval_covers_zero():
    base = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    # A constant shift, hidden unpaired by the seeds' spread, is shown paired.
    better = paired([b + 0.1 for b in base], base)
    assert better.mean == pytest.approx(0.1) and better.wins == 10 and better.shown
    assert better.verdict() == "better" and better.verdict(higher_is_better=False) == "worse"
    mixed = paired([b + d for b, d in zip(base, [0.1, -0.1] * 5, strict=True)], base)
    assert mixed.low < 0 < mixed.high and mixed.verdict() == "no difference shown"
    assert mixed.p_sign == 1.0
    with pytest.raises(ValueError, match="same seeds"):
        paired([1.0], [1.0, 2.0])


def test_a_study_of_one_task_keeps_the_other_tasks_figures(monkeypatch):
    import argparse

    from benchmarks import study_multi_turn as study

    # No runs on disk and no plot: only the section's assembly is under test.
    monkeypatch.setattr(study, "plot", lambda task, runs: study.DOCS / "unused.png")
    monkeypatch.setattr(study, "_metrics", lambda path: [])
    begin, end = study._marks("relay_digits")
    relay = f"{begin}\n### relay_digits\n\n| figures | from an earlier study |\n{end}"
    args = argparse.Namespace(tasks=["recall_key"], seeds=[0, 1], steps=150)
    text = "\n".join(study.section(args, {"relay_digits": relay}))
    blocks = study._blocks(text)
    assert blocks["relay_digits"] == relay
    assert "No seed has finished" in blocks["recall_key"]
    assert text.index(relay) < text.index("### recall_key") < text.index(study.END)
