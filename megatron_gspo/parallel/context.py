"""Context parallelism: which tokens of a micro-batch each CP rank holds, and the way back.

The split is Megatron-Core's load-balanced one, which Transformer Engine's attention and
Megatron's RoPE assume: a sequence whose length is a multiple of ``2 * cp`` is cut into
``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, so that under
a causal mask every rank does the same work. A packed (THD) row is split sequence by sequence,
rank ``r``'s row holding its two chunks of the first segment, then of the second, and so on;
a padded ``[b, s]`` batch splits each row as one sequence.

Everything that needs to know where a CP rank's tokens sit in the full sequence asks
:func:`cp_token_index`: the micro-batch split here, the attention that gathers keys and
values over the CP group (:mod:`megatron_gspo.model.attention`), and :func:`gather_tokens`,
which puts per-token results back into the full layout where one needs them whole (the tests
do; the training step's own metrics sum over CP ranks instead and need no gather).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = [
    "cp_segment_positions",
    "cp_token_index",
    "gather_tokens",
    "segment_bounds",
    "split_microbatch",
]


def cp_token_index(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in the full row of rank ``cp_rank``'s tokens, in that rank's order.

    ``bounds`` are the segment boundaries of the row (``[0, s]`` for one sequence); every
    segment's length must be a multiple of ``2 * cp_size``.
    """
    if cp_size == 1:
        return torch.arange(bounds[0], bounds[-1])
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if (b - a) % (2 * cp_size):
            raise ValueError(
                f"a segment of {b - a} tokens cannot be split over {cp_size} context-parallel "
                f"ranks (need a multiple of {2 * cp_size})"
            )
        c = (b - a) // (2 * cp_size)
        parts.append(torch.arange(a + cp_rank * c, a + (cp_rank + 1) * c))
        parts.append(torch.arange(b - (cp_rank + 1) * c, b - cp_rank * c))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def cp_segment_positions(bounds: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Like :func:`cp_token_index`, but each token's position within its own segment (what
    RoPE and the causal mask go by)."""
    index = cp_token_index(bounds, cp_size, cp_rank)
    lengths = torch.tensor(bounds[1:]) - torch.tensor(bounds[:-1])
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths // cp_size)
    return index - starts


def segment_bounds(mb) -> list[int]:
    """The split's segments of a micro-batch (split or not), in the full row: every packed
    segment (the tail padding included), or the whole row of a padded batch."""
    if mb.attn_cu_seqlens_padded is not None:
        return mb.attn_cu_seqlens_padded.tolist()
    return [0, mb.tokens.shape[1] * mb.cp_size]


def split_microbatch(mb, cp_size: int, cp_rank: int):
    """This CP rank's part of a micro-batch built for the full sequences.

    Token tensors ``[b, s]`` become ``[b, s / cp]``; the loss's ``cu_seqlens`` become this
    rank's boundaries of every sequence (each holds ``1 / cp`` of every padded segment), so
    segment ``i`` is sequence ``i`` on every rank, as the CP reductions of the loss need. The
    attention's ``cu_seqlens`` stay those of the full sequences (Transformer Engine and
    Megatron's RoPE expect them so). Per-sequence tensors (advantages) are unchanged.
    """
    if cp_size == 1:
        return mb
    index = cp_token_index(segment_bounds(mb), cp_size, cp_rank)

    def local(x):
        return None if x is None else x[:, index]

    return dataclasses.replace(
        mb,
        tokens=local(mb.tokens),
        position_ids=local(mb.position_ids),
        # The attention builds the causal pattern from positions (model/attention.py).
        attention_mask=None,
        targets=local(mb.targets),
        loss_mask=local(mb.loss_mask),
        old_logprobs=local(mb.old_logprobs),
        behaviour_logprobs=local(mb.behaviour_logprobs),
        token_advantages=local(mb.token_advantages),
        ref_logprobs=local(mb.ref_logprobs),
        padding_mask=local(mb.padding_mask),
        routes=local(mb.routes),
        versions=local(mb.versions),
        after_update=local(mb.after_update),
        cu_seqlens=None if mb.cu_seqlens is None else mb.cu_seqlens // cp_size,
        cp_size=cp_size,
    )


def gather_tokens(local: torch.Tensor, bounds: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of the split: every CP rank's ``[..., s / cp]`` tokens put back in their
    places of the full ``[..., s]`` row (``bounds`` as for :func:`cp_token_index`). Not
    differentiable; for results (log-probs, entropy, routes), not for training."""
    cp_size = dist.get_world_size(group)
    if cp_size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = local.new_empty(*local.shape[:-1], local.shape[-1] * cp_size)
    for rank, part in enumerate(parts):
        full[..., cp_token_index(bounds, cp_size, rank)] = part
    return full
