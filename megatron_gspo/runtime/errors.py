"""The errors a user can act on: the command line reports them as one line, no traceback.

Collected here, lazily, so the CLI names them without importing the modules that raise them
(and their heavy dependencies) before it needs to. ``MEGATRON_GSPO_DEBUG=1`` adds the
traceback, for every command.
"""

from __future__ import annotations

import os
import pickle


def debug_enabled() -> bool:
    """``MEGATRON_GSPO_DEBUG`` set to anything but empty or 0: tracebacks and Megatron's
    import-time warnings are shown."""
    return os.environ.get("MEGATRON_GSPO_DEBUG", "") not in ("", "0")


def user_errors() -> tuple[type[BaseException], ...]:
    from megatron_gspo.data.prompts import DataError
    from megatron_gspo.rollout.vllm.client import VLLMRequestError, VLLMUnavailableError
    from megatron_gspo.rollout.vllm.sync import WeightSyncError
    from megatron_gspo.run.kl_guard import RolloutMismatchError
    from megatron_gspo.run.recipe import RecipeError
    from megatron_gspo.runtime.extras import MissingExtraError
    from megatron_gspo.weights.manifest import CheckpointError
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
        # A file that cannot be read or written (missing, a directory in the way, no space,
        # no permission): named with its path by one_line.
        OSError,
        ValueError,
    )


def one_line(error: BaseException) -> str:
    """The error's message, first line first; the rest (context lines) kept below it."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        return f"{error.filename}: {error.strerror}"
    text = str(error).strip() or type(error).__name__
    if isinstance(error, pickle.UnpicklingError):
        return f"refused to unpickle: {text.splitlines()[0]}"
    return text
