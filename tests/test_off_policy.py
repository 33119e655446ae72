"""Off-policy correction (TIS / MIS, token and sequence level) against closed forms, and the
normalizer when units are masked."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.loss import PackedSequences, PaddedSequences, gspo_loss, gspo_token_loss
from megatron_gspo.loss.off_policy import Correction, importance_weights

# Two sequences of 3 and 2 response tokens (padded to 4), old - behaviour log-ratios chosen so
# every branch is taken: token weights e^0.9=2.46, e^-0.1, e^0.3 | e^-1.2=0.30, e^0.2.
D = torch.tensor([[0.9, -0.1, 0.3, 0.0], [-1.2, 0.2, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
OLD = torch.full((2, 4), -2.0, dtype=torch.float64)
BEHAVIOUR = OLD - D


def _weights(mode, level, **kw):
    return importance_weights(
        OLD, BEHAVIOUR, MASK, PaddedSequences(2, 4), Correction(mode, level, **kw)
    )


def test_token_level_tis_truncates_each_token_weight_at_the_cap():
    w, keep, stats = _weights("tis", "token", cap=2.0)
    expected = torch.exp(D).clamp(max=2.0) * MASK + (1 - MASK)
    torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=0)
    assert torch.equal(keep, MASK), "TIS masks nothing"
    assert stats.units == 5 and stats.truncated == 1 and stats.masked == 0
    assert stats.weight_max == pytest.approx(2.0) and stats.weight_min == pytest.approx(
        math.exp(-1.2)
    )


def test_sequence_level_weight_is_exp_of_the_mean_log_ratio_not_the_sum():
    w, keep, stats = _weights("tis", "sequence", cap=10.0)
    w0, w1 = math.exp((0.9 - 0.1 + 0.3) / 3), math.exp((-1.2 + 0.2) / 2)
    assert w[0, :3].tolist() == pytest.approx([w0] * 3) and w[1, :2].tolist() == pytest.approx(
        [w1] * 2
    )
    assert stats.units == 2 and stats.weight_sum == pytest.approx(w0 + w1)


def test_token_level_mis_masks_tokens_outside_the_band_and_keeps_the_others_weights():
    w, keep, stats = _weights("mis", "token", low=0.5, high=2.0)
    # e^0.9 = 2.46 > 2 and e^-1.2 = 0.30 < 0.5 are masked.
    assert keep.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    assert w[0, 1] == pytest.approx(math.exp(-0.1)) and w[1, 1] == pytest.approx(math.exp(0.2))
    assert stats.masked == 2 and stats.units == 5
    assert stats.weight_sum == pytest.approx(math.exp(-0.1) + math.exp(0.3) + math.exp(0.2))


def test_sequence_level_mis_masks_whole_sequences():
    w, keep, stats = _weights("mis", "sequence", low=0.7, high=2.0)
    # Sequence 1: exp(-0.5) = 0.61 < 0.7 -> masked whole; sequence 0: exp(0.367) kept.
    assert keep.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]] and stats.masked == 1


def test_packed_and_padded_layouts_give_the_same_weights():
    packed = PackedSequences(torch.tensor([0, 3, 5]), 5)
    flat = lambda x: torch.cat([x[0, :3], x[1, :2]])  # noqa: E731
    for level in ("token", "sequence"):
        corr = Correction("mis", level, low=0.5, high=2.0)
        w, keep, _ = importance_weights(OLD, BEHAVIOUR, MASK, PaddedSequences(2, 4), corr)
        wp, keepp, _ = importance_weights(flat(OLD), flat(BEHAVIOUR), flat(MASK), packed, corr)
        assert torch.equal(flat(keep), keepp) and torch.allclose(flat(w), wp)


def test_masked_sequences_leave_the_normalizer_and_weights_scale_the_gradient():
    """GSPO with sequence-level MIS: L = -(1/N_kept) sum_{i kept} w_i min(s_i A_i, ...), whose
    gradient is -(1/N_kept) w_i s_i A_i (1/|y_i|) sum_t grad lp_t for unclipped sequences."""
    torch.manual_seed(0)
    n, t = 4, 3
    old = -torch.rand(n, t, dtype=torch.float64) - 1
    # Behaviour log-ratios per sequence: kept, kept, masked (too low), kept.
    shift = torch.tensor([0.1, -0.2, -3.0, 0.3], dtype=torch.float64)[:, None]
    behaviour = old - shift
    mask = torch.ones(n, t, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.7], dtype=torch.float64)
    corr = Correction("mis", "sequence", low=0.5, high=2.0)
    w, keep, _ = importance_weights(old, behaviour, mask, PaddedSequences(n, t), corr)
    kept = keep.sum(1) > 0
    assert kept.tolist() == [True, True, False, True]
    lp = (old + 1e-5 * torch.randn(n, t, dtype=torch.float64)).requires_grad_()
    loss, _ = gspo_loss(
        lp, old, adv * w[:, 0], keep, num_sequences=int(kept.sum()), eps_low=0.1, eps_high=0.1
    )
    loss.backward()
    s = torch.exp(((lp - old) * keep).sum(1) / keep.sum(1).clamp(min=1)).detach()
    wi = torch.exp(shift[:, 0])
    expected = -(wi * s * adv / t)[:, None] * keep / kept.sum()
    torch.testing.assert_close(lp.grad, expected, rtol=1e-9, atol=1e-12)
    assert lp.grad[2].abs().sum() == 0, "a masked sequence got a gradient"


def test_token_weights_in_gspo_weigh_each_tokens_gradient():
    """Token-level weights go through GSPO's token form: grad_t = -(1/N) s_i A_i w_t / |y_i|."""
    torch.manual_seed(1)
    old = -torch.rand(2, 3, dtype=torch.float64) - 1
    mask = torch.ones(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    w = torch.tensor([[0.5, 1.0, 2.0], [1.5, 1.0, 0.25]], dtype=torch.float64)
    lp = old.clone().requires_grad_()
    loss, _ = gspo_token_loss(lp, old, adv[:, None] * w, mask, eps_low=0.1, eps_high=0.1)
    loss.backward()
    torch.testing.assert_close(lp.grad, -(adv[:, None] * w) / 3 / 2, rtol=1e-12, atol=1e-15)
