"""Vocabulary-parallel token log-probabilities and entropy, in fp32, chunk by chunk.

Why this is not ``log_softmax(logits.float()).gather(...)``: for a Qwen3-sized vocabulary
(151,936) and a few thousand tokens, the fp32 copy of the logits, the log-softmax output saved
for backward and the fp32 gradient are each several GB. GSPO's clip range (3e-4) is below bf16
resolution, so the arithmetic must be fp32, but it need never be fp32 for *all* rows at once.

Layout contract (Megatron's vocab-parallel output layer): ``logits[..., V_local]`` on rank ``r``
of ``tp_group`` holds the global vocabulary ids ``[r * V_local, (r + 1) * V_local)``. Targets are
global ids. Per row we all-reduce three things over ``tp_group`` -- the max logit (MAX), then the
sum of ``exp(z - max)``, the target logit (present on exactly one rank, zero elsewhere) and, for
the entropy, ``sum exp(z - max) * (z - max)`` (one SUM) -- never the vocabulary itself.

Backward needs no communication for the log-prob term: with the global log-sum-exp saved,
``d logp_t / d z_v = onehot_v - exp(z_v - lse)`` is local to each shard. The entropy term
``dH/dz_v = -p_v (log p_v + H)`` needs the global ``H`` per row, which forward saves too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.seq_reduce import group_size

__all__ = ["token_logprobs", "DEFAULT_CHUNK_ELEMENTS"]

# Rows per chunk are chosen so one fp32 work buffer holds about this many elements (64 MiB).
# Forward keeps at most two such buffers alive and backward two, so the extra memory of the
# op is bounded independently of the number of tokens.
DEFAULT_CHUNK_ELEMENTS = 1 << 24

# Logits of -inf (masked vocabulary entries) would give 0 * inf = NaN in the entropy terms.
# Clamping the shifted logits to this value keeps every product finite; exp() of it is 0.
_NEG_LARGE = -1e30


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 logits; fp64 logits (used by tests) keep their precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(chunk_size: int | None, vocab_local: int) -> int:
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_ELEMENTS // max(1, vocab_local))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    return chunk_size


class _TokenLogprobs(torch.autograd.Function):
    """Autograd op over 2-D logits ``[N, V_local]``; returns ``(logprobs[N], entropy[N])``.

    Saved for backward: the logits in their own dtype (a reference, not a copy), the targets,
    the per-row fp32 log-sum-exp and, when the entropy was computed, the per-row fp32 entropy.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        rows_per_chunk: int,
        with_entropy: bool,
        vocab_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        padded_logits = logits
        n_rows, vocab_local = logits.shape
        compute_dtype = _compute_dtype(logits.dtype)
        tp_size = group_size(tp_group)
        vocab_start = dist.get_rank(tp_group) * vocab_local if tp_size > 1 else 0
        # Vocabulary padding (ids >= vocab_size) is no token: its columns are left out.
        real = (
            vocab_local
            if vocab_size is None
            else max(0, min(vocab_local, vocab_size - vocab_start))
        )
        logits = logits[:, :real]
        vocab_local = real

        # Which rows' targets live on this shard, and where.
        local_ids = targets - vocab_start
        in_shard = (local_ids >= 0) & (local_ids < vocab_local)
        local_ids = torch.where(in_shard, local_ids, torch.zeros_like(local_ids))

        # max and gather are exact in the logits' own dtype, so no fp32 copy is needed for them.
        if real:
            row_max = logits.max(dim=-1).values.to(compute_dtype)
            target_logit = logits.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1)
            target_logit = target_logit.to(compute_dtype)
        else:  # a shard of padding only
            row_max = logits.new_full((n_rows,), float("-inf"), dtype=compute_dtype)
            target_logit = row_max.new_zeros(n_rows)
        target_logit = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
        if tp_size > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)

        # One fp32 buffer for the shifted logits, one for their exponentials; reused per chunk.
        # Buffers are sized once: allocating per chunk would page-fault on every chunk on CPU.
        rows = min(rows_per_chunk, n_rows)
        shifted_buf = logits.new_empty((rows, vocab_local), dtype=compute_dtype)
        exp_buf = torch.empty_like(shifted_buf)
        sum_exp = torch.empty(n_rows, dtype=compute_dtype, device=logits.device)
        sum_exp_shifted = torch.empty_like(sum_exp) if with_entropy else None
        for start in range(0, n_rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, n_rows)
            shifted = shifted_buf[: stop - start]
            shifted.copy_(logits[start:stop])
            shifted.sub_(row_max[start:stop, None])
            exps = torch.exp(shifted, out=exp_buf[: stop - start])
            torch.sum(exps, dim=-1, out=sum_exp[start:stop])
            if with_entropy:
                shifted.clamp_(min=_NEG_LARGE)
                exps.mul_(shifted)
                torch.sum(exps, dim=-1, out=sum_exp_shifted[start:stop])
        del shifted_buf, exp_buf

        if tp_size > 1:
            parts = [sum_exp, target_logit] + ([sum_exp_shifted] if with_entropy else [])
            stacked = torch.stack(parts)
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=tp_group)
            sum_exp, target_logit = stacked[0], stacked[1]
            if with_entropy:
                sum_exp_shifted = stacked[2]

        lse = row_max + torch.log(sum_exp)
        logprobs = target_logit - lse
        if with_entropy:
            # H = lse - sum_v p_v z_v = log(S) - sum_v e_v (z_v - max) / S.
            entropy = torch.log(sum_exp) - sum_exp_shifted / sum_exp
        else:
            entropy = logprobs.new_empty(0)

        ctx.rows_per_chunk = rows_per_chunk
        ctx.with_entropy = with_entropy
        ctx.real = real
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(padded_logits, local_ids, in_shard, lse, entropy)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ):
        padded_logits, local_ids, in_shard, lse, entropy = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_padded = torch.empty_like(padded_logits)
        grad_padded[:, ctx.real :] = 0  # the vocabulary padding takes no gradient
        if not ctx.real:
            return grad_padded, None, None, None, None, None
        logits = padded_logits[:, : ctx.real]
        n_rows, vocab_local = logits.shape
        rows_per_chunk = ctx.rows_per_chunk
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        grad_logprobs = grad_logprobs.to(lse.dtype)

        # The one-hot term only touches the target column of rows whose target is on this shard.
        target_grad = torch.where(in_shard, grad_logprobs, torch.zeros_like(grad_logprobs))

        grad_logits = grad_padded[:, :vocab_local]
        rows = min(rows_per_chunk, n_rows)
        work_buf = logits.new_empty((rows, vocab_local), dtype=lse.dtype)
        prob_buf = torch.empty_like(work_buf) if grad_entropy is not None else None
        for start in range(0, n_rows, rows_per_chunk):
            stop = min(start + rows_per_chunk, n_rows)
            work = work_buf[: stop - start]
            work.copy_(logits[start:stop])
            work.sub_(lse[start:stop, None])  # log p
            g_lp = grad_logprobs[start:stop, None]
            if grad_entropy is None:
                # grad = -p * g_lp (+ g_lp at the target, below).
                work.exp_().mul_(-g_lp)
            else:
                # grad = -p * (g_lp + g_H * (log p + H)) (+ g_lp at the target, below).
                work.clamp_(min=_NEG_LARGE)
                probs = torch.exp(work, out=prob_buf[: stop - start])
                work.add_(entropy[start:stop, None])
                work.mul_(grad_entropy.to(lse.dtype)[start:stop, None]).add_(g_lp)
                work.mul_(probs).neg_()
            work.scatter_add_(1, local_ids[start:stop, None], target_grad[start:stop, None])
            grad_logits[start:stop].copy_(work)
        return grad_padded, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fp32 log-probability of each target token (and the fp32 entropy of each row, if asked).

    Args:
        logits: ``[..., V_local]`` in any float dtype; the vocabulary is split contiguously over
            ``tp_group`` (rank ``r`` owns ids ``[r * V_local, (r + 1) * V_local)``).
        targets: global vocabulary ids, shape ``logits.shape[:-1]``. Ids must lie in the global
            vocabulary; positions that the loss masks out may hold any such id. An id outside
            it yields a finite but meaningless value.
        tp_group: the tensor-parallel group holding the vocabulary shards. ``None`` (or a group
            of one) means the logits hold the whole vocabulary and nothing is communicated --
            note ``None`` does *not* mean the default world group here.
        return_entropy: also return the entropy of the full-vocabulary distribution per row.
        chunk_size: rows converted to fp32 at a time. ``None`` picks the number of rows whose
            fp32 copy is about 64 MiB (``DEFAULT_CHUNK_ELEMENTS``), which bounds the op's extra
            memory independently of the number of tokens.
        vocab_size: the real vocabulary, where the model pads it (Megatron's rows up to a
            multiple of TP): ids from ``vocab_size`` on take no probability, no entropy and no
            gradient, as if the logits stopped there.

    Returns:
        ``logprobs`` of shape ``logits.shape[:-1]`` in fp32 (fp64 for fp64 logits), or
        ``(logprobs, entropy)``. Both are differentiable; the gradient wrt ``logits`` comes back
        in the logits' dtype.

    Pass the logits in the layout they come in (e.g. Megatron's ``[s, b, V_local]``, with the
    targets transposed to ``[s, b]``): a non-contiguous view would be copied by the reshape.

    Forward performs one MAX and one SUM all-reduce over ``tp_group`` (on ``[N]`` and
    ``[2 or 3, N]`` fp32 tensors); backward performs none.
    """
    if logits.dim() < 1 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape logits.shape[:-1]; got logits {tuple(logits.shape)} "
            f"and targets {tuple(targets.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    batch_shape = logits.shape[:-1]
    vocab_local = logits.shape[-1]
    logits_2d = logits.reshape(-1, vocab_local)
    targets_1d = targets.reshape(-1).long()
    rows_per_chunk = _rows_per_chunk(chunk_size, vocab_local)
    logprobs, entropy = _TokenLogprobs.apply(
        logits_2d, targets_1d, tp_group, rows_per_chunk, return_entropy, vocab_size
    )
    logprobs = logprobs.view(batch_shape)
    if return_entropy:
        return logprobs, entropy.view(batch_shape)
    return logprobs
