"""The KL penalty against a frozen reference policy (``loss.kl_coef``).

``L_KL = (1/N) sum_i (1/|y_i|) sum_t k3_t``, ``k3_t = exp(r_t) - r_t - 1`` with
``r_t = ref_lp_t - lp_t``: the low-variance, non-negative estimator of ``KL(pi_theta || pi_ref)``
from tokens sampled near ``pi_theta``, averaged per sequence and normalized like GSPO's own
loss (the global sequence count ``N``). Its gradient wrt ``lp_t`` is
``(1 - exp(r_t)) / (|y_i| N)``. Per-sequence sums are all-reduced over ``cp_group``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.seq_reduce import PackedSequences, PaddedSequences, all_reduce_sum

__all__ = ["reference_kl"]


def reference_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    num_sequences: int | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(L_KL, {"kl_ref": token mean of k3})`` on padded ``[B, T]`` or packed tensors."""
    if cu_seqlens is None:
        layout = PaddedSequences(*logprobs.shape)
    else:
        layout = PackedSequences(cu_seqlens, logprobs.numel())
    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    valid = mask if mask.dtype == torch.bool else mask != 0
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    r = torch.where(valid, ref_logprobs.detach().to(dtype) - logprobs.to(dtype), zero)
    k3 = torch.where(valid, torch.expm1(r) - r, zero)
    per_seq = torch.stack([layout.seq_sum(k3), layout.seq_sum(valid.to(dtype))])
    total, count = all_reduce_sum(per_seq, cp_group).unbind(0)
    n = layout.num_sequences if num_sequences is None else num_sequences
    loss = (total / count.clamp(min=1)).sum() / n
    kl_ref = total.detach().sum() / count.sum().clamp(min=1)
    return loss, {"kl_ref": kl_ref}
