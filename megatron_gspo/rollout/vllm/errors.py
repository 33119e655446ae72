"""Trainer side: the errors a vLLM server's answers (or silence) raise in the trainer."""

from __future__ import annotations

from megatron_gspo.rollout.protocol import EngineDownError
from megatron_gspo.runtime.errors import UserError

__all__ = [
    "FleetDownError",
    "NoServerError",
    "VLLMRequestError",
    "VLLMServerError",
    "VLLMUnavailableError",
]


class VLLMUnavailableError(UserError, RuntimeError):
    """A vLLM server could not be reached (or kept failing); the message names its URL."""


class VLLMRequestError(UserError, RuntimeError):
    """A vLLM server refused a request (4xx) or answered something unexpected."""


class VLLMServerError(VLLMUnavailableError):
    """A server kept answering 5xx; the message carries its last answer."""


class FleetDownError(VLLMUnavailableError, EngineDownError):
    """Fewer servers serve than ``rollout.vllm.min_servers``: the run checkpoints and exits 75,
    so that Slurm requeues it (the servers' supervisors restart them meanwhile)."""


class NoServerError(RuntimeError):
    """No server of the fleet serves right now (the caller waits, or gives up at its deadline)."""
