"""From rollout samples to micro-batches: data-parallel balancing, packing, padding.

A sample is a prompt and one response. The model reads ``tokens[:-1]`` and is scored on
``tokens[1:]``; only positions whose target is a response token carry loss.

Two layouts give the same loss and gradients:

- packed: the sequences of a micro-batch are concatenated into one row under a token budget;
  attention is confined to each sequence (``cu_seqlens`` for Transformer Engine's THD
  attention, otherwise a block-diagonal causal mask) and the loss uses the packed (THD) form.
- padded: ``micro_batch_size`` sequences per micro-batch, right-padded to the longest.

The plan is computed identically on every rank from the whole mini-batch, so the global
sequence count and the number of micro-batches per rank need no communication. Every
data-parallel rank runs the same number of micro-batches (expert parallelism dispatches tokens
across data-parallel ranks in every forward); a rank with fewer is given empty ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One prompt and one sampled response, with what the update needs to know about it."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float = 0.0
    # Per response token, under the sampling engine; optional.
    rollout_logprobs: list[float] | None = None
    reward: float = 0.0
    # Index of the prompt the sample answers (groups share it).
    prompt_index: int = 0
    # The weights version (updates applied) that generated it, where the engine knows.
    policy_version: int | None = None

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
    # Packed only: [num_seqs + 1] boundaries in the single row.
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
    # Per-token advantages where an off-policy correction weighs tokens (else None).
    token_advantages: torch.Tensor | None = None
    # The frozen reference policy's log-probs where loss.kl_coef > 0 (else None).
    ref_logprobs: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return len(self.sample_indices)

    def __post_init__(self) -> None:
        if self.has_rollout_logprobs and self.behaviour_logprobs is None:
            self.behaviour_logprobs = self.old_logprobs.clone()


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
            raise ValueError(
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
) -> list[list[list[int]]]:
    """For every data-parallel rank, its micro-batches as lists of sample indices.

    Every rank gets the same number of micro-batches; missing ones are empty lists.
    """
    lengths = [s.num_tokens for s in samples]
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


def _sequence_arrays(s: Sample) -> tuple[list[int], list[int], list[float], list[float]]:
    ids = s.prompt_ids + s.response_ids
    p = len(s.prompt_ids)
    inputs, targets = ids[:-1], ids[1:]
    mask = [0.0] * (p - 1) + [1.0] * len(s.response_ids)
    old = [0.0] * (p - 1) + list(s.rollout_logprobs or [0.0] * len(s.response_ids))
    return inputs, targets, mask, old


def _causal(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def microbatch_width(samples: list[Sample], indices: list[int], *, packing: bool) -> int:
    """Sequence length of a micro-batch before any padding to a common shape."""
    lengths = [samples[i].num_tokens for i in indices] or [1]
    return sum(lengths) if packing else max(lengths)


def build_microbatch(
    samples: list[Sample],
    indices: list[int],
    *,
    packing: bool,
    pad_id: int = 0,
    pad_to_multiple: int = 1,
    width: int | None = None,
    rows: int | None = None,
) -> MicroBatch:
    """Tensors for one micro-batch. An empty ``indices`` gives a filler batch with no loss
    (all padding), which the general paths below build like any other.

    ``pad_to_multiple`` rounds the sequence dimension up (sequence parallelism splits it over
    tensor-parallel ranks); ``width`` and ``rows`` pad to a fixed shape (pipeline stages that
    cannot exchange shapes). Padding carries no loss and no sequence reads it.
    """
    natural = microbatch_width(samples, indices, packing=packing)
    width = _round_up(max(natural, width or 0), pad_to_multiple)
    arrays = [_sequence_arrays(samples[i]) for i in indices]
    has_rollout = bool(indices) and all(samples[i].rollout_logprobs is not None for i in indices)
    advantages = torch.tensor([samples[i].advantage for i in indices], dtype=torch.float32)
    if packing:
        lens = [len(a[0]) for a in arrays]
        total = sum(lens)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        # The tail padding is a segment of its own, so no sequence attends to it.
        bounds = [*cu.tolist(), width] if width > total else cu.tolist()
        mask = torch.ones(width, width, dtype=torch.bool)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            mask[a:b, a:b] = _causal(b - a)
        tail = width - total

        def row(parts: list[list], value) -> torch.Tensor:
            return torch.tensor([sum(parts, []) + [value] * tail])

        return MicroBatch(
            tokens=row([a[0] for a in arrays], pad_id),
            position_ids=torch.cat([torch.arange(n) for n in [*lens, tail]])[None],
            attention_mask=mask[None, None],
            targets=row([a[1] for a in arrays], pad_id),
            loss_mask=row([a[2] for a in arrays], 0.0),
            advantages=advantages,
            old_logprobs=row([a[3] for a in arrays], 0.0),
            cu_seqlens=cu,
            sample_indices=list(indices),
            padding_mask=torch.arange(width)[None] >= total,
            has_rollout_logprobs=has_rollout,
        )
    # Empty rows (fixed shapes, or a filler batch) are sequences with no tokens: they
    # contribute nothing.
    empty = max(0, (rows or 1) - len(arrays))
    arrays += [([], [], [], [])] * empty
    advantages = torch.cat([advantages, torch.zeros(empty)])

    def pad(parts: list[list], value) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in parts])

    return MicroBatch(
        tokens=pad([a[0] for a in arrays], pad_id),
        position_ids=torch.arange(width).expand(len(arrays), width).clone(),
        # Padding sits after each sequence, so causal attention never reads it.
        attention_mask=_causal(width)[None, None],
        targets=pad([a[1] for a in arrays], pad_id),
        loss_mask=pad([a[2] for a in arrays], 0.0),
        advantages=advantages,
        old_logprobs=pad([a[3] for a in arrays], 0.0),
        cu_seqlens=None,
        sample_indices=list(indices),
        padding_mask=torch.arange(width)[None] >= torch.tensor([[len(a[0])] for a in arrays]),
        has_rollout_logprobs=has_rollout,
    )
