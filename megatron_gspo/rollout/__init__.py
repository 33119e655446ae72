"""Rollout engines: the embedded one (``local``) and a vLLM service client (``vllm``)."""

from megatron_gspo.rollout.protocol import (
    Completion,
    RolloutEngine,
    RolloutRequest,
    RolloutResult,
    SamplingParams,
)

__all__ = [
    "Completion",
    "RolloutEngine",
    "RolloutRequest",
    "RolloutResult",
    "SamplingParams",
    "make_engine",
]


def make_engine(recipe, policy) -> RolloutEngine:
    """The recipe's rollout engine for this rank's policy."""
    if recipe.rollout.engine == "local":
        from megatron_gspo.rollout.local import LocalEngine

        return LocalEngine(policy.model)
    from megatron_gspo.rollout.vllm import VLLMEngine

    return VLLMEngine.from_recipe(recipe, policy)
