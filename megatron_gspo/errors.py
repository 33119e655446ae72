"""The errors a user can act on: the command line reports them as one line, no traceback.

Collected here, lazily, so the CLI names them without importing the modules that raise them
(and their heavy dependencies) before it needs to. ``MEGATRON_GSPO_DEBUG=1`` adds the
traceback, for every command.
"""

from __future__ import annotations

import os
import pickle
import signal

# The exit status of a run stopped by SIGTERM after saving a checkpoint (EX_TEMPFAIL): "resume
# me". The sbatch recipes requeue on it; launch passes it on through torchrun, which would
# report any non-zero rank as a failure, by looking for the marker the run leaves.
EXIT_PREEMPTED = 75
PREEMPTED_MARKER = ".preempted"


def debug_enabled() -> bool:
    """``MEGATRON_GSPO_DEBUG`` set to anything but empty or 0: tracebacks and Megatron's
    import-time warnings are shown."""
    return os.environ.get("MEGATRON_GSPO_DEBUG", "") not in ("", "0")


def user_errors() -> tuple[type[BaseException], ...]:
    from megatron_gspo.data.prompts import DataError
    from megatron_gspo.extras import MissingExtraError
    from megatron_gspo.manifest import CheckpointError
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


# -- SIGTERM -----------------------------------------------------------------------------------

_sigterm_received = False


def _on_sigterm(signum, frame) -> None:
    global _sigterm_received
    _sigterm_received = True


def catch_sigterm() -> None:
    """From now on SIGTERM (Slurm pre-emption, ``scontrol requeue``, a time limit) only sets a
    flag that the trainer reads: it finishes the step, saves and exits 75, or, before its
    first step, exits 75 having written nothing. Installed first thing, so that a SIGTERM
    during start-up (imports, process groups, loading) is not the end of the process."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def sigterm_received() -> bool:
    return _sigterm_received
