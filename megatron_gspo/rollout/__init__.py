"""Rollout engines: the embedded one (``local``) and a vLLM service client (``vllm``)."""

from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutEngine,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)

__all__ = ["Completion", "RolloutEngine", "RolloutRequest", "RolloutResult", "SamplingParams"]
