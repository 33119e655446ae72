"""A micro-batch without a real token must add nothing to the router's load-balancing loss.

The training step passes every micro-batch's padding mask to the routers, so padding (rows
padded to one width, packing fill, sequence-parallel rounding) never counts in the loss.
Megatron-Core 0.16 then divides by the number of real tokens of the micro-batch (over the
TP x CP group, or with DP for ``global_aux_loss``); for a filler micro-batch (a data-parallel
rank with fewer micro-batches than the others runs one to keep expert dispatch in step) that
number is 0, and ``0 * (c / 0)`` is NaN in the loss and in every router gradient. Counting at
least one token leaves every real micro-batch unchanged (its count is >= 1) and gives the filler
a loss of exactly 0: its probabilities and token counts are all masked to 0.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import router

_original = router.switch_load_balancing_loss_func


def _at_least_one_token(probs, tokens_per_expert, total_num_tokens, *args, **kwargs):
    if isinstance(total_num_tokens, torch.Tensor):
        total_num_tokens = total_num_tokens.clamp_min(1)
    else:
        total_num_tokens = max(total_num_tokens, 1)
    return _original(probs, tokens_per_expert, total_num_tokens, *args, **kwargs)


def guard_empty_microbatches() -> None:
    """Install the guard in Megatron-Core's router module (idempotent)."""
    router.switch_load_balancing_loss_func = _at_least_one_token
