"""Aux-loss-free balancing counts no padding (a fix of Megatron-Core 0.16.1's router).

With ``moe_router_enable_expert_bias`` every router counts the tokens it sends to each expert
(``TopKRouter._apply_expert_bias``), and ``finalize_model_grads`` moves each expert's bias
towards balance from those counts. Megatron leaves padding out with ``routing_map &
~padding_mask``: a ``[tokens, experts]`` map against a ``[tokens]`` mask, which broadcasts
along the experts (an error, or a wrong count where there are as many experts as tokens). The
replacement masks the padding's rows.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

__all__ = ["count_expert_tokens_without_padding"]


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
    # Only forwards with gradients count (training, and its recompute in backward, which
    # doubles every count alike: the update goes by their signs against the mean).
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def count_expert_tokens_without_padding() -> None:
    """Install the fix in Megatron-Core's router (idempotent)."""
    TopKRouter._apply_expert_bias = _apply_expert_bias
