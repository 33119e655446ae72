"""Policy losses: GSPO, GSPO-token and a GRPO baseline, as pure functions with one signature.

Every loss takes ``(logprobs, old_logprobs, advantages, mask)`` plus keyword settings and
returns ``(loss, metrics)``. Each loss is written once over a sequence layout
(:mod:`megatron_gspo.loss.seq_reduce`), and takes either:

- padded: ``[B, T]`` token tensors and ``[B]`` advantages;
- packed (THD): ``[total_tokens]`` token tensors with ``cu_seqlens`` ``[B + 1]`` and ``[B]``
  advantages (or ``[total_tokens]`` where token-level advantages are allowed).

On the same data both give the same loss, gradient and metrics.

Conventions (each function's docstring adds its own details):

- Normalisation: the loss is ``-(1/N) * sum over sequences``, ``N = num_sequences``, which the
  trainer sets to the number of sequences of the *global* batch (all micro-batches, all
  data-parallel ranks). The default ``N = B`` is only right for a single micro-batch on one
  rank. Sequences with no unmasked token contribute nothing (and no NaN) but still count in
  ``N`` if the caller counts them.
- Context parallelism: pass ``cp_group`` when a sequence's tokens are split over its ranks
  (each rank passes its own tokens, the same ``B`` sequences in the same order, and the same
  advantages). Per-sequence sums are all-reduced before any non-linearity, so every CP rank
  computes the same ``s_i`` and returns the same, full loss value -- log it from one CP rank,
  do not sum it over them. Its gradient wrt each rank's local log-probs is the single-rank
  gradient of those tokens; the parameter gradients of the CP ranks must therefore be *summed*
  (a gradient all-reduce that averages over data x context-parallel ranks must be compensated
  by a factor ``cp_size`` in the trainer). Metrics are identical on every CP rank too.
- Masked positions may hold any value, including inf or NaN: they are replaced by zeros before
  any arithmetic, so they receive an exact zero gradient.
- Precision: inputs are upcast to fp32 (fp64 inputs are kept in fp64, which tests use).
- Overflow: the mean (GSPO) or token (GRPO) log-ratio is clamped to ``+-max_log_ratio`` before
  ``exp``. A sequence beyond that bound gets a zero gradient -- it is so far off-policy that a
  straight-through gradient of size ``exp(20)`` would be worse than none.
- Metrics are detached 0-d tensors describing the batch passed in (no host sync); the trainer
  aggregates them over micro-batches and data-parallel ranks, weighting by
  ``num_valid_sequences`` / ``num_valid_tokens``. ``approx_kl`` is the token mean of the k3
  estimator ``exp(d) - 1 - d`` with ``d = logprob - old_logprob`` (clamped like the ratio): an
  unbiased, non-negative estimate of ``KL(pi_old || pi_theta)`` from tokens sampled by
  ``pi_old``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_gspo.loss.policy_parts import (
    Metrics,
    SequenceRatio,
    Tokens,
    check_eps,
    clip_flags,
    k3,
    loss_metrics,
    normaliser,
    ppo_surrogate,
    require_tokens,
)
from megatron_gspo.loss.seq_reduce import (
    PackedSequences,
    PaddedSequences,
    SequenceLayout,
    all_reduce_sum,
)

__all__ = [
    "PolicyLossFn",
    "POLICY_LOSSES",
    "get_policy_loss",
    "gspo_loss",
    "gspo_token_loss",
    "grpo_loss",
]


class PolicyLossFn(Protocol):
    """The one signature every registered loss has."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        eps_low: float = ...,
        eps_high: float = ...,
        num_sequences: int | torch.Tensor | None = None,
        cp_group: dist.ProcessGroup | None = None,
        max_log_ratio: float = 20.0,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Metrics]: ...


# --------------------------------------------------------------------------------------------
# The three losses, layout-agnostic
# --------------------------------------------------------------------------------------------


def _gspo(tok: Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    seq = SequenceRatio(tok, cp_group, max_log_ratio)
    adv = tok.adv_seq
    surrogate = ppo_surrogate(seq.ratio, adv, eps_low, eps_high)
    zero = torch.zeros_like(surrogate)
    loss = -torch.where(seq.nonempty, surrogate, zero).sum() / normaliser(num_sequences, tok.layout)

    low, high = clip_flags(seq.ratio, adv, eps_low, eps_high)
    with torch.no_grad():
        ratio_mean = (seq.ratio * seq.nonempty).sum() / seq.nonempty.sum()
    metrics = loss_metrics(
        unit="sequence",
        count=seq.count.detach(),
        nonempty=seq.nonempty,
        seq_log_ratio=seq.log_ratio.detach(),
        clipped_low_tokens=low * seq.count.detach(),
        clipped_high_tokens=high * seq.count.detach(),
        k3_sum=seq.k3_sum.detach(),
        ratio_mean=ratio_mean,
    )
    return loss, metrics


def _gspo_token(tok: Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    layout = tok.layout
    seq = SequenceRatio(tok, cp_group, max_log_ratio)
    # s_{i,t} = sg[s_i] * exp(lp_t - sg[lp_t]): value s_i, gradient s_i * d lp_t. Sequences
    # whose log-ratio hit the clamp get no gradient, exactly as in GSPO.
    grad_gate = layout.to_tokens(seq.in_range.to(tok.dtype))
    tok_ratio = layout.to_tokens(seq.ratio.detach()) * torch.exp(
        (tok.lp - tok.lp.detach()) * grad_gate
    )
    surrogate = ppo_surrogate(tok_ratio, tok.adv_tok, eps_low, eps_high)
    surrogate = torch.where(tok.valid, surrogate, torch.zeros_like(surrogate))
    low, high = clip_flags(tok_ratio, tok.adv_tok, eps_low, eps_high)
    per_seq = torch.stack(
        [
            layout.seq_sum(surrogate),
            layout.seq_sum((low & tok.valid).to(tok.dtype)),
            layout.seq_sum((high & tok.valid).to(tok.dtype)),
        ]
    )
    surrogate_sum, low_tokens, high_tokens = all_reduce_sum(per_seq, cp_group).unbind(0)
    seq_term = torch.where(
        seq.nonempty, surrogate_sum / seq.count.clamp(min=1), torch.zeros_like(surrogate_sum)
    )
    loss = -seq_term.sum() / normaliser(num_sequences, layout)

    with torch.no_grad():
        ratio_mean = (seq.ratio * seq.nonempty).sum() / seq.nonempty.sum()
    metrics = loss_metrics(
        unit="sequence",
        count=seq.count.detach(),
        nonempty=seq.nonempty,
        seq_log_ratio=seq.log_ratio.detach(),
        clipped_low_tokens=low_tokens.detach(),
        clipped_high_tokens=high_tokens.detach(),
        k3_sum=seq.k3_sum.detach(),
        ratio_mean=ratio_mean,
    )
    return loss, metrics


def _grpo(tok: Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    layout = tok.layout
    log_ratio_tok = tok.lp - tok.olp  # zero at masked positions
    ratio = torch.exp(log_ratio_tok.clamp(-max_log_ratio, max_log_ratio))
    surrogate = ppo_surrogate(ratio, tok.adv_tok, eps_low, eps_high)
    surrogate = torch.where(tok.valid, surrogate, torch.zeros_like(surrogate))
    low, high = clip_flags(ratio, tok.adv_tok, eps_low, eps_high)
    detached = [
        tok.valid_f,
        (low & tok.valid).to(tok.dtype),
        (high & tok.valid).to(tok.dtype),
        log_ratio_tok.detach(),
        k3(log_ratio_tok, tok.valid, max_log_ratio),
        ratio.detach() * tok.valid_f,
    ]
    per_seq = torch.stack([layout.seq_sum(surrogate)] + [layout.seq_sum(x) for x in detached])
    surrogate_sum, count, low_tokens, high_tokens, log_ratio_sum, k3_sum, ratio_sum = (
        all_reduce_sum(per_seq, cp_group).unbind(0)
    )
    nonempty = require_tokens(count)
    safe_count = count.clamp(min=1)
    seq_term = torch.where(nonempty, surrogate_sum / safe_count, torch.zeros_like(surrogate_sum))
    loss = -seq_term.sum() / normaliser(num_sequences, layout)

    count = count.detach()
    metrics = loss_metrics(
        unit="token",
        count=count,
        nonempty=nonempty,
        seq_log_ratio=(log_ratio_sum / safe_count).detach(),
        clipped_low_tokens=low_tokens.detach(),
        clipped_high_tokens=high_tokens.detach(),
        k3_sum=k3_sum.detach(),
        ratio_mean=(ratio_sum.sum() / count.sum()).detach(),
    )
    return loss, metrics


# --------------------------------------------------------------------------------------------
# Public functions: the layout is [B, T] padded, or packed when cu_seqlens is given
# --------------------------------------------------------------------------------------------


def _layout(logprobs: torch.Tensor, cu_seqlens: torch.Tensor | None) -> SequenceLayout:
    if cu_seqlens is None:
        if logprobs.dim() != 2:
            raise ValueError(f"padded losses take [B, T] tensors, got {tuple(logprobs.shape)}")
        return PaddedSequences(*logprobs.shape)
    if logprobs.dim() != 1:
        raise ValueError(f"packed losses take [total_tokens] tensors, got {tuple(logprobs.shape)}")
    return PackedSequences(cu_seqlens, logprobs.numel())


def _prepare(logprobs, old_logprobs, advantages, mask, cu_seqlens, eps_low, eps_high, *, token):
    check_eps(eps_low, eps_high)
    layout = _layout(logprobs, cu_seqlens)
    return Tokens(logprobs, old_logprobs, advantages, mask, layout, token_advantages=token)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: ``L = -(1/N) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.

    ``s_i = exp(mean_t (lp - olp))`` over the unmasked tokens of sequence ``i`` -- the *mean*,
    so a long and a short sequence with equal per-token drift have equal ratios, and the
    advantage enters once per sequence, not once per token. The gradient is
    ``-(1/N) sum_i [unclipped_i] s_i A_i (1/|y_i|) sum_t grad lp_t``. The default clip range
    is the paper's (3e-4, 4e-4): ratios of whole sequences stay within ~1e-3 of one, so PPO's
    0.2 would never clip.

    Args:
        logprobs: ``[B, T]`` log-probs under the current policy (differentiable), or
            ``[total_tokens]`` with ``cu_seqlens``.
        old_logprobs: the same shape, under the policy that generated the data.
        advantages: ``[B]``, one per sequence.
        mask: the same shape as ``logprobs``, non-zero on response tokens.
        num_sequences: ``N``, the global batch's number of sequences (default ``B``).
        cp_group: context-parallel group when sequences are split along time (see module doc).
        max_log_ratio: clamp of the mean log-ratio before ``exp`` (overflow guard only).
        cu_seqlens: ``[B + 1]`` boundaries of packed sequences (under CP, this rank's own).

    Returns:
        ``(loss, metrics)``; see the module docstring for the metrics and conventions.
    """
    tok = _prepare(
        logprobs, old_logprobs, advantages, mask, cu_seqlens, eps_low, eps_high, token=False
    )
    return _gspo(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token: per-token advantages with the sequence's ratio and clip decision.

    ``s_{i,t} = sg[s_i] exp(lp_t - sg[lp_t])`` equals ``s_i`` in value, so every token of a
    sequence shares its clip decision (given the sign of its advantage); the loss is
    ``-(1/N) sum_i (1/|y_i|) sum_t m_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})`` and an
    unclipped token's gradient is ``-s_i A_{i,t} / (|y_i| N) grad lp_t``. With ``A_{i,t} = A_i``
    this is GSPO in value and gradient.

    ``advantages`` is ``[B]`` (broadcast over tokens) or per token (the shape of
    ``logprobs``). Under CP this loss all-reduces twice: the ratio's sums, then the
    surrogate's.
    """
    tok = _prepare(
        logprobs, old_logprobs, advantages, mask, cu_seqlens, eps_low, eps_high, token=True
    )
    return _gspo_token(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GRPO baseline: token ratios ``r = exp(lp - olp)``, token-level clip, sequence mean.

    ``L = -(1/N) sum_i (1/|y_i|) sum_t m_t min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high)
    A_i)``. ``clip_fraction`` counts tokens (``clip_fraction_seq`` gives the per-sequence
    view). Under CP the per-sequence token count is all-reduced with the surrogate sums.
    ``advantages`` is ``[B]`` or per token.
    """
    tok = _prepare(
        logprobs, old_logprobs, advantages, mask, cu_seqlens, eps_low, eps_high, token=True
    )
    return _grpo(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
}


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as ``name`` (every loss takes padded or packed batches)."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        valid = ", ".join(sorted(POLICY_LOSSES))
        raise ValueError(f"unknown policy loss {name!r}; valid names: {valid}") from None
