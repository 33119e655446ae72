"""RMSNorm for the local (no Transformer Engine) layer spec.

Megatron's local spec wraps ``torch.nn.RMSNorm``, which refuses sequence parallelism because
nothing marks its weight for the gradient all-reduce over the tensor-parallel group that
sequence parallelism needs. Megatron requires sequence parallelism for MoE layers under tensor
parallelism, so without this module TP>1 MoE could not run without Transformer Engine.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """Normalizes in fp32 and scales in the input dtype, as Hugging Face's Qwen3 does."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-6,
        fixed_eps: float | None = None,
        **unused: object,
    ) -> None:
        super().__init__()
        # fixed_eps (from the layer spec) overrides the config's epsilon Megatron passes in.
        self.eps = eps if fixed_eps is None else fixed_eps
        # Where Megatron's own layers put their weights: the current GPU unless told otherwise
        # (None: the default device, or the one a `with torch.device(...)` block sets).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=device)
        )
        # Read by finalize_model_grads: under sequence parallelism each TP rank sees a slice of
        # the sequence, so this weight's gradient is a partial sum across the TP group.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)
