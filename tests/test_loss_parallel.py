"""Tensor- and context-parallel results equal the single-rank ones (gloo ranks on CPU).

Each spawn costs seconds, so every spawned function checks several things at once and returns
its raw results; the comparisons happen in the parent against single-rank computations.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.loss import POLICY_LOSSES, token_logprobs
from tests.support.ranks import run_distributed

# ------------------------------------------------------------------------------------------
# Tensor parallelism: vocabulary sharded contiguously
# ------------------------------------------------------------------------------------------

N_ROWS, VOCAB = 37, 48


def tp_inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N_ROWS, VOCAB, generator=g) * 3
    targets = torch.randint(0, VOCAB, (N_ROWS,), generator=g)
    targets[:4] = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2])  # shard edges
    g_lp, g_ent = torch.randn(N_ROWS, generator=g), torch.randn(N_ROWS, generator=g)
    return logits, targets, g_lp, g_ent


def tp_forward_backward(logits, targets, g_lp, g_ent, group):
    """Returns (logprobs, entropy, grad of lp+entropy, grad of lp alone)."""
    x = logits.clone().requires_grad_()
    lp, ent = token_logprobs(x, targets, tp_group=group, return_entropy=True, chunk_size=5)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    y = logits.clone().requires_grad_()
    lp_only = token_logprobs(y, targets, tp_group=group, chunk_size=8)
    (lp_only * g_lp).sum().backward()
    return lp.detach(), ent.detach(), x.grad, y.grad


def _tp_worker(rank, world_size, logits, targets, g_lp, g_ent):
    v_local = VOCAB // world_size
    shard = logits[:, rank * v_local : (rank + 1) * v_local]
    group = dist.new_group(list(range(world_size)))
    return tp_forward_backward(shard, targets, g_lp, g_ent, group)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_matches_single_rank(tp):
    inputs = tp_inputs()
    ref_lp, ref_ent, ref_grad, ref_grad_lp = tp_forward_backward(*inputs, group=None)
    v_local = VOCAB // tp
    for rank, (lp, ent, grad, grad_lp) in enumerate(run_distributed(_tp_worker, tp, *inputs)):
        cols = slice(rank * v_local, (rank + 1) * v_local)
        torch.testing.assert_close(lp, ref_lp, rtol=1e-6, atol=1e-6, msg=f"rank {rank} lp")
        torch.testing.assert_close(ent, ref_ent, rtol=1e-6, atol=1e-6, msg=f"rank {rank} H")
        torch.testing.assert_close(grad, ref_grad[:, cols], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad_lp, ref_grad_lp[:, cols], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------
# Context parallelism: every sequence split in two halves along time
# ------------------------------------------------------------------------------------------

B, T = 6, 10  # T even: rank 0 holds positions [0, 5), rank 1 holds [5, 10)
CP_CASES = [
    ("gspo", False, {}),
    ("gspo_token", True, {}),
    ("grpo", False, dict(eps_low=0.05, eps_high=0.05)),
]


def cp_inputs():
    """Sequences whose responses straddle the CP split, one living on rank 1 only, one empty."""
    g = torch.Generator().manual_seed(4)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, (start, stop) in enumerate([(1, 9), (3, 5), (6, 10), (0, 10), (2, 7), (0, 0)]):
        mask[i, start:stop] = True
    olp = -torch.rand(B, T, generator=g) * 2
    drift = torch.tensor([8e-4, -6e-4, 1e-4, 2e-2, -1e-4, 0.0])[:, None]
    lp = olp + drift + torch.randn(B, T, generator=g) * 0.05
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3, 0.8, 1.0])
    adv_tok = torch.randn(B, T, generator=g)
    # A scalar "parameter" shared by all tokens: lp_t(theta) = lp_t + theta * feature_t.
    feature = torch.randn(B, T, generator=g)
    return lp, olp, adv, adv_tok, mask, feature


def cp_run(lp, olp, adv, adv_tok, mask, feature, cp_group, packed_lengths=None):
    """Every loss on this rank's tokens: (loss, grad wrt lp, grad wrt theta, metrics)."""
    results = {}
    for name, token_adv, eps in CP_CASES:
        for packed in (False, True):
            theta = torch.zeros((), requires_grad=True)
            x = lp.clone().requires_grad_()
            full = x + theta * feature
            a = adv_tok if token_adv else adv
            if packed:
                # Pack each sequence's local positions back to back; cu_seqlens is this rank's.
                n = packed_lengths

                def cat(v: torch.Tensor, n: int = n) -> torch.Tensor:
                    return torch.cat([v[i, :n] for i in range(B)])

                cu = torch.arange(B + 1, dtype=torch.int32) * n
                args = (cat(full), cat(olp), cat(a) if token_adv else a, cat(mask))
                loss, metrics = POLICY_LOSSES[name](
                    *args, cu_seqlens=cu, cp_group=cp_group, num_sequences=B, **eps
                )
            else:
                loss, metrics = POLICY_LOSSES[name](
                    full, olp, a, mask, cp_group=cp_group, num_sequences=B, **eps
                )
            loss.backward()
            results[name, packed] = (loss.detach(), x.grad, theta.grad, metrics)
    return results


def _cp_worker(rank, world_size, lp, olp, adv, adv_tok, mask, feature):
    half = T // world_size
    cols = slice(rank * half, (rank + 1) * half)
    group = dist.new_group(list(range(world_size)))
    local = [t[:, cols] for t in (lp, olp)] + [adv, adv_tok[:, cols], mask[:, cols]]
    return cp_run(*local, feature[:, cols], group, packed_lengths=half)


def test_context_parallel_matches_single_rank():
    inputs = cp_inputs()
    ref = cp_run(*inputs, cp_group=None, packed_lengths=T)
    ranks = run_distributed(_cp_worker, 2, *inputs)
    half = T // 2
    for key, (ref_loss, ref_grad, ref_theta_grad, ref_metrics) in ref.items():
        assert ref_grad.abs().sum() > 0, f"{key}: reference gradient should not vanish"
        for rank, res in enumerate(ranks):
            loss, _, _, metrics = res[key]
            # Every CP rank returns the full loss (log one of them, do not sum).
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7, msg=f"{key} {rank}")
            for m in ref_metrics:
                torch.testing.assert_close(metrics[m], ref_metrics[m], msg=f"{key} {m}")
        if key[1]:  # packed: unpack this rank's local gradient back into [B, half]
            grads = [r[key][1].view(B, half) for r in ranks]
        else:
            grads = [r[key][1] for r in ranks]
        torch.testing.assert_close(torch.cat(grads, dim=1), ref_grad, rtol=1e-5, atol=1e-8)
        # Summing the per-rank parameter gradients (the CP gradient all-reduce) is exact.
        theta_sum = sum(r[key][2] for r in ranks)
        torch.testing.assert_close(theta_sum, ref_theta_grad, rtol=1e-5, atol=1e-8)
    # The batch exercises both branches of the sequence clip.
    assert 0 < ref["gspo", False][3]["clip_fraction"].item() < 1
