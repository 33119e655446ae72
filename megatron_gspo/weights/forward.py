"""The model without training around it: load for a forward pass, and full-vocabulary logits.

For evaluation, parity checks against another implementation, and export: :func:`load_model`
builds this rank's stage and loads a checkpoint saved in any layout, with no DDP wrapper, no
optimizer and no gradients; :func:`full_vocab_logits` runs a batch through Megatron-Core's
forward-only schedule (so pipeline stages hand activations on) and returns the logits over the
tokenizer's vocabulary on every rank: gathered over TP, the padding rows cut off, broadcast
from the last pipeline stage.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_gspo.config import ModelConfig, ParallelConfig, PrecisionConfig
from megatron_gspo.model.provider import build_model

__all__ = ["full_vocab_logits", "load_model"]


def load_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    checkpoint: str | Path | None = None,
    *,
    precision: PrecisionConfig | None = None,
) -> GPTModel:
    """This rank's stage in eval mode, its weights from ``checkpoint`` (a Megatron checkpoint
    in any layout, e.g. from ``megatron-gspo convert``) or freshly initialized. Parallel state
    must be initialized (``megatron_gspo.parallel.init_parallel``)."""
    from megatron_gspo.weights.dist_ckpt import load_model_weights

    gpt = build_model(model, parallel, precision)
    gpt.requires_grad_(False)
    if checkpoint is not None:
        load_model_weights(gpt, checkpoint)
    return gpt.eval()


@torch.no_grad()
def full_vocab_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]`` fp32 logits of causal ``tokens`` ``[b, s]`` on every rank.

    Collective over the model-parallel ranks (TP and PP). Sequence parallelism needs ``s`` to
    split over TP: the batch is right-padded, which causal attention never reads, and the
    padding is cut off again. Context parallelism is not supported here.
    """
    if model.config.context_parallel_size > 1:
        raise ValueError("full_vocab_logits does not split sequences over context parallelism")
    b, s = tokens.shape
    tp = model.config.tensor_model_parallel_size if model.config.sequence_parallel else 1
    width = -(-s // tp) * tp
    padded = torch.zeros(b, width, dtype=tokens.dtype)
    padded[:, :s] = tokens
    positions = torch.arange(width)[None].expand(b, width)
    mask = torch.ones(width, width, dtype=torch.bool).triu(1)[None, None]
    out: list[torch.Tensor] = []

    def forward_step(data_iterator, stage):
        next(data_iterator)
        logits = stage(padded, positions, mask, runtime_gather_output=True)

        def loss_func(output):
            out.append(output.float())
            return output.sum() * 0, torch.tensor(1), {}

        return logits, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=width,
        micro_batch_size=b,
        forward_only=True,
    )
    vocab = model.vocab_size_unpadded
    logits = out[0][:, :s, :vocab].contiguous() if out else torch.empty(b, s, vocab)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(logits, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return logits
