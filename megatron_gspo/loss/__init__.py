"""Loss layer: vocab-parallel log-probs, per-sequence reductions, policy losses, advantages.

Pure math on tensors plus explicit process groups; nothing here reads global parallel state.
"""

from megatron_gspo.loss.advantages import group_advantages, returns_to_go, turn_advantages
from megatron_gspo.loss.logprobs import token_logprobs
from megatron_gspo.loss.policy_loss import (
    POLICY_LOSSES,
    PolicyLossFn,
    get_policy_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from megatron_gspo.loss.seq_reduce import PackedSequences, PaddedSequences, all_reduce_sum

__all__ = [
    "POLICY_LOSSES",
    "PackedSequences",
    "PaddedSequences",
    "PolicyLossFn",
    "all_reduce_sum",
    "get_policy_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "returns_to_go",
    "token_logprobs",
    "turn_advantages",
]
