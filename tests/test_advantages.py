"""group_advantages against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.loss import group_advantages


def test_values_against_hand_computation_sample_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    # Group 1: mean 0.5, sample std sqrt(((.5^2) * 4) / 3) = sqrt(1/3).
    s1 = math.sqrt(1 / 3)
    # Group 2: mean 5, sample std sqrt((9 + 1 + 1 + 9) / 3).
    s2 = math.sqrt(20 / 3)
    expected = torch.tensor(
        [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -3 / s2, -1 / s2, 1 / s2, 3 / s2]
    )
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32


def test_eps_and_scale_none():
    rewards = torch.tensor([0.0, 2.0], dtype=torch.float64)
    adv = group_advantages(rewards, 2, eps=0.5)
    std = math.sqrt(2.0)  # sample std of {0, 2}
    torch.testing.assert_close(adv, torch.tensor([-1 / (std + 0.5), 1 / (std + 0.5)]).double())
    torch.testing.assert_close(
        group_advantages(rewards, 2, scale="none"), torch.tensor([-1.0, 1.0]).double()
    )


def test_constant_group_gives_exact_zeros():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.7, 0.3], dtype=torch.bfloat16)
    adv = group_advantages(rewards, 3)
    assert torch.all(adv[:3] == 0) and torch.isfinite(adv).all()
    assert torch.all(group_advantages(torch.tensor([0.1] * 3), 3, eps=0.0) == 0)
    assert torch.all(group_advantages(torch.tensor([1.0, 2.0]), 1) == 0)


def test_bad_length_and_arguments_raise():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(torch.zeros(4), 2, scale="rank")
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
