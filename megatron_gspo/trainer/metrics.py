"""The step's metrics, reduced over micro-batches, data-parallel replicas and the world.

Each micro-batch's loss reports per-sequence and per-token figures; :func:`reduce_reports`
weighs them by what they count (sequences, tokens, or the loss's own unit) and sums them over
the replicas, each replica reporting once (:func:`reports_metrics`). Router and off-policy
correction figures are summed over the world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_gspo.loss.off_policy import CorrectionStats
from megatron_gspo.model.router_stats import RouterStats

_SEQ_METRICS = ("clip_fraction_seq", "seq_log_ratio_mean")
_TOK_METRICS = ("clip_fraction_tok", "approx_kl", "entropy")
_UNIT_METRICS = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean")
MISMATCH = ("rollout_logprob_abs_diff", "rollout_kl_k3")


SAMPLER_KL = "rollout_sampler_kl"


def sampler_kl_metrics(k3_sum: float, tokens: float) -> dict[str, float]:
    """``rollout_sampler_kl`` (mean k3 per token of the engine's log-probs against the
    trainer's, both on the same weights) and the tokens it covers; nothing without tokens."""
    if tokens <= 0:
        return {}
    return {SAMPLER_KL: k3_sum / tokens, f"{SAMPLER_KL}_tokens": tokens}


def merge_sampler_kl(*parts: dict[str, float]) -> dict[str, float]:
    """One ``rollout_sampler_kl`` over the tokens of several measurements (on-policy tokens
    of the batch, the probe after a sync), weighted by their token counts."""
    parts = tuple(p for p in parts if SAMPLER_KL in p)
    k3 = sum(p[SAMPLER_KL] * p[f"{SAMPLER_KL}_tokens"] for p in parts)
    return sampler_kl_metrics(k3, sum(p[f"{SAMPLER_KL}_tokens"] for p in parts))


def reports_metrics(*, tokens: bool = False) -> bool:
    """One rank per data-parallel replica contributes metrics: TP ranks hold copies, and so do
    CP ranks of the loss's metrics (reduced over the full sequences). ``tokens``: a sum over
    this rank's own tokens, which every CP rank contributes (each holds its own share)."""
    return (
        parallel_state.is_pipeline_last_stage()
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and (tokens or parallel_state.get_context_parallel_rank() == 0)
    )


def reduce_reports(
    reports: list[dict], unit_weight: str, extra_token_metrics: tuple[str, ...] = ()
) -> dict[str, float]:
    """Weighted sums over micro-batches here, then over data-parallel replicas."""
    token_metrics = (*_TOK_METRICS, *extra_token_metrics)
    keys = [*_SEQ_METRICS, *token_metrics, *_UNIT_METRICS]
    weights = {k: "num_valid_sequences" for k in _SEQ_METRICS}
    weights.update({k: "num_valid_tokens" for k in token_metrics})
    weights.update({k: unit_weight for k in _UNIT_METRICS})
    vec = torch.zeros(len(keys) + 3, dtype=torch.float64)
    peak = torch.zeros(1, dtype=torch.float64)
    if reports_metrics():
        for r in reports:
            if float(r["num_valid_sequences"]) == 0:
                continue
            for i, k in enumerate(keys):
                vec[i] += float(r[k]) * float(r[weights[k]])
            vec[-3] += float(r["num_valid_sequences"])
            vec[-2] += float(r["num_valid_tokens"])
            vec[-1] += float(r["loss"])
            peak = torch.maximum(peak, torch.tensor([float(r["seq_log_ratio_abs_max"])]))
    dist.all_reduce(vec)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    totals = {"num_valid_sequences": vec[-3], "num_valid_tokens": vec[-2]}
    out = {k: float(vec[i] / totals[weights[k]].clamp(min=1)) for i, k in enumerate(keys)}
    out["loss"] = float(vec[-1])
    out["seq_log_ratio_abs_max"] = float(peak)
    return out


def router_metrics(stats: RouterStats, *, sequence_parallel: bool) -> dict[str, float]:
    """Routing flip rate and expert load over the world, each token counted once."""
    counts = torch.tensor([stats.flipped, stats.compared], dtype=torch.float64)
    load = stats.expert_load.clone()
    disagreement = stats.disagreement.clone()  # [differ, compared] x MoE layers
    # Routers run on every TP rank over the same tokens only without sequence parallelism;
    # counting on every rank and dividing by the TP size would be wrong with it, so count
    # routes where each token is seen once: all ranks with sequence parallelism, TP rank 0
    # without.
    if not sequence_parallel and (parallel_state.get_tensor_model_parallel_rank() != 0):
        for t in (counts, load, disagreement):
            t.zero_()
    for t in (counts, load, disagreement):
        dist.all_reduce(t)
    mean_load = load.mean().clamp(min=1e-12)
    out = {
        "expert_load_max_over_mean": float(load.max() / mean_load),
        "expert_load_min_over_mean": float(load.min() / mean_load),
    }
    if counts[1] > 0:
        out["routing_flip_rate"] = float(counts[0] / counts[1])
    differ, compared = disagreement
    if compared.sum() > 0:
        out["rollout_routing_disagreement"] = float(differ.sum() / compared.sum())
        for i, layer in enumerate(stats.moe_layer_numbers):
            out[f"rollout_routing_disagreement/layer_{layer}"] = float(
                differ[i] / compared[i].clamp(min=1)
            )
    return out


def correction_metrics(stats: CorrectionStats) -> dict[str, float]:
    """Summed over the world (each replica measured its own samples once)."""
    sums = torch.tensor(
        [stats.units, stats.weight_sum, stats.truncated, stats.masked], dtype=torch.float64
    )
    low = torch.tensor([stats.weight_min], dtype=torch.float64)
    high = torch.tensor([stats.weight_max], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    units, weight_sum, truncated, masked = sums.tolist()
    kept = max(units - masked, 1.0)
    return {
        "is_weight_mean": weight_sum / kept,
        "is_weight_min": float(low) if units > masked else float("nan"),
        "is_weight_max": float(high) if units > masked else float("nan"),
        "is_truncated_fraction": truncated / max(units, 1.0),
        "is_masked_fraction": masked / max(units, 1.0),
    }
