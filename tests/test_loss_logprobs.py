"""token_logprobs against the naive fp32 log_softmax/gather path (single rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss import token_logprobs


def naive(logits: torch.Tensor, targets: torch.Tensor):
    """fp32 reference with plain autograd: log-prob of the target and entropy per row."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def make_logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=g) * 4
    targets = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return logits.to(dtype), targets


def grads(fn, logits, targets, g_lp, g_ent):
    """Gradient wrt logits of sum(g_lp * lp + g_ent * H); either weight may be None."""
    x = logits.detach().clone().requires_grad_()
    lp, ent = fn(x, targets)
    total = 0
    if g_lp is not None:
        total = total + (lp * g_lp).sum()
    if g_ent is not None:
        total = total + (ent * g_ent).sum()
    total.backward()
    return lp.detach(), ent.detach(), x.grad


def ours(chunk_size):
    return lambda x, t: token_logprobs(x, t, return_entropy=True, chunk_size=chunk_size)


# bf16 gradients are compared after rounding the fp32 reference to bf16: one bf16 ulp apart.
GRAD_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 1000])
def test_matches_naive_value_and_gradient(dtype, chunk_size):
    logits, targets = make_logits((5, 9, 257), dtype)  # 45 rows: 7 does not divide them
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(5, 9, generator=g), torch.randn(5, 9, generator=g)
    lp, ent, grad = grads(ours(chunk_size), logits, targets, g_lp, g_ent)
    ref_lp, ref_ent, ref_grad = grads(naive, logits, targets, g_lp, g_ent)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == (5, 9)
    assert grad.dtype == dtype
    torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(grad.float(), ref_grad.to(dtype).float(), **GRAD_TOL[dtype])


@pytest.mark.parametrize("which", ["logprob_only", "entropy_only"])
def test_gradient_of_each_output_alone(which):
    logits, targets = make_logits((33, 64), torch.float64)
    g = torch.randn(33, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    g_lp, g_ent = (g, None) if which == "logprob_only" else (None, g)
    _, _, grad = grads(ours(5), logits, targets, g_lp, g_ent)

    def naive64(x, t):
        logp = torch.log_softmax(x, dim=-1)
        return logp.gather(-1, t[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    _, _, ref_grad = grads(naive64, logits, targets, g_lp, g_ent)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_entropy_gradient_closed_form():
    """dH/dz = -p (log p + H), checked against finite differences in fp64."""
    logits, targets = make_logits((3, 11), torch.float64)
    x = logits.clone().requires_grad_()
    _, ent = token_logprobs(x, targets, return_entropy=True)
    (grad,) = torch.autograd.grad(ent.sum(), x)
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    H = -(p * logp).sum(-1, keepdim=True)
    torch.testing.assert_close(grad, -p * (logp + H), rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: token_logprobs(z, targets, return_entropy=True, chunk_size=2), (x,)
    )


def test_logprobs_only_and_no_grad_paths():
    logits, targets = make_logits((4, 6, 50), torch.bfloat16)
    lp = token_logprobs(logits, targets, chunk_size=5)
    assert isinstance(lp, torch.Tensor) and lp.shape == (4, 6)
    torch.testing.assert_close(lp, naive(logits, targets)[0], rtol=1e-6, atol=2e-6)
    x = logits.clone().requires_grad_()
    with torch.no_grad():
        lp2 = token_logprobs(x, targets)
    assert not lp2.requires_grad


def test_minus_inf_logits_stay_finite():
    """Masked vocabulary entries (-inf) must not produce NaN in entropy or its gradient."""
    logits, targets = make_logits((6, 20), torch.float32)
    logits[:, 15:] = float("-inf")
    targets = targets % 15
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, targets, return_entropy=True, chunk_size=4)
    (lp.sum() + ent.sum()).backward()
    ref_lp, ref_ent = naive(logits[:, :15], targets)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[:, 15:] == 0)


def test_saves_no_fp32_copy_of_the_logits():
    """Backward must be able to run from the logits themselves plus per-row statistics."""
    logits, targets = make_logits((64, 300), torch.bfloat16)
    x = logits.clone().requires_grad_()
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = token_logprobs(x, targets, return_entropy=True, chunk_size=8)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16, [(t.dtype, t.shape) for t in saved]
    assert sum(t.numel() for t in saved) < x.numel() + 5 * 64


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="targets"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), chunk_size=0)
