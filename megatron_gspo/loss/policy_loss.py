"""Policy losses: GSPO, GSPO-token and a GRPO baseline, as pure functions with one signature.

Every loss takes ``(logprobs, old_logprobs, advantages, mask)`` plus keyword settings and
returns ``(loss, metrics)``. Two layouts share one implementation:

- padded: ``gspo_loss`` etc. take ``[B, T]`` token tensors and ``[B]`` advantages;
- packed (THD): ``gspo_loss_packed`` etc. take ``[total_tokens]`` token tensors, a keyword
  ``cu_seqlens`` ``[B + 1]`` and ``[B]`` advantages (or ``[total_tokens]`` where token-level
  advantages are allowed). On the same data both give the same loss, gradient and metrics.

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

from megatron_gspo.loss.seq_reduce import (
    PackedSequences,
    PaddedSequences,
    SequenceLayout,
    all_reduce_sum,
)

__all__ = [
    "PolicyLossFn",
    "POLICY_LOSSES",
    "PACKED_POLICY_LOSSES",
    "get_policy_loss",
    "gspo_loss",
    "gspo_token_loss",
    "grpo_loss",
    "gspo_loss_packed",
    "gspo_token_loss_packed",
    "grpo_loss_packed",
]

Metrics = dict[str, torch.Tensor]


class PolicyLossFn(Protocol):
    """The one signature every registered loss has (packed variants add ``cu_seqlens``)."""

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
    ) -> tuple[torch.Tensor, Metrics]: ...


# --------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------


class _Tokens:
    """Validated, upcast, mask-sanitised inputs of one loss call."""

    def __init__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        layout: SequenceLayout,
        *,
        token_advantages: bool,
    ) -> None:
        if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
            raise ValueError(
                "logprobs, old_logprobs and mask must have the same shape; got "
                f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
            )
        self.dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
        self.layout = layout
        self.valid = mask if mask.dtype == torch.bool else mask != 0
        zero = torch.zeros((), dtype=self.dtype, device=logprobs.device)
        # where() rather than a multiply: 0 * inf would be NaN, and where's backward sends an
        # exact zero to the masked positions.
        self.lp = torch.where(self.valid, logprobs.to(self.dtype), zero)
        self.olp = torch.where(self.valid, old_logprobs.detach().to(self.dtype), zero)
        self.valid_f = self.valid.to(self.dtype)

        n_seq = layout.num_sequences
        adv = advantages.detach().to(self.dtype)
        if adv.shape == (n_seq,):
            self.adv_seq = adv
            self.adv_tok = layout.to_tokens(adv)
        elif token_advantages and adv.shape == logprobs.shape:
            self.adv_seq = None
            self.adv_tok = torch.where(self.valid, adv, zero)
        else:
            allowed = f"[{n_seq}]" + (f" or {list(logprobs.shape)}" if token_advantages else "")
            raise ValueError(f"advantages must have shape {allowed}, got {list(adv.shape)}")


def _normaliser(num_sequences: int | float | torch.Tensor | None, layout: SequenceLayout):
    if num_sequences is None:
        return layout.num_sequences
    if not isinstance(num_sequences, torch.Tensor) and num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    return num_sequences


def _require_tokens(count: torch.Tensor) -> torch.Tensor:
    """Per-sequence non-empty flags; raises if the whole batch has no unmasked token."""
    nonempty = count > 0
    if not bool(nonempty.any()):  # one host sync per loss call
        raise ValueError(
            "the mask selects no token in the whole batch (every sequence is empty); the "
            "policy loss would be 0/0. Drop such micro-batches before the loss."
        )
    return nonempty


def _k3(log_ratio: torch.Tensor, valid: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    d = log_ratio.detach().clamp(-max_log_ratio, max_log_ratio)
    return torch.where(valid, torch.expm1(d) - d, torch.zeros_like(d))


@torch.no_grad()
def _metrics(
    *,
    unit: str,
    count: torch.Tensor,
    nonempty: torch.Tensor,
    seq_log_ratio: torch.Tensor,
    clipped_low_tokens: torch.Tensor,
    clipped_high_tokens: torch.Tensor,
    k3_sum: torch.Tensor,
    ratio_mean: torch.Tensor,
) -> Metrics:
    """Metrics from per-sequence (already CP-reduced) quantities.

    ``clip_fraction_seq`` averages each sequence's fraction of clipped tokens over non-empty
    sequences -- for GSPO, whose clip decision is per sequence, that is the fraction of clipped
    sequences, unweighted by length. ``clip_fraction_tok`` is the fraction of clipped tokens.
    ``clip_fraction``/``_low``/``_high`` use the algorithm's own unit (``unit``).
    """
    n_seq = nonempty.sum().to(count.dtype)
    n_tok = count.sum()
    safe_count = count.clamp(min=1)
    low_seq = (clipped_low_tokens / safe_count * nonempty).sum() / n_seq
    high_seq = (clipped_high_tokens / safe_count * nonempty).sum() / n_seq
    low_tok = clipped_low_tokens.sum() / n_tok
    high_tok = clipped_high_tokens.sum() / n_tok
    abs_log_ratio = torch.where(nonempty, seq_log_ratio.abs(), torch.zeros_like(seq_log_ratio))
    low, high = (low_seq, high_seq) if unit == "sequence" else (low_tok, high_tok)
    return {
        "clip_fraction": low + high,
        "clip_fraction_low": low,
        "clip_fraction_high": high,
        "clip_fraction_seq": low_seq + high_seq,
        "clip_fraction_tok": low_tok + high_tok,
        "seq_log_ratio_mean": (seq_log_ratio * nonempty).sum() / n_seq,
        "seq_log_ratio_abs_max": abs_log_ratio.max(),
        "ratio_mean": ratio_mean,
        "approx_kl": k3_sum.sum() / n_tok,
        "num_valid_sequences": n_seq,
        "num_valid_tokens": n_tok,
    }


class _SequenceRatio:
    """``s_i = exp(clamp(sum_t m_t (lp - olp) / sum_t m_t))`` with the sums taken over CP."""

    def __init__(self, tok: _Tokens, cp_group: dist.ProcessGroup | None, max_log_ratio: float):
        layout = tok.layout
        log_ratio_tok = tok.lp - tok.olp  # zero at masked positions
        k3_tok = _k3(log_ratio_tok, tok.valid, max_log_ratio)
        per_seq = torch.stack(
            [layout.seq_sum(log_ratio_tok), layout.seq_sum(tok.valid_f), layout.seq_sum(k3_tok)]
        )
        num, self.count, self.k3_sum = all_reduce_sum(per_seq, cp_group).unbind(0)
        self.nonempty = _require_tokens(self.count)
        # Empty sequences: 0 / 1 = 0, so s = 1 and nothing is NaN; they are masked out later.
        self.log_ratio = num / self.count.clamp(min=1)
        self.in_range = self.log_ratio.detach().abs() <= max_log_ratio
        self.ratio = torch.exp(self.log_ratio.clamp(-max_log_ratio, max_log_ratio))


def _clip_flags(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the clipped branch is the active ``min`` (so the gradient is zero)."""
    ratio = ratio.detach()
    return (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)


def _surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """PPO's pessimistic surrogate ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")


# --------------------------------------------------------------------------------------------
# The three losses, layout-agnostic
# --------------------------------------------------------------------------------------------


def _gspo(tok: _Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    seq = _SequenceRatio(tok, cp_group, max_log_ratio)
    adv = tok.adv_seq
    surrogate = _surrogate(seq.ratio, adv, eps_low, eps_high)
    zero = torch.zeros_like(surrogate)
    loss = -torch.where(seq.nonempty, surrogate, zero).sum() / _normaliser(
        num_sequences, tok.layout
    )

    low, high = _clip_flags(seq.ratio, adv, eps_low, eps_high)
    with torch.no_grad():
        ratio_mean = (seq.ratio * seq.nonempty).sum() / seq.nonempty.sum()
    metrics = _metrics(
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


def _gspo_token(tok: _Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    layout = tok.layout
    seq = _SequenceRatio(tok, cp_group, max_log_ratio)
    # s_{i,t} = sg[s_i] * exp(lp_t - sg[lp_t]): value s_i, gradient s_i * d lp_t. Sequences
    # whose log-ratio hit the clamp get no gradient, exactly as in GSPO.
    grad_gate = layout.to_tokens(seq.in_range.to(tok.dtype))
    tok_ratio = layout.to_tokens(seq.ratio.detach()) * torch.exp(
        (tok.lp - tok.lp.detach()) * grad_gate
    )
    surrogate = _surrogate(tok_ratio, tok.adv_tok, eps_low, eps_high)
    surrogate = torch.where(tok.valid, surrogate, torch.zeros_like(surrogate))
    low, high = _clip_flags(tok_ratio, tok.adv_tok, eps_low, eps_high)
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
    loss = -seq_term.sum() / _normaliser(num_sequences, layout)

    with torch.no_grad():
        ratio_mean = (seq.ratio * seq.nonempty).sum() / seq.nonempty.sum()
    metrics = _metrics(
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


def _grpo(tok: _Tokens, eps_low, eps_high, num_sequences, cp_group, max_log_ratio):
    layout = tok.layout
    log_ratio_tok = tok.lp - tok.olp  # zero at masked positions
    ratio = torch.exp(log_ratio_tok.clamp(-max_log_ratio, max_log_ratio))
    surrogate = _surrogate(ratio, tok.adv_tok, eps_low, eps_high)
    surrogate = torch.where(tok.valid, surrogate, torch.zeros_like(surrogate))
    low, high = _clip_flags(ratio, tok.adv_tok, eps_low, eps_high)
    detached = [
        tok.valid_f,
        (low & tok.valid).to(tok.dtype),
        (high & tok.valid).to(tok.dtype),
        log_ratio_tok.detach(),
        _k3(log_ratio_tok, tok.valid, max_log_ratio),
        ratio.detach() * tok.valid_f,
    ]
    per_seq = torch.stack([layout.seq_sum(surrogate)] + [layout.seq_sum(x) for x in detached])
    surrogate_sum, count, low_tokens, high_tokens, log_ratio_sum, k3_sum, ratio_sum = (
        all_reduce_sum(per_seq, cp_group).unbind(0)
    )
    nonempty = _require_tokens(count)
    safe_count = count.clamp(min=1)
    seq_term = torch.where(nonempty, surrogate_sum / safe_count, torch.zeros_like(surrogate_sum))
    loss = -seq_term.sum() / _normaliser(num_sequences, layout)

    count = count.detach()
    metrics = _metrics(
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
# Public functions: padded [B, T] and packed [total_tokens] + cu_seqlens
# --------------------------------------------------------------------------------------------


def _padded_layout(logprobs: torch.Tensor) -> PaddedSequences:
    if logprobs.dim() != 2:
        raise ValueError(f"padded losses take [B, T] tensors, got {tuple(logprobs.shape)}")
    return PaddedSequences(*logprobs.shape)


def _packed_layout(logprobs: torch.Tensor, cu_seqlens: torch.Tensor) -> PackedSequences:
    if logprobs.dim() != 1:
        raise ValueError(f"packed losses take [total_tokens] tensors, got {tuple(logprobs.shape)}")
    return PackedSequences(cu_seqlens, logprobs.numel())


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
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: ``L = -(1/N) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.

    ``s_i = exp(mean_t (lp - olp))`` over the unmasked tokens of sequence ``i`` -- the *mean*,
    so a long and a short sequence with equal per-token drift have equal ratios, and the
    advantage enters once per sequence, not once per token. The gradient is
    ``-(1/N) sum_i [unclipped_i] s_i A_i (1/|y_i|) sum_t grad lp_t``. The default clip range
    is the paper's (3e-4, 4e-4): ratios of whole sequences stay within ~1e-3 of one, so PPO's
    0.2 would never clip.

    Args:
        logprobs: ``[B, T]`` log-probs under the current policy (differentiable).
        old_logprobs: ``[B, T]`` log-probs under the policy that generated the data.
        advantages: ``[B]``, one per sequence.
        mask: ``[B, T]``, non-zero on response tokens.
        num_sequences: ``N``, the global batch's number of sequences (default ``B``).
        cp_group: context-parallel group when sequences are split along time (see module doc).
        max_log_ratio: clamp of the mean log-ratio before ``exp`` (overflow guard only).

    Returns:
        ``(loss, metrics)``; see the module docstring for the metrics and conventions.
    """
    _check_eps(eps_low, eps_high)
    tok = _Tokens(
        logprobs, old_logprobs, advantages, mask, _padded_layout(logprobs), token_advantages=False
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
) -> tuple[torch.Tensor, Metrics]:
    """GSPO-token: per-token advantages with the sequence's ratio and clip decision.

    ``s_{i,t} = sg[s_i] exp(lp_t - sg[lp_t])`` equals ``s_i`` in value, so every token of a
    sequence shares its clip decision (given the sign of its advantage); the loss is
    ``-(1/N) sum_i (1/|y_i|) sum_t m_t min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})`` and an
    unclipped token's gradient is ``-s_i A_{i,t} / (|y_i| N) grad lp_t``. With ``A_{i,t} = A_i``
    this is GSPO in value and gradient.

    ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``. Under CP this loss
    all-reduces twice: the ratio's sums, then the surrogate's.
    """
    _check_eps(eps_low, eps_high)
    tok = _Tokens(
        logprobs, old_logprobs, advantages, mask, _padded_layout(logprobs), token_advantages=True
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
) -> tuple[torch.Tensor, Metrics]:
    """GRPO baseline: token ratios ``r = exp(lp - olp)``, token-level clip, sequence mean.

    ``L = -(1/N) sum_i (1/|y_i|) sum_t m_t min(r_t A_i, clip(r_t, 1 - eps_low, 1 + eps_high)
    A_i)``. ``clip_fraction`` counts tokens (``clip_fraction_seq`` gives the per-sequence
    view). Under CP the per-sequence token count is all-reduced with the surrogate sums.
    ``advantages`` is ``[B]`` or ``[B, T]``.
    """
    _check_eps(eps_low, eps_high)
    tok = _Tokens(
        logprobs, old_logprobs, advantages, mask, _padded_layout(logprobs), token_advantages=True
    )
    return _grpo(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


def gspo_loss_packed(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, Metrics]:
    """:func:`gspo_loss` on packed ``[total_tokens]`` tensors delimited by ``cu_seqlens``.

    ``advantages`` is ``[num_seqs]``; ``num_sequences`` defaults to ``num_seqs``. Under CP,
    ``cu_seqlens`` is this rank's own (the boundaries of its shard of each sequence).
    """
    _check_eps(eps_low, eps_high)
    layout = _packed_layout(logprobs, cu_seqlens)
    tok = _Tokens(logprobs, old_logprobs, advantages, mask, layout, token_advantages=False)
    return _gspo(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


def gspo_token_loss_packed(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, Metrics]:
    """:func:`gspo_token_loss` on packed tensors; ``advantages`` ``[num_seqs]`` or per token."""
    _check_eps(eps_low, eps_high)
    layout = _packed_layout(logprobs, cu_seqlens)
    tok = _Tokens(logprobs, old_logprobs, advantages, mask, layout, token_advantages=True)
    return _gspo_token(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


def grpo_loss_packed(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    num_sequences: int | torch.Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, Metrics]:
    """:func:`grpo_loss` on packed tensors; ``advantages`` ``[num_seqs]`` or per token."""
    _check_eps(eps_low, eps_high)
    layout = _packed_layout(logprobs, cu_seqlens)
    tok = _Tokens(logprobs, old_logprobs, advantages, mask, layout, token_advantages=True)
    return _grpo(tok, eps_low, eps_high, num_sequences, cp_group, max_log_ratio)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
}

PACKED_POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "gspo": gspo_loss_packed,
    "gspo_token": gspo_token_loss_packed,
    "grpo": grpo_loss_packed,
}


def get_policy_loss(name: str, *, packed: bool = False) -> PolicyLossFn:
    """The loss registered as ``name``; ``packed=True`` gives its ``cu_seqlens`` variant."""
    table = PACKED_POLICY_LOSSES if packed else POLICY_LOSSES
    try:
        return table[name]
    except KeyError:
        valid = ", ".join(sorted(table))
        raise ValueError(f"unknown policy loss {name!r}; valid names: {valid}") from None
