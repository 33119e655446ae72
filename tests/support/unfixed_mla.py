"""The project's vLLM worker extension without its MLA rotary correction: a DeepSeek-V3 served
by vLLM's CPU build then computes another model than the trainer (vLLM 0.32's CPU rotary kernel
misreads MLA's query layout; :mod:`megatron_gspo.rollout.vllm.cpu_rope`). For the test that
``rollout.max_rollout_kl`` stops such a run (test_rollout_vllm_deepseek.py).

    --worker-extension-cls tests.support.unfixed_mla.UnfixedExtension
"""

from __future__ import annotations

import megatron_gspo.rollout.vllm.cpu_rope as cpu_rope

# The extension applies the correction when it is imported: take it away first.
cpu_rope.fix_cpu_rotary_embedding = lambda: None

from megatron_gspo.rollout.vllm.extension import WeightSyncExtension  # noqa: E402

__all__ = ["UnfixedExtension"]


class UnfixedExtension(WeightSyncExtension):
    """Weight sync and versions as always; vLLM's own CPU rotary kernel for MLA."""
