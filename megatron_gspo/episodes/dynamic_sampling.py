"""DAPO's dynamic sampling: train only on groups whose responses tell the policy something.

A group whose rewards are all equal has every advantage zero: it adds nothing to the gradient
but still counts in the loss's sequence count, diluting the groups that do. With
``rollout.dynamic_sampling: {max_rounds: R}`` such groups are dropped and further prompts are
sampled (from the same prompt stream, so a resumed run continues exactly) until
``prompts_per_step`` groups with a signal are found or ``R`` generations have been spent; the
step then trains on what it has, and the loss's normalization counts exactly those groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import groupby

from megatron_gspo.trainer.packing import Sample

__all__ = ["by_group", "fill_with_signal", "groups_without_signal"]


def by_group(samples: list[Sample]) -> list[list[Sample]]:
    """Consecutive samples of one prompt (a scored batch keeps each prompt's together)."""
    return [list(g) for _, g in groupby(samples, key=lambda s: s.prompt_index)]


def _has_signal(group: list[Sample]) -> bool:
    return any(s.advantage != 0.0 or any(s.token_advantages or ()) for s in group)


def groups_without_signal(samples: list[Sample]) -> float:
    """The fraction of the samples' groups whose advantages are all zero."""
    groups = by_group(samples)
    return sum(not _has_signal(g) for g in groups) / max(len(groups), 1)


def fill_with_signal(
    first: list[Sample],
    more: Callable[[int], list[Sample]],
    *,
    want: int,
    max_rounds: int,
) -> tuple[list[Sample], dict[str, float]]:
    """Groups with a signal from ``first``, then from ``more(round)`` (round = 1, 2, ...),
    until ``want`` groups or ``max_rounds`` batches in all; prompt indices renumbered."""
    kept: list[list[Sample]] = []
    generated, rounds, batch = 0, 0, first
    while True:
        rounds += 1
        groups = by_group(batch)
        generated += len(groups)
        kept += [g for g in groups if _has_signal(g)]
        if len(kept) >= want or rounds >= max_rounds:
            break
        batch = more(rounds)
    with_signal = len(kept)
    samples = [replace(s, prompt_index=i) for i, g in enumerate(kept[:want]) for s in g]
    return samples, {
        "filtered_groups_fraction": 1.0 - with_signal / max(generated, 1),
        "dynamic_sampling_rounds": float(rounds),
    }
