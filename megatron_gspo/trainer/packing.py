"""From rollout samples to micro-batches: data-parallel balancing, packing, padding.

A sample is a prompt and what followed it: one response, or an episode's model and
environment turns. The model reads ``tokens[:-1]`` and is scored on ``tokens[1:]``; only
positions whose target is a token the model sampled (``response_mask``) carry loss.

Two layouts give the same loss and gradients:

- packed (THD): the sequences of a micro-batch are concatenated into one row under a token
  budget; the model gets Megatron's ``PackedSeqParams``, so attention (Transformer Engine's,
  or :mod:`megatron_gspo.model.attention` without it) and RoPE are confined to each
  sequence, and the loss uses the packed form with ``cu_seqlens``.
- padded: ``micro_batch_size`` sequences per micro-batch, right-padded to the longest.

Under context parallelism every packed sequence is padded to a multiple of ``2 * cp`` and
each rank trains on its share of every sequence (:mod:`megatron_gspo.parallel.context`).

The plan is computed identically on every rank from the whole mini-batch, so the global
sequence count and the number of micro-batches per rank need no communication. Every
data-parallel rank runs the same number of micro-batches (expert parallelism dispatches tokens
across data-parallel ranks in every forward); a rank with fewer is given empty ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_gspo.model.routes import filler_routes
from megatron_gspo.runtime.errors import InputError


@dataclass
class Sample:
    """One prompt and what followed it, with what the update needs to know about it."""

    prompt_ids: list[int]
    # Everything after the prompt: the response, or an episode's model and environment turns.
    response_ids: list[int]
    advantage: float = 0.0
    # Per response token, under the sampling engine (0 on environment tokens); optional.
    rollout_logprobs: list[float] | None = None
    # Per response token: 1 where the model sampled it, 0 where an environment turn put it
    # (never trained on). None: every response token is the model's.
    response_mask: list[int] | None = None
    # Per response token: its own advantage (turn-level credit); None: ``advantage`` for all.
    token_advantages: list[float] | None = None
    reward: float = 0.0
    # Index of the prompt the sample answers (groups share it).
    prompt_index: int = 0
    # The weights version (updates applied) that generated it, where the engine knows: its
    # oldest token's where weights changed under it (rollout.in_flight_updates).
    policy_version: int | None = None
    # MoE: the rollout engine's experts for each token the model reads, [num_tokens, MoE
    # layers, k] (megatron_gspo.model.routes), where the recipe asks for them.
    routes: np.ndarray | None = None
    # Per response token: the version that sampled it (-1: unknown, or not the model's);
    # None: policy_version for every model token.
    token_versions: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the model reads: prompt + response − 1."""
        return len(self.prompt_ids) + len(self.response_ids) - 1


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] model input ids
    position_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor | None  # [b or 1, 1, s, s] bool, True = masked
    targets: torch.Tensor  # [b, s]
    loss_mask: torch.Tensor  # [b, s] float, 1 on response targets
    advantages: torch.Tensor  # [num_seqs]
    # [b, s] aligned with targets, 0 where not scored: the rollout's log-probs where every
    # sample has them (has_rollout_logprobs), until the trainer recomputes them.
    old_logprobs: torch.Tensor
    # Packed only: [num_seqs + 1] boundaries of the sequences in the row (padded ones under
    # context parallelism: what the loss reduces over).
    cu_seqlens: torch.Tensor | None
    # Which samples of the mini-batch are in here, in order.
    sample_indices: list[int] = field(default_factory=list)
    # [b, s] bool, True where no sample's token is (row padding, packing fill, a filler
    # micro-batch): the routers leave these out of the load-balancing loss and statistics.
    padding_mask: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def region(self) -> tuple:
        """Index of the part of the [b, s] tensors that holds sequences, in the layout the
        losses take: the packed row up to its fill, or the whole padded batch."""
        if self.cu_seqlens is None:
            return (slice(None), slice(None))
        return (0, slice(0, int(self.cu_seqlens[-1])))

    has_rollout_logprobs: bool = False
    # The rollout's (behaviour policy's) log-probs, kept when old_logprobs is recomputed.
    behaviour_logprobs: torch.Tensor | None = None
    # [b, s] per-token advantages (0 where not scored) where a sample has its own
    # (turn-level credit) or an off-policy correction weighs tokens; else None.
    token_advantages: torch.Tensor | None = None
    # The frozen reference policy's log-probs where loss.kl_coef > 0 (else None).
    ref_logprobs: torch.Tensor | None = None
    # Packed only: the attention's segments over the full row (the sequences, then the tail
    # padding as a segment of its own), as Transformer Engine's THD format takes them: the
    # cumulative real lengths, and the boundaries of the segments padded for context
    # parallelism. Not split over CP ranks: attention and RoPE want the full sequences'.
    attn_cu_seqlens: torch.Tensor | None = None
    attn_cu_seqlens_padded: torch.Tensor | None = None
    # [b, s, MoE layers, k] the rollout's routes where every sample has them (padding routed
    # to experts 0..k-1), else None.
    routes: torch.Tensor | None = None
    # Context-parallel ranks the token tensors are split over (1: the full sequences).
    cp_size: int = 1
    # [b, s] int64 aligned with targets: the weights version that sampled each scored token
    # (-1 where unknown or not scored); tells on-policy tokens from stale ones.
    versions: torch.Tensor | None = None
    # [b, s] bool aligned with targets: the token was sampled after the weights changed under
    # its episode (rollout.in_flight_updates): a newer version than its episode's first token.
    after_update: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sample_indices)

    def __post_init__(self) -> None:
        if self.has_rollout_logprobs and self.behaviour_logprobs is None:
            self.behaviour_logprobs = self.old_logprobs.clone()

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (the model's)."""
        moved = {
            f.name: value.to(device)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def packed_seq_params(self, cp_group=None) -> PackedSeqParams | None:
        """Megatron's description of the packed row for attention and RoPE (None if padded)."""
        if self.attn_cu_seqlens is None:
            return None
        cu, padded = self.attn_cu_seqlens, self.attn_cu_seqlens_padded
        longest = int((padded[1:] - padded[:-1]).max())
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=padded,
            cu_seqlens_kv_padded=padded,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
            cp_group=cp_group,
        )


def balance_across_ranks(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Assign sample indices to ranks, longest first to the least-loaded rank."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * num_ranks
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        r = min(range(num_ranks), key=lambda k: (loads[k], k))
        assigned[r].append(i)
        loads[r] += lengths[i]
    return [sorted(a) for a in assigned]


def pack_bins(lengths: list[int], indices: list[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: groups of indices whose lengths sum to at most the budget."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > token_budget:
            raise InputError(
                f"a sequence of {lengths[i]} tokens exceeds train.micro_batch_tokens "
                f"({token_budget}); raise the budget or lower rollout.max_new_tokens"
            )
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def plan_microbatches(
    samples: list[Sample],
    *,
    dp_size: int,
    packing: bool,
    micro_batch_tokens: int,
    micro_batch_size: int,
    segment_multiple: int = 1,
) -> list[list[list[int]]]:
    """For every data-parallel rank, its micro-batches as lists of sample indices.

    Every rank gets the same number of micro-batches; missing ones are empty lists. Lengths
    count the padding each sequence will get (``segment_multiple``, context parallelism).
    """
    lengths = [_round_up(s.num_tokens, segment_multiple) for s in samples]
    per_rank = balance_across_ranks(lengths, dp_size)
    plans = []
    for idx in per_rank:
        if packing:
            plans.append(pack_bins(lengths, idx, micro_batch_tokens))
        else:
            plans.append(
                [idx[k : k + micro_batch_size] for k in range(0, len(idx), micro_batch_size)]
            )
    n = max(1, max(len(p) for p in plans))
    return [p + [[]] * (n - len(p)) for p in plans]


def _sequence_arrays(s: Sample) -> tuple[list, ...]:
    """Inputs, targets, loss mask, old log-probs, per-token advantages, the weights version
    of each target token (-1: unknown, or not the model's) and whether weights changed under
    its episode before it was sampled (1: an in-flight update) of one sequence."""
    ids = s.prompt_ids + s.response_ids
    p, n = len(s.prompt_ids), len(s.response_ids)
    inputs, targets = ids[:-1], ids[1:]
    response = s.response_mask if s.response_mask is not None else [1] * n
    mask = [0.0] * (p - 1) + [float(m) for m in response]
    old = [0.0] * (p - 1) + list(s.rollout_logprobs or [0.0] * n)
    token_adv = s.token_advantages if s.token_advantages is not None else [s.advantage] * n
    adv = [0.0] * (p - 1) + [a if m else 0.0 for a, m in zip(token_adv, response, strict=True)]
    if s.token_versions is not None:
        own = [v if m else -1 for v, m in zip(s.token_versions, response, strict=True)]
    else:
        v = -1 if s.policy_version is None else s.policy_version
        own = [v if m else -1 for m in response]
    versions = [-1] * (p - 1) + own
    first = min((v for v in own if v >= 0), default=-1)
    after = [0] * (p - 1) + [int(v > first) for v in own]
    return inputs, targets, mask, old, adv, versions, after


def _causal(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_width(
    samples: list[Sample], indices: list[int], *, packing: bool, segment_multiple: int = 1
) -> int:
    """Sequence length of a micro-batch before any padding to a common shape (packed
    sequences each padded to ``segment_multiple``)."""
    lengths = [samples[i].num_tokens for i in indices] or [1]
    if not packing:
        return max(lengths)
    return sum(_round_up(n, segment_multiple) for n in lengths)


def _route_rows(rows: list[list[np.ndarray]], slots: list[list[int]], width: int) -> torch.Tensor:
    """``[b, width, layers, k]`` routes: row ``r`` holds its sequences' routes, each at the
    start of its slot (``slots[r]`` lengths, back to back), and filler routes elsewhere."""
    first = next(x for row in rows for x in row)
    layers, k = first.shape[1:]
    out = np.empty((len(rows), width, layers, k), dtype=np.int16)
    out[:] = filler_routes(layers, k)
    for r, (row, row_slots) in enumerate(zip(rows, slots, strict=True)):
        start = 0
        for seq, slot in zip(row, row_slots, strict=False):
            out[r, start : start + len(seq)] = seq
            start += slot
    return torch.from_numpy(out)


def _cumsum(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return cu


def build_microbatch(
    samples: list[Sample],
    indices: list[int],
    *,
    packing: bool,
    pad_id: int = 0,
    pad_to_multiple: int = 1,
    width: int | None = None,
    rows: int | None = None,
    segment_multiple: int = 1,
) -> MicroBatch:
    """Tensors for one micro-batch. An empty ``indices`` gives a filler batch with no loss
    (all padding), which the general paths below build like any other.

    ``pad_to_multiple`` rounds the sequence dimension up (sequence and context parallelism
    split it over ranks); ``width`` and ``rows`` pad to a fixed shape (pipeline stages that
    cannot exchange shapes); ``segment_multiple`` pads every packed sequence (context
    parallelism splits each into ``2 * cp`` chunks). Padding carries no loss and no sequence
    reads it.
    """
    if pad_to_multiple % segment_multiple:
        raise ValueError(
            f"pad_to_multiple ({pad_to_multiple}) must be a multiple of segment_multiple "
            f"({segment_multiple})"
        )
    natural = microbatch_width(samples, indices, packing=packing, segment_multiple=segment_multiple)
    width = _round_up(max(natural, width or 0), pad_to_multiple)
    arrays = [_sequence_arrays(samples[i]) for i in indices]
    has_rollout = bool(indices) and all(samples[i].rollout_logprobs is not None for i in indices)
    routes = [samples[i].routes for i in indices]
    has_routes = bool(indices) and all(r is not None for r in routes)
    advantages = torch.tensor([samples[i].advantage for i in indices], dtype=torch.float32)
    # Per-token advantages only where a sample has its own (the losses then take the token
    # form); the others' tokens carry their sequence's advantage.
    per_token = any(samples[i].token_advantages is not None for i in indices)
    if packing:
        lens = [len(a[0]) for a in arrays]
        padded = [_round_up(n, segment_multiple) for n in lens]
        tail = width - sum(padded)
        # The tail padding is a segment of its own, so no sequence attends to it.
        segments, segments_padded = lens + [tail] * bool(tail), padded + [tail] * bool(tail)
        cu_padded = _cumsum(segments_padded)
        padding = torch.ones(width, dtype=torch.bool)
        for start, n in zip(cu_padded.tolist(), lens, strict=False):
            padding[start : start + n] = False

        def row(parts: list[list], value) -> torch.Tensor:
            fill = [p + [value] * (n - len(p)) for p, n in zip(parts, padded, strict=True)]
            return torch.tensor([sum(fill, []) + [value] * tail])

        return MicroBatch(
            routes=_route_rows([routes], [padded], width) if has_routes else None,
            tokens=row([a[0] for a in arrays], pad_id),
            position_ids=torch.cat([torch.arange(n) for n in segments_padded])[None],
            attention_mask=None,
            targets=row([a[1] for a in arrays], pad_id),
            loss_mask=row([a[2] for a in arrays], 0.0),
            advantages=advantages,
            old_logprobs=row([a[3] for a in arrays], 0.0),
            token_advantages=row([a[4] for a in arrays], 0.0) if per_token else None,
            versions=row([a[5] for a in arrays], -1),
            after_update=row([a[6] for a in arrays], 0).bool(),
            cu_seqlens=cu_padded[: len(lens) + 1],
            sample_indices=list(indices),
            padding_mask=padding[None],
            has_rollout_logprobs=has_rollout,
            attn_cu_seqlens=_cumsum(segments),
            attn_cu_seqlens_padded=cu_padded,
        )
    # Empty rows (fixed shapes, or a filler batch) are sequences with no tokens: they
    # contribute nothing.
    empty = max(0, (rows or 1) - len(arrays))
    arrays += [([], [], [], [], [], [], [])] * empty
    advantages = torch.cat([advantages, torch.zeros(empty)])

    def pad(parts: list[list], value) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in parts])

    row_routes = [[r] for r in routes] + [[]] * empty
    return MicroBatch(
        routes=_route_rows(row_routes, [[width]] * len(row_routes), width) if has_routes else None,
        tokens=pad([a[0] for a in arrays], pad_id),
        position_ids=torch.arange(width).expand(len(arrays), width).clone(),
        # Padding sits after each sequence, so causal attention never reads it.
        attention_mask=_causal(width)[None, None],
        targets=pad([a[1] for a in arrays], pad_id),
        loss_mask=pad([a[2] for a in arrays], 0.0),
        advantages=advantages,
        old_logprobs=pad([a[3] for a in arrays], 0.0),
        token_advantages=pad([a[4] for a in arrays], 0.0) if per_token else None,
        versions=pad([a[5] for a in arrays], -1),
        after_update=pad([a[6] for a in arrays], 0).bool(),
        cu_seqlens=None,
        sample_indices=list(indices),
        padding_mask=torch.arange(width)[None] >= torch.tensor([[len(a[0])] for a in arrays]),
        has_rollout_logprobs=has_rollout,
    )
