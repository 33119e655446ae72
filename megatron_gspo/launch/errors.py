"""The one error launch raises for a job that cannot run as asked."""

from __future__ import annotations

from megatron_gspo.runtime.errors import InputError


class LaunchError(InputError):
    """The allocation cannot host the requested layout; the message says what to change."""
