"""Core attention for the local (no Transformer Engine) layer spec.

Megatron-Core's local ``DotProductAttention`` refuses packed (THD) sequences and context
parallelism; on a GPU both are Transformer Engine's. This module is their stand-in where TE is
absent, taking the same arguments as TE's core attention:

- THD (``packed_seq_params``): each segment of the packed row attends causally to itself only,
  so the cost is ``sum_i L_i^2`` rather than the ``(sum_i L_i)^2`` of a block-diagonal mask;
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

__all__ = ["SegmentAttention"]

# Megatron's attention_mask_func: finite, so a row with every key masked stays finite.
_MASKED = -10000.0


class SegmentAttention(MegatronModule):
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
        padded = params.cu_seqlens_q_padded
        bounds = (params.cu_seqlens_q if padded is None else padded).tolist()
        local = [b // cp_size for b in bounds]
        # The mask is built where the scores are (a GPU's), from positions computed on the host.
        positions = [
            cp_segment_positions(bounds, cp_size, r).to(query.device) for r in range(cp_size)
        ]
        t = query.shape[0]
        if cp_size > 1:
            key = self._gather(key).view(cp_size, t, *key.shape[1:])
            value = self._gather(value).view(cp_size, t, *value.shape[1:])
        else:
            key, value = key[None], value[None]
        out = []
        for lo, hi in zip(local[:-1], local[1:], strict=True):
            if hi == lo:
                continue
            q_pos = positions[cp_rank][lo:hi]
            k_pos = torch.cat([p[lo:hi] for p in positions])
            # Causal within the segment: a segment's padding follows its tokens, so no real
            # token sees it.
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
