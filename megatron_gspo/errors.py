"""The errors a user can act on: the command line reports them as one line, no traceback.

Collected here, lazily, so the CLI names them without importing the modules that raise them
(and their heavy dependencies) before it needs to.
"""

from __future__ import annotations

import pickle

# The exit status of a run stopped by SIGTERM after saving a checkpoint (EX_TEMPFAIL): "resume
# me". The sbatch recipes requeue on it; launch passes it on through torchrun, which would
# report any non-zero rank as a failure, by looking for the marker the run leaves.
EXIT_PREEMPTED = 75
PREEMPTED_MARKER = ".preempted"


def user_errors() -> tuple[type[BaseException], ...]:
    from megatron_gspo.checkpoint import CheckpointError
    from megatron_gspo.data.prompts import DataError
    from megatron_gspo.extras import MissingExtraError
    from megatron_gspo.recipe import RecipeError
    from megatron_gspo.rollout.kl_guard import RolloutMismatchError
    from megatron_gspo.rollout.vllm.client import VLLMRequestError, VLLMUnavailableError
    from megatron_gspo.rollout.vllm.sync import WeightSyncError
    from megatron_gspo.weights.safetensors_io import SafetensorsError

    return (
        RecipeError,
        DataError,
        MissingExtraError,
        CheckpointError,
        VLLMRequestError,
        VLLMUnavailableError,
        WeightSyncError,
        RolloutMismatchError,
        SafetensorsError,
        pickle.UnpicklingError,
        FileNotFoundError,
        ValueError,
    )


def one_line(error: BaseException) -> str:
    """The error's message, first line first; the rest (context lines) kept below it."""
    text = str(error).strip() or type(error).__name__
    if isinstance(error, pickle.UnpicklingError):
        return f"refused to unpickle: {text.splitlines()[0]}"
    return text
