"""Core attention for the local (no Transformer Engine) layer spec.

Megatron-Core's local ``DotProductAttention`` refuses packed (THD) sequences and context
parallelism; on a GPU both are Transformer Engine's. This module is their stand-in where TE is
absent, taking the same arguments as TE's core attention:

- THD (``packed_seq_params``): each segment of the packed row attends causally to itself only.
  The segments are batched: each is padded to the longest and all attend in one call per
  layer, so the cost is ``n * L_max^2`` for ``n`` segments (not the ``(sum_i L_i)^2`` of a
  block-diagonal mask over the row, nor one Python-driven call per segment). The gather
  indices and the mask depend on the micro-batch alone and are built once, by its first layer
  (:func:`segment_batch`);
- context parallelism: keys and values are all-gathered over the CP group (their gradients
  reduce-scattered back), and the causal mask is built from the positions the load-balanced
  split gave every token (:mod:`megatron_gspo.parallel.context`), so a query sees exactly the
  keys it would on one rank. It is for correctness, not speed: every rank holds the whole
  sequence's keys, where TE's ring exchange holds one chunk at a time.
- otherwise (padded batches, the KV-cache decode) the explicit ``attention_mask``, or a causal
  mask aligned to the last key, as Megatron's own attention applies them.

Scores are formed in the inputs' dtype and normalized in fp32 (or wider), with Megatron's mask
fill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from megatron_gspo.parallel.context import cp_segment_positions
from megatron_gspo.runtime.errors import InputError

__all__ = ["SegmentAttention", "SegmentBatch", "segment_batch"]

# Megatron's attention_mask_func: finite, so a row with every key masked stays finite.
_MASKED = -10000.0


@dataclass(frozen=True)
class SegmentBatch:
    """A packed row's segments as a padded batch: ``n`` segments of at most ``lq`` of this
    rank's tokens, each attending to its own keys gathered from every CP rank."""

    # [n, lq] this rank's row of each query (padding: 0), and whether it is one.
    q_rows: torch.Tensor
    q_real: torch.Tensor
    # [n, lk] the row of each key in the CP-gathered ``[cp * t]`` keys (padding: 0).
    k_rows: torch.Tensor
    # [n, 1, lq, lk] True where a query must not see a key: later in its segment, padding.
    masked: torch.Tensor


def segment_batch(bounds: list[int], cp_size: int, cp_rank: int, device) -> SegmentBatch:
    """The gather indices and mask of a packed row with segment boundaries ``bounds`` (the full
    sequences'), for CP rank ``cp_rank`` of ``cp_size``."""
    local = torch.tensor(bounds) // cp_size
    t = int(local[-1])
    lengths = local[1:] - local[:-1]
    keep = lengths > 0
    starts, lengths = local[:-1][keep], lengths[keep]
    lq = int(lengths.max()) if len(lengths) else 0
    q_off = torch.arange(lq)
    q_real = q_off[None, :] < lengths[:, None]
    q_rows = torch.where(q_real, starts[:, None] + q_off[None, :], 0)
    # Keys: every rank's share of the segment, rank after rank, each padded to lq.
    k_off = torch.arange(cp_size * lq)
    rank, off = k_off // lq, k_off % lq
    k_real = off[None, :] < lengths[:, None]
    k_rows = torch.where(k_real, rank[None, :] * t + starts[:, None] + off[None, :], 0)
    positions = torch.cat([cp_segment_positions(bounds, cp_size, r) for r in range(cp_size)])
    q_pos = positions[cp_rank * t + q_rows]
    k_pos = positions[k_rows]
    masked = ~k_real[:, None, :] | (k_pos[:, None, :] > q_pos[:, :, None])
    return SegmentBatch(
        q_rows.to(device), q_real.to(device), k_rows.to(device), masked[:, None].to(device)
    )


class SegmentAttention(MegatronModule):
    # "batched" (the segments in one call) or "loop" (one call per segment, as before; kept
    # for benchmarks/step_time.py, which measures one against the other).
    packed_impl = "batched"

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        if attention_dropout if attention_dropout is not None else config.attention_dropout:
            raise InputError("attention dropout is not supported without Transformer Engine")
        if config.apply_query_key_layer_scaling:
            raise InputError("apply_query_key_layer_scaling is not supported here")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None)
        if self.cp_group is None:
            self.cp_group = parallel_state.get_context_parallel_group()
        self.num_heads = divide(config.num_attention_heads, tp)
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise InputError("attention_bias is not supported without Transformer Engine")
        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, cp_size, cp_rank)
        if cp_size > 1:
            # A padded batch: each row is one sequence, split like a one-segment THD row.
            bounds = [0, query.shape[0] * cp_size]
            q_pos = cp_segment_positions(bounds, cp_size, cp_rank).to(query.device)
            k_pos = torch.cat(
                [cp_segment_positions(bounds, cp_size, r) for r in range(cp_size)]
            ).to(query.device)
            key, value = self._gather(key), self._gather(value)
            return self._attend(query, key, value, k_pos[None, :] > q_pos[:, None])
        if attention_mask is None:
            sq, sk = query.shape[0], key.shape[0]
            attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device)
            attention_mask = attention_mask.triu(sk - sq + 1)
        return self._attend(query, key, value, attention_mask)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """All ranks' ``x`` along the first dimension, in rank order (backward: the gradient
        summed over the ranks that used each key, then scattered back)."""
        return gather_from_sequence_parallel_region(x, True, group=self.cp_group)

    def _packed(self, query, key, value, params: PackedSeqParams, cp_size: int, cp_rank: int):
        """THD ``[t, heads, dim]`` in, ``[t, heads * v_dim]`` out; ``t`` is this rank's share."""
        if cp_size > 1:
            key, value = self._gather(key), self._gather(value)
        padded = params.cu_seqlens_q_padded
        bounds = (params.cu_seqlens_q if padded is None else padded).tolist()
        if self.packed_impl == "loop":
            return self._packed_loop(query, key, value, bounds, cp_size, cp_rank)
        # The same for every layer of the micro-batch: built once, kept with its params.
        cached = getattr(params, "_segment_batch", None)
        if cached is None or cached[0] != (cp_size, cp_rank):
            batch = segment_batch(bounds, cp_size, cp_rank, query.device)
            params._segment_batch = cached = ((cp_size, cp_rank), batch)
        batch = cached[1]
        # Causal within the segment: a segment's padding follows its tokens, so no real token
        # sees it; a padded query row sees its keys, and is dropped.
        q = query[batch.q_rows].transpose(0, 1)  # [lq, n, heads, d]
        k = key[batch.k_rows].transpose(0, 1)
        v = value[batch.k_rows].transpose(0, 1)
        out = self._attend(q, k, v, batch.masked)  # [lq, n, heads * dv]
        return out.transpose(0, 1)[batch.q_real]

    def _packed_loop(self, query, key, value, bounds, cp_size: int, cp_rank: int):
        """One attention call per segment (the implementation before the batched one)."""
        local = [b // cp_size for b in bounds]
        positions = [
            cp_segment_positions(bounds, cp_size, r).to(query.device) for r in range(cp_size)
        ]
        t = query.shape[0]
        key = key.view(cp_size, t, *key.shape[1:])
        value = value.view(cp_size, t, *value.shape[1:])
        out = []
        for lo, hi in zip(local[:-1], local[1:], strict=True):
            if hi == lo:
                continue
            q_pos = positions[cp_rank][lo:hi]
            k_pos = torch.cat([p[lo:hi] for p in positions])
            mask = k_pos[None, :] > q_pos[:, None]
            k = key[:, lo:hi].flatten(0, 1)
            v = value[:, lo:hi].flatten(0, 1)
            out.append(self._attend(query[lo:hi, None], k[:, None], v[:, None], mask)[:, 0])
        return torch.cat(out)

    def _attend(self, q, k, v, mask: torch.Tensor) -> torch.Tensor:
        """``q [sq, b, heads, d]``, ``k [sk, b, groups, d]``, ``v [sk, b, groups, dv]``,
        ``mask`` broadcastable to ``[b, heads, sq, sk]`` (True: not attended) ->
        ``[sq, b, heads * dv]``."""
        repeat = self.num_heads // k.shape[2]
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=2)
            v = v.repeat_interleave(repeat, dim=2)
        scores = torch.matmul(q.permute(1, 2, 0, 3), k.permute(1, 2, 3, 0)) * self.softmax_scale
        normalize = torch.promote_types(scores.dtype, torch.float32)
        probs = scores.to(normalize).masked_fill(mask, _MASKED).softmax(dim=-1).to(v.dtype)
        context = torch.matmul(probs, v.permute(1, 2, 0, 3))  # [b, heads, sq, dv]
        return context.permute(2, 0, 1, 3).flatten(2)
