"""The pieces the policy losses share: validated inputs, the sequence ratio, PPO's surrogate
and clip flags, the k3 estimator and the metrics (conventions in
:mod:`megatron_gspo.loss.policy_loss`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.seq_reduce import SequenceLayout, all_reduce_sum

Metrics = dict[str, torch.Tensor]


class Tokens:
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


def normaliser(num_sequences: int | float | torch.Tensor | None, layout: SequenceLayout):
    if num_sequences is None:
        return layout.num_sequences
    if not isinstance(num_sequences, torch.Tensor) and num_sequences <= 0:
        raise ValueError(f"num_sequences must be positive, got {num_sequences}")
    return num_sequences


def require_tokens(count: torch.Tensor) -> torch.Tensor:
    """Per-sequence non-empty flags; raises if the whole batch has no unmasked token."""
    nonempty = count > 0
    if not bool(nonempty.any()):  # one host sync per loss call
        raise ValueError(
            "the mask selects no token in the whole batch (every sequence is empty); the "
            "policy loss would be 0/0. Drop such micro-batches before the loss."
        )
    return nonempty


def k3(log_ratio: torch.Tensor, valid: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    d = log_ratio.detach().clamp(-max_log_ratio, max_log_ratio)
    return torch.where(valid, torch.expm1(d) - d, torch.zeros_like(d))


@torch.no_grad()
def loss_metrics(
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


class SequenceRatio:
    """``s_i = exp(clamp(sum_t m_t (lp - olp) / sum_t m_t))`` with the sums taken over CP."""

    def __init__(self, tok: Tokens, cp_group: dist.ProcessGroup | None, max_log_ratio: float):
        layout = tok.layout
        log_ratio_tok = tok.lp - tok.olp  # zero at masked positions
        k3_tok = k3(log_ratio_tok, tok.valid, max_log_ratio)
        per_seq = torch.stack(
            [layout.seq_sum(log_ratio_tok), layout.seq_sum(tok.valid_f), layout.seq_sum(k3_tok)]
        )
        num, self.count, self.k3_sum = all_reduce_sum(per_seq, cp_group).unbind(0)
        self.nonempty = require_tokens(self.count)
        # Empty sequences: 0 / 1 = 0, so s = 1 and nothing is NaN; they are masked out later.
        self.log_ratio = num / self.count.clamp(min=1)
        self.in_range = self.log_ratio.detach().abs() <= max_log_ratio
        self.ratio = torch.exp(self.log_ratio.clamp(-max_log_ratio, max_log_ratio))


def clip_flags(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the clipped branch is the active ``min`` (so the gradient is zero)."""
    ratio = ratio.detach()
    return (ratio < 1 - eps_low) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)


def ppo_surrogate(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """PPO's pessimistic surrogate ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``."""
    return torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)


def check_eps(eps_low: float, eps_high: float) -> None:
    if not (0 <= eps_low < 1 and eps_high >= 0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
