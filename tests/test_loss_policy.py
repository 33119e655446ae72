"""GSPO, GSPO-token and GRPO against hand-computed formulas, and the pitfalls in design.md."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.loss import (
    POLICY_LOSSES,
    get_policy_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)

EPS_LOW, EPS_HIGH = 3e-4, 4e-4
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-13), torch.float32: dict(rtol=1e-5, atol=1e-7)}


def make_batch(dtype=torch.float64, seed=0):
    """Ten ragged sequences whose mean log-ratios straddle GSPO's clip range on both sides.

    Each row has masked "prompt" positions in front and padding behind; the masked positions
    hold garbage that must not matter. Advantages alternate in sign so that both clip sides and
    both unclipped cases occur.
    """
    g = torch.Generator().manual_seed(seed)
    B, T = 10, 12
    means = torch.tensor(
        [-2e-3, -2e-4, 0.0, 1e-4, 3e-4, 9e-4, -9e-4, 5e-3, -5e-3, 2e-4], dtype=torch.float64
    )
    adv = torch.tensor([-1.0, 0.7, 1.3, -0.4, 0.9, 1.1, -1.2, -0.8, 0.5, -2.0], dtype=torch.float64)
    starts = [0, 2, 1, 3, 0, 4, 2, 1, 0, 5]
    lengths = [12, 4, 7, 1, 9, 6, 3, 11, 5, 2]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        mask[i, s : s + n] = True
    olp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 1e-3
    noise = torch.where(mask, noise, 0.0)
    noise = noise - (noise.sum(1, keepdim=True) / mask.sum(1, keepdim=True)) * mask
    lp = olp + means[:, None] + noise
    lp = torch.where(mask, lp, torch.full_like(lp, 123.0))  # garbage at masked positions
    return lp.to(dtype), olp.to(dtype), adv.to(dtype), mask


def closed_form_gspo(lp, olp, adv, mask, eps_low, eps_high, n):
    """Loss and gradient of GSPO written out sequence by sequence from design.md."""
    lp, olp, adv = lp.double(), olp.double(), adv.double()
    loss = 0.0
    grad = torch.zeros_like(lp)
    clipped = []
    for i in range(lp.shape[0]):
        m = mask[i]
        cnt = int(m.sum())
        if cnt == 0:
            continue
        s = math.exp(float((lp[i][m] - olp[i][m]).sum()) / cnt)
        a = float(adv[i])
        s_clip = min(max(s, 1 - eps_low), 1 + eps_high)
        loss -= min(s * a, s_clip * a) / n
        is_clipped = (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low)
        clipped.append(is_clipped)
        if not is_clipped:
            grad[i][m] = -s * a / cnt / n
    return loss, grad, clipped


def loss_and_grad(fn, lp, olp, adv, mask, **kw):
    lp = lp.clone().requires_grad_()
    loss, metrics = fn(lp, olp, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gspo_gradient_matches_closed_form(dtype):
    lp, olp, adv, mask = make_batch(dtype)
    loss, grad, metrics = loss_and_grad(gspo_loss, lp, olp, adv, mask)
    ref_loss, ref_grad, clipped = closed_form_gspo(lp, olp, adv, mask, EPS_LOW, EPS_HIGH, 10)
    assert any(clipped) and not all(clipped), "batch must mix clipped and unclipped sequences"
    assert loss.dtype == dtype
    torch.testing.assert_close(
        loss.double(), torch.tensor(ref_loss, dtype=torch.float64), **TOL[dtype]
    )
    torch.testing.assert_close(grad, ref_grad.to(dtype), **TOL[dtype])
    assert metrics["clip_fraction"].item() == pytest.approx(sum(clipped) / len(clipped))


def test_gspo_low_precision_inputs_are_upcast():
    lp, olp, adv, mask = make_batch(torch.float64)
    loss16, _, _ = loss_and_grad(gspo_loss, lp.bfloat16(), olp.bfloat16(), adv, mask)
    assert loss16.dtype == torch.float32


def test_sequence_ratio_is_exp_of_mean_not_sum():
    """Pitfall: exp(sum) makes a long sequence's ratio explode for the same per-token drift."""
    drift = 1e-4
    values = []
    for length in (3, 60):
        olp = torch.full((1, length), -1.0, dtype=torch.float64)
        lp = olp + drift
        adv = torch.ones(1, dtype=torch.float64)
        mask = torch.ones(1, length, dtype=torch.bool)
        loss, _, metrics = loss_and_grad(gspo_loss, lp, olp, adv, mask, eps_low=0.5, eps_high=0.5)
        values.append(-loss.item())  # = s_i with A = 1 and no clipping
        assert metrics["seq_log_ratio_mean"].item() == pytest.approx(drift, rel=1e-9)
    assert values[0] == pytest.approx(math.exp(drift), rel=1e-12)
    assert values[1] == pytest.approx(math.exp(drift), rel=1e-12), "s_i must be exp(mean)"


def test_advantage_is_not_scaled_by_length():
    """Pitfall: broadcasting s_i A_i against the token mask counts the advantage |y_i| times."""
    lengths = [2, 40]
    T = max(lengths)
    mask = torch.zeros(2, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    olp = torch.full((2, T), -0.5, dtype=torch.float64)
    lp = olp.clone()
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    for fn in (gspo_loss, gspo_token_loss, grpo_loss):
        loss, grad, _ = loss_and_grad(fn, lp, olp, adv, mask)
        assert loss.item() == pytest.approx(-1.0, rel=1e-12), f"{fn.__name__}: mean of s_i A_i"
        per_seq_grad = grad.sum(dim=1)
        torch.testing.assert_close(per_seq_grad, torch.full((2,), -0.5, dtype=torch.float64))


def test_gspo_default_clip_is_the_papers_not_ppos():
    """Pitfall: PPO's 0.2 left in place never clips GSPO's ratios, which live near 1e-3."""
    olp = torch.full((1, 5), -1.0, dtype=torch.float64)
    lp = olp + math.log(1 + 1e-3)
    adv = torch.ones(1, dtype=torch.float64)
    mask = torch.ones(1, 5, dtype=torch.bool)
    for fn in (gspo_loss, gspo_token_loss):
        loss, grad, metrics = loss_and_grad(fn, lp, olp, adv, mask)
        assert torch.all(grad == 0), f"{fn.__name__}: ratio 1.001 with A > 0 must be clipped"
        assert metrics["clip_fraction"].item() == 1.0
        assert metrics["clip_fraction_high"].item() == 1.0
        assert loss.item() == pytest.approx(-(1 + EPS_HIGH), rel=1e-12)
    # The GRPO baseline keeps its token-level 0.2 and does not clip this.
    _, grad, metrics = loss_and_grad(grpo_loss, lp, olp, adv, mask)
    assert metrics["clip_fraction"].item() == 0.0 and torch.all(grad < 0)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_global_normalisation_by_num_sequences(name):
    """Pitfall: per-micro-batch normalisation. Two halves with N = B must add up to the whole."""
    fn = POLICY_LOSSES[name]
    lp, olp, adv, mask = make_batch()
    eps = {} if name != "grpo" else dict(eps_low=1e-3, eps_high=1e-3)
    full_loss, full_grad, _ = loss_and_grad(fn, lp, olp, adv, mask, **eps)
    parts = [
        loss_and_grad(fn, lp[sl], olp[sl], adv[sl], mask[sl], num_sequences=10, **eps)
        for sl in (slice(0, 4), slice(4, 10))
    ]
    torch.testing.assert_close(parts[0][0] + parts[1][0], full_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), full_grad)
    # And the default N is the local B, which is what makes the halves differ from the whole.
    half_default, _, _ = loss_and_grad(fn, lp[:4], olp[:4], adv[:4], mask[:4], **eps)
    assert half_default.item() == pytest.approx(parts[0][0].item() * 10 / 4, rel=1e-12)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_huge_log_ratios_stay_finite(name):
    """Pitfall: an unclamped exp turns one huge log-ratio into inf and then NaN everywhere."""
    fn = POLICY_LOSSES[name]
    lp0, olp, adv, mask = make_batch(torch.float32)
    lp = lp0.clone()
    lp[0] = olp[0] + 1e4  # A < 0: the unclipped branch, whose exp would overflow
    lp[2] = olp[2] + 1e4  # A > 0: clipped
    lp[3] = olp[3] - 1e4  # A < 0: clipped
    lp[4] = olp[4] - 1e4  # A > 0: unclipped, ratio underflows to 0
    loss, grad, metrics = loss_and_grad(fn, lp, olp, adv, mask)
    assert torch.isfinite(loss), f"{name}: loss {loss}"
    assert torch.isfinite(grad).all(), f"{name}: gradient has non-finite entries"
    for key, value in metrics.items():
        assert torch.isfinite(torch.as_tensor(value)).all(), f"{name}: metric {key} = {value}"
    if name != "grpo":
        # Sequences beyond the clamp get no gradient; the others keep the closed form.
        _, ref_grad, _ = closed_form_gspo(lp0, olp, adv, mask, EPS_LOW, EPS_HIGH, 10)
        ref_grad[[0, 2, 3, 4]] = 0
        torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-5, atol=1e-7)
        assert metrics["seq_log_ratio_abs_max"].item() == pytest.approx(1e4, rel=1e-4)


def test_clip_fraction_counts_sequences_not_tokens():
    """Pitfall: weighting GSPO's clip fraction by response length."""
    lengths = [100, 2, 2, 2]
    T = max(lengths)
    mask = torch.zeros(4, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    olp = torch.full((4, T), -1.0, dtype=torch.float64)
    lp = olp.clone()
    lp[0] += 1e-2  # clipped (A > 0); the short ones are on-policy
    adv = torch.ones(4, dtype=torch.float64)
    for fn in (gspo_loss, gspo_token_loss):
        _, _, metrics = loss_and_grad(fn, lp, olp, adv, mask)
        assert metrics["clip_fraction"].item() == pytest.approx(0.25), fn.__name__
        assert metrics["clip_fraction_seq"].item() == pytest.approx(0.25)
        assert metrics["clip_fraction_tok"].item() == pytest.approx(100 / 106)
        assert metrics["clip_fraction_low"].item() == 0.0


def test_gspo_token_equals_gspo_with_sequence_advantages():
    lp, olp, adv, mask = make_batch()
    lp = lp.clone()
    lp[1] = olp[1] + 50.0  # beyond the clamp, A < 0: both must drop its gradient alike
    a_loss, a_grad, a_metrics = loss_and_grad(gspo_loss, lp, olp, adv, mask)
    adv_tok = adv[:, None].expand_as(lp)
    for advantages in (adv, adv_tok):
        b_loss, b_grad, b_metrics = loss_and_grad(gspo_token_loss, lp, olp, advantages, mask)
        torch.testing.assert_close(b_loss, a_loss, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(b_grad, a_grad, rtol=1e-13, atol=1e-15)
        for key in a_metrics:
            torch.testing.assert_close(b_metrics[key], a_metrics[key], msg=key)


def test_gspo_token_gradient_with_token_advantages():
    lp, olp, adv, mask = make_batch()
    g = torch.Generator().manual_seed(1)
    adv_tok = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    loss, grad, metrics = loss_and_grad(gspo_token_loss, lp, olp, adv_tok, mask)
    ref_grad = torch.zeros_like(lp)
    ref_loss = 0.0
    n_clipped = 0
    for i in range(10):
        m = mask[i]
        cnt = int(m.sum())
        s = math.exp(float((lp[i][m] - olp[i][m]).sum()) / cnt)
        s_clip = min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH)
        for t in torch.nonzero(m).flatten().tolist():
            a = float(adv_tok[i, t])
            ref_loss -= min(s * a, s_clip * a) / cnt / 10
            clipped = (a > 0 and s > 1 + EPS_HIGH) or (a < 0 and s < 1 - EPS_LOW)
            n_clipped += clipped
            if not clipped:
                ref_grad[i, t] = -s * a / cnt / 10
    assert 0 < n_clipped < int(mask.sum())
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert metrics["clip_fraction_tok"].item() == pytest.approx(n_clipped / int(mask.sum()))


def grpo_reference(lp, olp, adv, mask, eps_low, eps_high, n):
    """GRPO written token by token with plain autograd ops."""
    total = lp.new_zeros(())
    clipped = 0
    for i in range(lp.shape[0]):
        idx = torch.nonzero(mask[i]).flatten()
        if len(idx) == 0:
            continue
        seq = lp.new_zeros(())
        for t in idx.tolist():
            r = torch.exp(lp[i, t] - olp[i, t])
            a = adv[i]
            seq = seq + torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            clipped += bool((a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low))
        total = total + seq / len(idx)
    return -total / n, clipped


def test_grpo_matches_token_formula():
    lp, olp, adv, mask = make_batch()
    g = torch.Generator().manual_seed(2)
    lp = torch.where(mask, olp + torch.randn(lp.shape, generator=g, dtype=lp.dtype) * 0.2, lp)
    loss, grad, metrics = loss_and_grad(grpo_loss, lp, olp, adv, mask)
    lp_ref = lp.clone().requires_grad_()
    ref_loss, n_clipped = grpo_reference(lp_ref, olp, adv, mask, 0.2, 0.2, 10)
    (ref_grad,) = torch.autograd.grad(ref_loss, lp_ref)
    assert 0 < n_clipped < int(mask.sum())
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-15)
    assert metrics["clip_fraction"].item() == pytest.approx(n_clipped / int(mask.sum()))
    d = (lp - olp)[mask]
    assert metrics["approx_kl"].item() == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-9)
    assert metrics["ratio_mean"].item() == pytest.approx(float(d.exp().mean()), rel=1e-12)


def test_on_policy_gspo_and_grpo_gradients_agree():
    lp, _, adv, mask = make_batch()
    olp = lp.detach().clone()
    _, g_gspo, m_gspo = loss_and_grad(gspo_loss, lp, olp, adv, mask)
    _, g_grpo, _ = loss_and_grad(grpo_loss, lp, olp, adv, mask)
    _, g_tok, _ = loss_and_grad(gspo_token_loss, lp, olp, adv, mask)
    assert g_gspo.abs().sum() > 0
    torch.testing.assert_close(g_gspo, g_grpo, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(g_gspo, g_tok, rtol=1e-13, atol=1e-15)
    assert m_gspo["approx_kl"].item() == 0.0 and m_gspo["ratio_mean"].item() == 1.0


def to_packed(lp, olp, mask, extents):
    """Pack row i's positions [0, extents[i]) back to back (masked positions included)."""
    rows = [(i, n) for i, n in enumerate(extents)]
    cat = lambda x: torch.cat([x[i, :n] for i, n in rows])  # noqa: E731
    cu = torch.tensor([0] + list(torch.tensor(extents).cumsum(0).tolist()), dtype=torch.int32)
    return cat(lp), cat(olp), cat(mask), cu


@pytest.mark.parametrize(
    "name, token_adv",
    [("gspo", False), ("gspo_token", False), ("gspo_token", True), ("grpo", False), ("grpo", True)],
)
def test_packed_matches_padded(name, token_adv):
    lp, olp, adv, mask = make_batch()
    lp, olp, mask = (torch.cat([x, x[:1]]) for x in (lp, olp, mask))
    adv = torch.cat([adv, adv[:1]])
    mask[-1] = False  # a sequence whose every position is masked
    extents = [int(torch.nonzero(m).max()) + 1 if m.any() else 0 for m in mask]
    extents[3] += 1  # trailing masked padding inside a packed segment
    extents[-1] = 3  # masked-only segment that still occupies positions
    if token_adv:
        adv = torch.randn(lp.shape, generator=torch.Generator().manual_seed(3), dtype=lp.dtype)
    eps = dict(eps_low=1e-3, eps_high=1e-3) if name == "grpo" else {}
    p_loss, p_grad, p_metrics = loss_and_grad(POLICY_LOSSES[name], lp, olp, adv, mask, **eps)

    lp_k, olp_k, mask_k, cu = to_packed(lp, olp, mask, extents)
    adv_k = to_packed(adv, adv, mask, extents)[0] if token_adv else adv
    k_loss, k_grad, k_metrics = loss_and_grad(
        POLICY_LOSSES[name], lp_k, olp_k, adv_k, mask_k, cu_seqlens=cu, **eps
    )
    torch.testing.assert_close(k_loss, p_loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(k_grad, to_packed(p_grad, p_grad, mask, extents)[0])
    for key in p_metrics:
        torch.testing.assert_close(k_metrics[key], p_metrics[key], msg=key)


@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_empty_rows_give_no_nan(name):
    lp, olp, adv, mask = make_batch(torch.float32)
    mask = mask.clone()
    mask[[1, 6]] = False
    lp = torch.where(mask, lp, torch.tensor(float("nan")))
    lp[1, 0] = float("inf")
    olp = torch.where(mask, olp, torch.tensor(float("-inf")))
    loss, grad, metrics = loss_and_grad(POLICY_LOSSES[name], lp, olp, adv, mask, num_sequences=10)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all() and torch.all(grad[~mask] == 0)
    for key, value in metrics.items():
        assert torch.isfinite(value).all(), f"metric {key} = {value}"
    assert metrics["num_valid_sequences"].item() == 8
    # Dropping the empty rows (keeping N) changes nothing.
    keep = [i for i in range(10) if i not in (1, 6)]
    loss2, _, _ = loss_and_grad(
        POLICY_LOSSES[name], lp[keep], olp[keep], adv[keep], mask[keep], num_sequences=10
    )
    torch.testing.assert_close(loss, loss2)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", ["gspo", "gspo_token", "grpo"])
def test_all_empty_batch_raises(name, packed):
    lp = torch.zeros(2, 4)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    adv = torch.ones(2)
    kw = {}
    if packed:
        lp, mask, kw = lp.flatten(), mask.flatten(), dict(cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match="no token"):
        get_policy_loss(name)(lp, lp, adv, mask, **kw)


def test_bad_shapes_and_cu_seqlens_raise():
    lp = torch.zeros(6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        get_policy_loss("gspo")(
            lp, lp, torch.ones(2), torch.ones(6), cu_seqlens=torch.tensor([0, 2, 5])
        )
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3))


def test_registry():
    assert set(POLICY_LOSSES) == {"gspo", "gspo_token", "grpo"}
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(ValueError, match="gspo, gspo_token"):
        get_policy_loss("ppo")
