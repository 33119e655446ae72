"""Loss layer: vocab-parallel log-probs, per-sequence reductions, policy losses, advantages.

Pure math on tensors plus explicit process groups; nothing here reads global parallel state.
"""

from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.loss.logprobs import token_logprobs
from megatron_gspo.loss.policy_loss import (
    PACKED_POLICY_LOSSES,
    POLICY_LOSSES,
    PolicyLossFn,
    get_policy_loss,
    grpo_loss,
    grpo_loss_packed,
    gspo_loss,
    gspo_loss_packed,
    gspo_token_loss,
    gspo_token_loss_packed,
)
from megatron_gspo.loss.seq_reduce import PackedSequences, PaddedSequences, all_reduce_sum

__all__ = [
    "PACKED_POLICY_LOSSES",
    "POLICY_LOSSES",
    "PackedSequences",
    "PaddedSequences",
    "PolicyLossFn",
    "all_reduce_sum",
    "get_policy_loss",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_packed",
    "gspo_loss",
    "gspo_loss_packed",
    "gspo_token_loss",
    "gspo_token_loss_packed",
    "token_logprobs",
]
