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
    """The recipe's rollout engine for this rank's policy.

    With ``rollout.max_staleness >= 1`` the engine must generate from rank 0 while the trainer
    runs (``generate_rank0``): vLLM does; the embedded engine then runs in a generation worker
    process (:mod:`megatron_gspo.rollout.local_worker`) instead of in the trainer's.
    """
    if recipe.rollout.engine == "local":
        if recipe.rollout.local_worker or recipe.rollout.max_staleness >= 1:
            from megatron_gspo.rollout.local_worker import LocalWorkerEngine

            return LocalWorkerEngine(policy.model, recipe.model, recipe.precision)
        from megatron_gspo.rollout.local import LocalEngine

        return LocalEngine(policy.model)
    from megatron_gspo.rollout.vllm import VLLMEngine

    in_flight = recipe.rollout.in_flight_updates
    return VLLMEngine(
        recipe.rollout.vllm,
        recipe.model,
        policy.model,
        in_flight=None if in_flight is None else in_flight.mode,
    )
