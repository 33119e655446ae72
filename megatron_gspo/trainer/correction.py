"""The off-policy correction of a step's micro-batches (``train.off_policy_correction``): each
unit (token or sequence) weighed (TIS) or masked (MIS) by pi_old / pi_behaviour, the loss mask
and per-token advantages rewritten, and each mini-batch's sequence count recounted as the
sequences left with a token to train on (summed over the world), so the global normalizer
counts what is trained on."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_gspo.config import Recipe
from megatron_gspo.loss import PackedSequences, PaddedSequences
from megatron_gspo.loss.off_policy import Correction, CorrectionStats, importance_weights
from megatron_gspo.runtime.errors import InputError
from megatron_gspo.trainer.metrics import correction_metrics, reports_metrics
from megatron_gspo.trainer.minibatches import MiniBatchPlan
from megatron_gspo.trainer.packing import MicroBatch

__all__ = ["apply_correction", "correction_of"]


def correction_of(recipe: Recipe) -> Correction:
    c = recipe.train.off_policy_correction
    return Correction(
        mode=c.mode,
        level=c.level,
        cap=c.tis_cap,
        low=c.mis_low,
        high=c.mis_high,
        max_log_ratio=recipe.loss.max_log_ratio,
    )


def apply_correction(
    plans: list[MiniBatchPlan], correction: Correction, cp_group
) -> tuple[list[MiniBatchPlan], dict[str, float]]:
    """Runs after the old log-prob pass, on the last pipeline stage (the only one with old
    log-probs and a loss); collective over the world (the counts)."""
    stats = CorrectionStats()
    counts = torch.zeros(len(plans), dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage():
        for p_idx, plan in enumerate(plans):
            for mb in plan.microbatches:
                if mb.num_sequences == 0:
                    continue
                if mb.behaviour_logprobs is None:
                    raise InputError(
                        "train.off_policy_correction needs log-probs from the rollout engine"
                    )
                trained, unit_stats = _correct(mb, correction, cp_group)
                if reports_metrics():
                    counts[p_idx] += trained
                    stats.add(unit_stats)
    dist.all_reduce(counts)
    plans = [replace(p, num_sequences=int(n)) for p, n in zip(plans, counts.tolist(), strict=True)]
    return plans, correction_metrics(stats)


def _correct(mb: MicroBatch, correction: Correction, cp_group) -> tuple[int, CorrectionStats]:
    region = mb.region
    if mb.packed:
        layout = PackedSequences(mb.cu_seqlens, int(mb.cu_seqlens[-1]))
    else:
        layout = PaddedSequences(*mb.loss_mask.shape)
    weights, keep, stats = importance_weights(
        mb.old_logprobs[region],
        mb.behaviour_logprobs[region],
        mb.loss_mask[region],
        layout,
        correction,
        cp_group=cp_group,
    )
    mb.loss_mask = mb.loss_mask.clone()
    mb.loss_mask[region] = keep
    token_adv = torch.zeros_like(mb.loss_mask)
    base = mb.token_advantages
    token_adv[region] = (
        layout.to_tokens(mb.advantages) if base is None else base[region]
    ) * weights
    mb.token_advantages = token_adv
    kept = layout.seq_sum(keep)
    if mb.cp_size > 1:
        dist.all_reduce(kept, group=cp_group)
    return int((kept > 0).sum()), stats
