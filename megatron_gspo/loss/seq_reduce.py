"""Per-sequence reductions over padded or packed token layouts, and the CP all-reduce.

The policy losses only ever need two operations on token-shaped tensors: "sum each sequence's
tokens" and "give every token its sequence's value". Both layouts implement them here so the
loss math is written once:

- padded ``[B, T]``: sequence ``i`` is row ``i``;
- packed (THD) ``[total_tokens]`` with ``cu_seqlens`` ``[B + 1]``: sequence ``i`` is
  ``values[cu_seqlens[i]:cu_seqlens[i + 1]]``.

Under context parallelism a sequence's tokens are spread over the ranks of ``cp_group``; each
rank reduces its own tokens and :func:`all_reduce_sum` completes the sum. Its backward is the
identity: every rank's local tokens receive the gradient of the *global* per-sequence sum, so
the per-rank gradients are the single-rank gradient restricted to each rank's tokens (and their
sum over ranks, as done by the data/context-parallel gradient all-reduce, is the full one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "PaddedSequences",
    "PackedSequences",
    "SequenceLayout",
    "all_reduce_sum",
    "group_size",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Size of ``group``; ``None`` (or no initialised process group) means a single rank."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _AllReduceSumIdentityGrad(torch.autograd.Function):
    """Forward: SUM all-reduce. Backward: identity.

    The forward result is one global quantity that every rank then uses identically (the loss
    is replicated across the group). The gradient each rank receives for it is therefore already
    the gradient of the global quantity, and each rank's local addends contribute with weight
    one: passing it through unchanged is exact. (Summing the incoming gradients across ranks,
    the textbook adjoint of an all-reduce, would count the replicated loss once per rank.)
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        return grad_output, None


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """SUM all-reduce over ``group`` whose backward is the identity; a no-op for one rank.

    Use it only for a quantity that every rank of ``group`` goes on to use identically (see the
    module docstring); the result of the loss built on it is then the same on every rank.
    """
    if group_size(group) == 1:
        return tensor
    return _AllReduceSumIdentityGrad.apply(tensor, group)


class SequenceLayout:
    """Interface shared by the two layouts (documentation only; see the subclasses)."""

    num_sequences: int

    def seq_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``[...tokens]`` -> ``[num_sequences]``: the sum of each sequence's token values."""
        raise NotImplementedError

    def to_tokens(self, per_seq: torch.Tensor) -> torch.Tensor:
        """``[num_sequences]`` -> token layout: each token gets its sequence's value."""
        raise NotImplementedError


class PaddedSequences(SequenceLayout):
    """Rows of a ``[B, T]`` tensor are sequences."""

    def __init__(self, batch: int, seq_len: int) -> None:
        self.num_sequences = batch
        self.token_shape = (batch, seq_len)

    def seq_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values.sum(dim=-1)

    def to_tokens(self, per_seq: torch.Tensor) -> torch.Tensor:
        return per_seq.unsqueeze(-1).expand(self.token_shape)


class PackedSequences(SequenceLayout):
    """Segments of a 1-D packed tensor, delimited by ``cu_seqlens`` (THD layout).

    ``cu_seqlens`` must start at 0, be non-decreasing and end at the number of tokens (empty
    segments are allowed). Under CP pass this rank's own ``cu_seqlens`` (the boundaries of its
    shard of every sequence), so segment ``i`` is sequence ``i`` on every rank.
    """

    def __init__(self, cu_seqlens: torch.Tensor, total_tokens: int) -> None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(
                f"cu_seqlens must be 1-D [num_seqs + 1], got {tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.is_floating_point():
            raise TypeError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        # One host sync on a tiny tensor buys a clear error instead of silent mis-segmentation.
        first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
        if first != 0 or last != total_tokens or bool((lengths < 0).any()):
            raise ValueError(
                f"cu_seqlens must rise from 0 to the number of tokens ({total_tokens}); "
                f"got {cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else 'a longer tensor'}"
            )
        self.num_sequences = lengths.numel()
        self.total_tokens = total_tokens
        self.segment_ids = torch.repeat_interleave(
            torch.arange(self.num_sequences, device=cu_seqlens.device),
            lengths,
            output_size=total_tokens,
        )

    def seq_sum(self, values: torch.Tensor) -> torch.Tensor:
        # index_add is differentiable; on CUDA it accumulates with atomics unless
        # torch.use_deterministic_algorithms(True) is set.
        out = values.new_zeros(self.num_sequences)
        return out.index_add(0, self.segment_ids.to(values.device), values)

    def to_tokens(self, per_seq: torch.Tensor) -> torch.Tensor:
        return per_seq[self.segment_ids.to(per_seq.device)]
